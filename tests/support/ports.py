"""Ports for test peers, never derived from a pid, and never from the kernel's ephemeral range.

A server process binds the port a test chose seconds later (a vLLM server takes ~15 s to start). A port from the
ephemeral range (what bind(0) and every outgoing connection draw from) can be taken meanwhile by any connection on
the machine: seen once, "Address already in use" for a fault prefill's side channel. Ports below that range are
only ever bound on purpose.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below: well-known and registered services' habits


def _candidates() -> range:
    """Ports below the ephemeral range (Linux); elsewhere none: bind(0) decides."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(_LOWEST, low)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(attempts: int = 200) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range where there is one."""
    ports = _candidates()
    for _ in range(attempts if ports else 0):
        port = random.choice(ports)
        if _bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_range(count: int, attempts: int = 200) -> int:
    """A base port whose ``count`` consecutive ports were all free (TP rank r listens on base + r)."""
    for _ in range(attempts):
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports after {attempts} tries")

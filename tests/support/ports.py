"""Ports for test peers, taken from the OS (bind to port 0), never derived from a pid."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS chose it)."""
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

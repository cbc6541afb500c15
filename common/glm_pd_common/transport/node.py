"""Which node a transport runs on, as its peers compare it: cuda_ipc reaches only processes of its own host.

The id is the running kernel's boot id (``/proc/sys/kernel/random/boot_id``), hashed. Every process and every
container on one host shares the kernel, so they share it until the host reboots; another host, or a VM, has its
own kernel and so another id. A hostname would not do: each container has its own, although two containers on one
host can reach each other's GPU memory by cuda_ipc (given the GPUs and the IPC namespace; UCX's probe says whether
it does). Hashed so that a peer learns nothing but the comparison, and the ids stay short in an error line.
"""

from __future__ import annotations

import functools
import hashlib
import socket
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def node_id() -> str:
    """This host's id (16 hex digits); from the hostname where the kernel says no boot id (not Linux)."""
    try:
        seed = "boot:" + _BOOT_ID.read_text().strip()
    except OSError:
        seed = "host:" + socket.gethostname()
    return hashlib.sha256(b"glm-pd node\0" + seed.encode()).hexdigest()[:16]

"""What a run records of where it ran: the packages, the GPU and driver, ``UCX_*``, and this process's UCX log
(where ``UCX_PROTO_INFO=y`` prints the protocol UCX picked for each operation, which ``paths`` reads)."""

from __future__ import annotations

import ctypes
import importlib
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


class UcxLog:
    """This process's UCX log. UCX writes to the C ``stdout``: file descriptor 1 goes to ``path`` before UCX
    loads, and Python's ``sys.stdout`` to a copy of the old descriptor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        sys.stdout.flush()
        kept = os.dup(1)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.close(fd)
        sys.stdout = os.fdopen(kept, "w", buffering=1)

    def text(self) -> str:
        flush_c_stdio()
        return self.path.read_text(errors="replace")


def flush_c_stdio() -> None:
    """UCX's log lines sit in the C library's buffer until flushed."""
    ctypes.CDLL(None).fflush(None)


def nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def environment(machine: dict[str, Any]) -> dict[str, Any]:
    """``machine`` (what the memory kind says of its device) with the software the run used."""
    return {
        **machine,
        "python": sys.version.split()[0],
        "nixl": version("nixl"),
        "nixl_cu": version("nixl-cu13") if version("nixl-cu13") != "unknown" else version("nixl-cu12"),
        "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
    }


def unavailable(memory: str) -> str | None:
    """Why the bench cannot run here, or None (on a GPU: the smoke's reasons)."""
    if memory == "cuda":
        from tests.gpu.smoke import unavailable as gpu_unavailable

        return gpu_unavailable()
    for module in ("msgspec", "xxhash", "zmq", "nixl._api"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{module} is not importable ({exc})"
    return None

"""The suites' deployment key: every engine a suite starts authenticates its side channel with it, as a deployment
off loopback must. One key per machine user, made once and shared by every process of a run (each loads it from
the same path, whichever process made it first)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from glm_pd_common.handoff.wire.trust import make_credential


def suite_credential() -> str:
    directory = Path(tempfile.gettempdir()) / f"glm-pd-suite-key-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    secret = directory / "suite.key_secret"
    with open(directory / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing it right now
        if not secret.exists():
            make_credential(directory, "suite")
    return str(secret)

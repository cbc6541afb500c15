"""The GPU scripts skip cleanly where there is no GPU: exit 77, naming what is missing, before anything starts.

A session lent a GPU has 15 minutes of device time in all, so a script that breaks before reaching the GPU costs
that session its run; this is the part of them CI can run. ``python3`` on their PATH is this interpreter (the
core venv's: no torch), and the wheels folder is empty.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["gpu_session.sh", "gpu_smoke.sh", "gpu_bench.sh"])
def test_a_gpu_script_skips_by_name_without_a_gpu(script: str, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "GLM_PD_WHEELS": str(tmp_path / "wheels"),
        "GLM_PD_SITE": str(tmp_path / "site"),
        "OUT": str(tmp_path / "out"),
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 77, out
    assert "SKIPPED: " in out and ("torch" in out or "CUDA" in out), out
    assert "gpu_session: GPU tests exit" not in out and not (tmp_path / "out").exists(), out

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


def test_the_session_runs_tests_bench_and_smoke_in_that_order_within_its_budget(tmp_path: Path) -> None:
    """Every part passing at once (``python3`` a stub that notes its arguments and time limits): the tests, then
    the bench with its row deadline inside its own limit, then the smoke; no part's limit reaches past the budget
    (each is what is left of it when the part starts, less what the parts after it keep)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text(f'#!/bin/sh\necho "$GLM_PD_GPU_TESTS_S|$GLM_PD_SMOKE_S|$GLM_PD_BENCH_S|$*" >> {log}\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GLM_PD_WHEELS": str(tmp_path / "w")}
    env |= {"GLM_PD_SITE": str(tmp_path / "site"), "GLM_PD_GPU_BUDGET_S": "450"}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_session.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [line.split("|") for line in log.read_text().splitlines() if line.split("|")[3].startswith("-m ")]
    modules = [c[3].split()[1] for c in calls]
    assert modules == ["pytest", "benchmarks.gpu_bench", "tests.gpu.smoke"], modules
    (tests_s, _, _, _), (_, _, bench_s, bench_args), (_, smoke_s, _, smoke_args) = calls
    deadline = float(bench_args.split("--deadline-s")[1].split()[0])
    assert 0 < deadline < int(bench_s) and "--pages 1024" in smoke_args
    assert all(0 < int(limit) < 450 for limit in (tests_s, bench_s, smoke_s)), (tests_s, bench_s, smoke_s)
    assert "GPU tests exit 0; bench exit 0; smoke exit 0" in proc.stdout

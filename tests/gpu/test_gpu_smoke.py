"""The GPU smoke under pytest: skipped without CUDA or NIXL; on a GPU, ``tests/gpu/smoke.py`` at a small size.

What it checks (two processes on one GPU, VRAM regions on NIXL, a plan's runs READ, bytes compared on the
device, the writer's CUDA event gating the read) is described in ``tests/gpu/smoke.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.smoke import SKIP_RC, unavailable

REPO = Path(__file__).resolve().parents[2]
REASON = unavailable()

pytestmark = pytest.mark.skipif(REASON is not None, reason=f"GPU smoke: {REASON}")


def test_gpu_smoke(tmp_path: Path) -> None:
    report_path = tmp_path / "gpu_smoke.json"
    cmd = [sys.executable, "-m", "tests.gpu.smoke", "--pages", "256", "--json", str(report_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=470)
    assert proc.returncode != SKIP_RC, proc.stdout
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["checks"]
    assert [c["check"] for c in report["checks"] if not c["ok"]] == []
    gated = [row for row in report["cases"] if row["case"] != "ungated control"]
    assert gated and all(row["bytes_final"] and row["ok"] for row in gated)

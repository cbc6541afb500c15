"""On a GPU: ``glm-pd demo --device cuda:0`` moves a GLM-5.3 request between two processes' VRAM caches (allocated
through the CUDA driver), digests read through the driver, staged slots copied by the driver, every suffix byte
and decode's prefix checked on the device. READ runs pipelined (``UCX_RMA_PPLN_ENABLE=y``: cuda_ipc without an
NVLink peer, shared/FACTS.md section 9); TCP is allowed because the demo's transport start refuses a node without
an RDMA NIC. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    ("allocator", "staging"), [("shuffled", "auto"), ("contiguous", "never"), ("shuffled", "always")]
)
def test_the_demo_hands_off_between_gpu_caches(allocator, staging):
    """``auto`` stages an 8k-token plan on a GPU (its runs are short: ``staging.stages``), ``always`` does whatever
    the plan, both through the driver's device copies; ``never`` posts every run."""
    env = {**os.environ, "UCX_RMA_PPLN_ENABLE": "y"}
    args = ["--device", "cuda:0", "--allow-tcp", "--json", "--tokens", "8k", "--prefix-tokens", "2k"]
    proc = subprocess.run(
        [sys.executable, "-m", "glm_pd_common.tools.cli", "demo", *args, "--allocator", allocator,
         "--staging", staging, "--staging-mib", "64", "--staging-slot-kib", "8192"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    print(allocator, staging, out["data_path"], f"{out['gbps']:.1f} GB/s", out["runs"], "runs", out["staged_bytes"])
    assert out["ok"] and out["memory"] == "GPU 0" and out["verified_digests"], out
    assert out["suffix_tokens_checked"] == 8 * 1024 - 2 * 1024 and out["prefill_outcome"] == "released"
    assert out["staged_bytes"] == (0 if staging == "never" else out["bytes"]["total"]), out

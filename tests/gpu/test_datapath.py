"""On a GPU: ``glm-pd doctor``'s probe of GPU memory reports what UCX chose, and the rule judges it.

Two processes on one GPU, a loopback READ and WRITE of GPU buffers through NIXL. What an H200 without an NVLink
peer did (shared/FACTS.md section 9): WRITE by cuda_ipc zero-copy, accepted; READ by software emulation over tcp,
refused naming ``UCX_RMA_PPLN_ENABLE=y``; with that set, READ by cuda_ipc, accepted. Skipped without CUDA.
"""

from __future__ import annotations

import pytest

from glm_pd_common.tools.doctor import check_ucx_path, observed_ucx_path
from glm_pd_common.transport.datapath import between_peers, judge_gpu_path

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_ucx_prints_a_table_for_gpu_reads_and_writes_and_the_doctor_reports_it():
    selections, err = observed_ucx_path("cuda")
    assert not err, err
    for op in ("READ", "WRITE"):
        chosen = between_peers(selections, op, "cuda")
        assert chosen is not None, f"no {op} table for GPU memory: {selections}"
        print(op, chosen.describe(), chosen.path)
    checks = check_ucx_path("cuda")
    verdicts = [judge_gpu_path(between_peers(selections, op, "cuda"), allow_tcp=False) for op in ("READ", "WRITE")]
    assert [c.status == "PASS" for c in checks] == [v.accepted for v in verdicts]
    write = between_peers(selections, "WRITE", "cuda")
    assert write.path in ("cuda_ipc", "rdma"), write.describe()


def test_pipelined_reads_take_cuda_ipc(monkeypatch):
    monkeypatch.setenv("UCX_RMA_PPLN_ENABLE", "y")
    selections, err = observed_ucx_path("cuda")
    assert not err, err
    read = between_peers(selections, "READ", "cuda")
    assert read is not None and judge_gpu_path(read, allow_tcp=False).accepted, read

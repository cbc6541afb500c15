"""On a GPU: ``glm-pd doctor``'s probe of GPU memory reports what UCX chose, and the rule judges it.

Two processes on one GPU, a loopback READ and WRITE of GPU buffers through NIXL. What an H200 without an NVLink
peer did (shared/FACTS.md section 9): WRITE by cuda_ipc zero-copy, accepted; READ by software emulation over tcp,
refused naming ``UCX_RMA_PPLN_ENABLE=y``; with that set, READ by cuda_ipc, accepted. Skipped without CUDA.
"""

from __future__ import annotations

import pytest

from glm_pd_common.tools.doctor import check_ucx_path
from glm_pd_common.transport.datapath import between_peers, judge_gpu_path, observe

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_ucx_prints_a_table_for_gpu_reads_and_writes_and_the_doctor_reports_it():
    selections, err = observe("cuda")
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
    selections, err = observe("cuda")
    assert not err, err
    read = between_peers(selections, "READ", "cuda")
    assert read is not None and judge_gpu_path(read, allow_tcp=False).accepted, read


def test_a_rank_that_reads_gpu_memory_reports_the_path_observed_at_registration():
    """Where the caches are on the GPU, registering them probes the path of the operation the rank posts: the
    transport's info names what UCX chose (this machine has no RDMA NIC, so TCP is allowed to start at all)."""
    from glm_pd_common.tools.flat import flat_span
    from glm_pd_common.transport.base import TransportConfig
    from glm_pd_common.transport.factory import create_transport

    selections, err = observe("cuda")
    read = between_peers(selections, "READ", "cuda")
    assert read is not None, err
    cache = torch.ones(1 << 20, dtype=torch.uint8, device="cuda:0")
    transport = create_transport("gpu-reader", TransportConfig(allow_tcp=True, posts="READ"))
    try:
        transport.register([flat_span(cache.data_ptr(), cache.numel(), "VRAM", 0)])
        path = transport.info().data_path
    finally:
        transport.close()
    print(path)
    assert read.protocol in path and read.transports[0] in path and "probed within this node" in path


def test_without_rdma_gpu_caches_move_by_cuda_ipc_to_peers_on_this_node_only():
    """No RDMA NIC and no allow_tcp: a rank that WRITEs GPU caches starts where UCX takes cuda_ipc for it (the H200
    of FACTS section 9 did), limited to peers on its node; one that only serves its peer's operation starts too. A
    READ emulated over tcp is refused as the doctor's data-path check says (``check_ucx_path``, above)."""
    from glm_pd_common.tools.flat import flat_span
    from glm_pd_common.transport.base import TransportConfig, rdma_devices
    from glm_pd_common.transport.datapath import judge_without_rdma
    from glm_pd_common.transport.factory import create_transport

    if rdma_devices():
        pytest.skip("this machine has RDMA devices: nothing is limited to its node")
    selections, err = observe("cuda")
    write = between_peers(selections, "WRITE", "cuda")
    assert write is not None and write.path == "cuda_ipc", err or write.describe()
    assert judge_without_rdma("no RDMA devices", {"VRAM"}, "WRITE", write).intra_node
    cache = torch.ones(1 << 20, dtype=torch.uint8, device="cuda:0")
    for name, posts in (("gpu-writer", "WRITE"), ("gpu-server", None)):
        transport = create_transport(name, TransportConfig(posts=posts))
        try:
            transport.register([flat_span(cache.data_ptr(), cache.numel(), "VRAM", 0)])
            info = transport.info()
        finally:
            transport.close()
        print(name, info.data_path)
        assert transport.node_only and "peers on this node only" in info.data_path and not info.rdma
        assert info.path == ("cuda_ipc" if posts else "unknown"), info

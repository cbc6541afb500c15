"""The data path read from UCX's own protocol tables (recorded ones: this machine's, and GPU tables from public
reports), and the rule for GPU caches: cuda_ipc and RDMA pass, software emulation and tcp are refused unless the
operator allowed TCP, naming what UCX chose and the fix. Without RDMA, cuda_ipc is taken for peers on one node."""

from pathlib import Path

import pytest

from glm_pd_common.transport.base import TransportConfig, rdma_devices
from glm_pd_common.transport.datapath import PATHS, between_peers, judge_gpu_path, judge_without_rdma, parse
from glm_pd_common.transport.factory import create_transport

TABLES = Path(__file__).parent / "data" / "ucx_proto"


def chosen(name: str, operation: str, memory: str):
    selection = between_peers(parse((TABLES / name).read_text()), operation, memory)
    assert selection is not None, f"{name}: no {operation} on {memory} memory between peers"
    return selection


def test_this_machines_loopback_reads_host_memory_by_cma():
    read = chosen("host_cma.txt", "READ", "host")
    assert (read.protocol, read.transports, read.path) == ("zero-copy", ("cma/memory",), "shared memory")
    assert read.endpoint == "probe intra-node cfg#1"  # not the agent's endpoint to itself (self cfg#0)


def test_tcp_only_reads_are_emulated_and_writes_go_over_tcp():
    read, write = chosen("host_tcp.txt", "READ", "host"), chosen("host_tcp.txt", "WRITE", "host")
    assert (read.protocol, read.transports, read.path) == ("software emulation", ("tcp/lo",), "emulation")
    assert (write.protocol, write.transports, write.path) == ("zero-copy", ("tcp/lo", "tcp/eth0"), "tcp")


def test_the_bulk_row_decides_not_the_small_messages():
    read = chosen("cuda_get_rc_mlx5.txt", "READ", "cuda")  # 1..64 bytes are emulated there
    assert (read.protocol, read.path) == ("zero-copy", "rdma")
    assert judge_gpu_path(read, allow_tcp=False).accepted


@pytest.mark.parametrize(
    ("table", "operation", "path"),
    [("cuda_get_cuda_ipc.txt", "READ", "cuda_ipc"), ("cuda_put_rc_mlx5.txt", "WRITE", "rdma")],
)
def test_cuda_ipc_and_rdma_carry_gpu_caches_without_allow_tcp(table, operation, path):
    selection = chosen(table, operation, "cuda")
    assert selection.path == path
    verdict = judge_gpu_path(selection, allow_tcp=False)
    assert verdict.accepted and selection.transports[0] in verdict.detail


@pytest.mark.parametrize(("table", "transport"), [("cuda_get_tcp.txt", "tcp/lo"), ("cuda_get_sysv.txt", "sysv")])
def test_an_emulated_gpu_read_is_refused_naming_what_ucx_chose_and_the_fix(table, transport):
    read = chosen(table, "READ", "cuda")
    refused = judge_gpu_path(read, allow_tcp=False)
    assert not refused.accepted
    assert "software emulation" in refused.detail and transport in refused.detail
    assert "UCX_RMA_PPLN_ENABLE=y" in refused.fix and "allow_tcp" in refused.fix
    allowed = judge_gpu_path(read, allow_tcp=True)
    assert allowed.accepted and "allow_tcp" in allowed.detail


def test_a_gpu_write_over_tcp_is_refused_with_the_nic_fix():
    write = chosen("host_tcp.txt", "WRITE", "host")
    on_gpu = type(write)(write.endpoint, "WRITE", "cuda", "cuda", write.protocol, write.transports)
    refused = judge_gpu_path(on_gpu, allow_tcp=False)
    assert not refused.accepted and "tcp/lo" in refused.detail and "UCX_NET_DEVICES" in refused.fix


def test_no_table_for_the_memory_asked_is_none():
    assert between_peers(parse((TABLES / "host_cma.txt").read_text()), "READ", "cuda") is None


def test_the_transports_path_in_one_word_is_what_metrics_label_loads_with():
    """Host caches on a box without RDMA: NIXL says tcp (its refusal's word for the fallback), one of the labels."""
    if rdma_devices():
        pytest.skip("this machine has RDMA devices")
    transport = create_transport("path-word", TransportConfig(allow_tcp=True))
    try:
        info = transport.info()
        assert info.path == "tcp" and info.path in PATHS and not info.rdma, info
    finally:
        transport.close()


NO_NIC = "no RDMA devices under /sys/class/infiniband"


def test_without_rdma_host_caches_are_refused_as_tcp_naming_why_and_the_fix():
    refused = judge_without_rdma(NO_NIC, {"DRAM"}, "READ", chosen("host_cma.txt", "READ", "host"))
    assert not refused.accepted and not refused.intra_node
    assert "would move KV over TCP" in refused.detail and NO_NIC in refused.detail
    assert "rdma-core" in refused.fix and "--allow-tcp" in refused.fix and "allow_tcp" in refused.fix


@pytest.mark.parametrize("kinds", [{"VRAM"}, {"VRAM", "DRAM"}])  # SGLang registers host metadata buffers beside
def test_without_rdma_a_gpu_path_by_cuda_ipc_is_accepted_for_this_node_only(kinds):
    verdict = judge_without_rdma(NO_NIC, kinds, "READ", chosen("cuda_get_cuda_ipc.txt", "READ", "cuda"))
    assert verdict.accepted and verdict.intra_node
    assert NO_NIC in verdict.detail and "cuda_ipc/cuda" in verdict.detail and "this node only" in verdict.detail


@pytest.mark.parametrize(("table", "transport"), [("cuda_get_tcp.txt", "tcp/lo"), ("cuda_get_sysv.txt", "sysv")])
def test_without_rdma_an_emulated_gpu_path_is_refused_naming_what_ucx_chose(table, transport):
    refused = judge_without_rdma(NO_NIC, {"VRAM"}, "READ", chosen(table, "READ", "cuda"))
    assert not refused.accepted and not refused.intra_node
    assert "software emulation" in refused.detail and transport in refused.detail and NO_NIC in refused.detail
    assert "UCX_RMA_PPLN_ENABLE=y" in refused.fix and "allow_tcp" in refused.fix
    assert refused.message() == f"{refused.detail}. Fix: {refused.fix}"


def test_without_rdma_a_gpu_path_that_was_not_observed_is_refused_naming_the_probes_error():
    """No silent TCP: a probe that saw no table (no driver, a crash) refuses, naming what it said."""
    refused = judge_without_rdma(NO_NIC, {"VRAM"}, "WRITE", None, "no CUDA driver (libcuda) on this machine")
    assert not refused.accepted and "WRITE" in refused.detail and "no CUDA driver (libcuda)" in refused.detail
    assert "glm-pd doctor" in refused.fix and "allow_tcp" in refused.fix
    assert "UCX printed no table" in judge_without_rdma(NO_NIC, {"VRAM"}, "WRITE", None).detail


def test_without_rdma_a_rank_that_only_serves_gpu_memory_is_accepted_for_this_node_only():
    """vLLM prefill, SGLang decode: the peer posts, on this node (``add_peer`` sees to it), and observes its path."""
    verdict = judge_without_rdma(NO_NIC, {"VRAM"}, None, None)
    assert verdict.accepted and verdict.intra_node and "this node only" in verdict.detail

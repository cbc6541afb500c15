"""A NIXL rank without RDMA and without allow_tcp: refused for host caches when they are registered, and limited to
peers on its own node (cuda_ipc reaches no further; between nodes UCX would take tcp). A peer's node is what its
framed metadata says, covered by the frame's digest. This machine has no RDMA NIC and no GPU: the GPU side of the
rule is tests/gpu/test_datapath.py's."""

import ctypes.util
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from glm_pd_common.errors import ConfigError, ProtocolError
from glm_pd_common.tools.flat import flat_region, flat_span
from glm_pd_common.transport.base import Span, TransportConfig, _Blob, _digest, rdma_devices
from glm_pd_common.transport.factory import create_transport
from glm_pd_common.transport.node import node_id

pytestmark = pytest.mark.skipif(bool(rdma_devices()), reason="this host has RDMA devices: nothing is limited to it")

SPANS = [Span("x", 1 << 20, 4096)]
OTHER_NODE = "0123456789abcdef"


@pytest.fixture
def transports():
    made = []

    def make(name, **config):
        made.append(create_transport(name, TransportConfig(timeout_s=5, **config)))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


def moved(metadata: bytes, node: str, *, digest: bool = True) -> bytes:
    """``metadata`` as an agent on ``node`` would frame it (its digest recomputed unless ``digest`` is False)."""
    blob = msgspec.msgpack.decode(metadata, type=_Blob)
    new = _digest(node, blob.payload) if digest else blob.digest
    return msgspec.msgpack.encode(msgspec.structs.replace(blob, node=node, digest=new))


def test_the_node_id_is_the_hosts_not_the_processes():
    child = subprocess.run(
        [sys.executable, "-c", "from glm_pd_common.transport.node import node_id; print(node_id())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == node_id() and len(node_id()) == 16


def test_without_rdma_a_nixl_rank_starts_and_refuses_host_caches_when_they_are_registered(transports):
    local = transports("host-caches", posts="READ")
    host = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ConfigError, match=r"would move KV over TCP \(no RDMA devices.*host memory.*--allow-tcp"):
        local.register([flat_region(host)])
    assert local.info().rdma is False


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed here")
def test_without_rdma_gpu_caches_whose_path_cannot_be_observed_are_refused_naming_the_probe(transports):
    """No silent TCP: no GPU buffer can be made here, so the probe sees no table and says why. Refused before NIXL
    registers anything (the address is not a real GPU buffer)."""
    local = transports("gpu-caches", posts="READ")
    with pytest.raises(ConfigError, match=r"(?s)READ between GPU buffers could not be observed.*no CUDA driver"):
        local.register([flat_span(1 << 30, 4096, "VRAM", 0)])


def test_without_rdma_peers_from_another_node_are_refused_naming_both_nodes(transports):
    local, peer = transports("local"), transports("peer", allow_tcp=True)
    with pytest.raises(ProtocolError) as refused:
        local.add_peer(moved(peer.metadata(), OTHER_NODE), SPANS)
    message = str(refused.value)
    assert f"node {OTHER_NODE}" in message and f"node {node_id()}" in message and "no RDMA devices" in message
    assert "pair engines on one node" in message and "allow_tcp" in message
    assert local.remote_peers() == []
    assert local.add_peer(peer.metadata(), SPANS) == "peer"  # the same node: accepted


def test_with_allow_tcp_peers_from_any_node_are_loaded(transports):
    local, peer = transports("local", allow_tcp=True), transports("peer", allow_tcp=True)
    assert local.add_peer(moved(peer.metadata(), OTHER_NODE), SPANS) == "peer"


def test_a_node_id_changed_in_transit_fails_the_frames_digest(transports):
    local, peer = transports("local", allow_tcp=True), transports("peer", allow_tcp=True)
    with pytest.raises(ProtocolError, match="fails its digest"):
        local.add_peer(moved(peer.metadata(), OTHER_NODE, digest=False), SPANS)

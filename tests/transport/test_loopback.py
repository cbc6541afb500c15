"""Two-process loopback tests of each real transport (NIXL over UCX, Mooncake over TCP here).

The peer is a separate process (``_peer.py``) with its own agent and caches; this process is the other
side. Byte layouts are GLM-5.3's; runs come from real plans. TCP/shared memory is allowed explicitly:
this machine has no RDMA NIC.
"""

import base64
import os
import signal
import time

import msgspec
import numpy as np
import pytest

from glm_pd_common.errors import ConfigError, ProtocolError, TransferFailed
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import num_pages_for, suffix_pages
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.flat import flat_region
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.base import TransportConfig, rdma_devices
from glm_pd_common.transport.factory import create_transport
from tests.support.peerproc import PeerProcess

SPEC = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
SEED = 11


class Peer(PeerProcess):
    def __init__(self, backend, page_tokens, num_pages, table, tokens, fill):
        super().__init__(
            {
                "backend": backend,
                "page_tokens": page_tokens,
                "num_pages": num_pages,
                "table": list(map(int, table)),
                "tokens": tokens,
                "fill": fill,
                "seed": SEED,
            }
        )
        self.regions = self.cache_regions()

    def close(self):
        assert super().close() == 0  # a clean release: the peer closed its transport and exited 0


def local_transport(backend, caches, peer, name="local"):
    t = create_transport(name, TransportConfig(backend=backend, allow_tcp=True, timeout_s=30))
    t.register(caches.regions)
    agent = t.add_peer(peer.metadata, peer.spans)
    assert peer.introduce(t.metadata(), caches.regions) == {"added": name}
    return t, agent


def tables(num_tokens, p, d, allocator, rng):
    pp, dp = num_pages_for(num_tokens, p), num_pages_for(num_tokens, d)
    if allocator == "contiguous":
        return np.arange(pp), pp, np.arange(dp), dp
    return rng.permutation(pp + 7)[:pp], pp + 7, rng.permutation(dp + 5)[:dp], dp + 5


BACKENDS = ["nixl", "mooncake"]
CASES = [
    ("nixl", 64, 64, "contiguous"),
    ("nixl", 64, 64, "shuffled"),
    ("nixl", 64, 32, "shuffled"),
    ("nixl", 16, 128, "contiguous"),
    ("mooncake", 64, 64, "shuffled"),
    ("mooncake", 32, 64, "contiguous"),
]


@pytest.mark.parametrize(("backend", "p", "d", "allocator"), CASES)
def test_pull_is_byte_exact_and_notifies(backend, p, d, allocator):
    rng = np.random.default_rng(3)
    num_tokens, prefix = 1000, 2 * d
    p_table, p_pool, d_table, d_pool = tables(num_tokens, p, d, allocator, rng)
    peer = Peer(backend, p, p_pool, p_table, num_tokens, fill=True)
    local = HostCaches(SPEC, page_tokens=d, num_pages=d_pool)
    local.write_tokens(d_table, 0, prefix, seed=SEED)
    transport, agent = local_transport(backend, local, peer)
    try:
        plan = build_plan(
            peer.regions,
            local.regions,
            suffix_pages(p_table, num_tokens, prefix, p, align_tokens=d),
            suffix_pages(d_table, num_tokens, prefix, d, align_tokens=d),
            num_tokens=num_tokens,
            prefix_tokens=prefix,
        )
        batches = [transport.post_plan(agent, plan, "READ", entries=e) for _, e in plan.layers()]
        for xfer in batches:
            transport.wait(xfer)
            transport.release(xfer)
        assert local.mismatched_tokens(d_table, 0, num_tokens, seed=SEED) == []
        transport.send_notif(agent, b"done:r1")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            notifs = peer.ask({"notifs": True})["notifs"]
            if notifs:
                break
        assert [base64.b64decode(m) for _, m in notifs] == [b"done:r1"]
    finally:
        peer.close()
        transport.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_push_write_lands_byte_exact(backend):
    num_tokens, p, d = 700, 64, 16
    rng = np.random.default_rng(5)
    p_table, p_pool, d_table, d_pool = tables(num_tokens, p, d, "shuffled", rng)
    peer = Peer(backend, d, d_pool, d_table, num_tokens, fill=False)
    local = HostCaches(SPEC, page_tokens=p, num_pages=p_pool)
    local.write_tokens(p_table, 0, num_tokens, seed=SEED)
    transport, agent = local_transport(backend, local, peer)
    try:
        plan = build_plan(local.regions, peer.regions, p_table, d_table, num_tokens=num_tokens, prefix_tokens=0)
        xfer = transport.post_plan(agent, plan, "WRITE")
        transport.wait(xfer)
        transport.release(xfer)
        assert peer.ask({"check": True, "start": 0, "end": num_tokens}) == {"mismatched": []}
    finally:
        peer.close()
        transport.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_outside_registered_regions_are_refused_before_posting(backend):
    peer = Peer(backend, 64, 4, [0, 1], 128, fill=True)
    local = HostCaches(SPEC, page_tokens=64, num_pages=4)
    transport, agent = local_transport(backend, local, peer)
    try:
        top = max(s.base_addr + s.size_bytes for s in peer.spans)
        ok_local = np.array([local.regions[0].base_addr])
        with pytest.raises(TransferFailed, match=r"outside every registered region.*refused before posting"):
            transport.post(agent, "READ", ok_local, np.array([top + 4096]), np.array([64]))
        with pytest.raises(TransferFailed, match="local side"):
            transport.post(agent, "READ", np.array([8]), np.array([peer.spans[0].base_addr]), np.array([64]))
        straddle = peer.spans[0].base_addr + peer.spans[0].size_bytes - 10
        with pytest.raises(TransferFailed, match="outside"):
            transport.post(agent, "READ", ok_local, np.array([straddle]), np.array([64]))
        # the peer is unharmed: a good transfer still goes through
        xfer = transport.post(agent, "READ", ok_local, np.array([peer.spans[0].base_addr]), np.array([4096]))
        transport.wait(xfer)
        transport.release(xfer)
    finally:
        peer.close()
        transport.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_truncated_or_foreign_metadata_is_refused(backend):
    peer = Peer(backend, 64, 2, [0], 64, fill=False)
    transport = create_transport("local", TransportConfig(backend=backend, allow_tcp=True))
    try:
        blob = msgspec.msgpack.decode(peer.metadata)
        flipped = dict(blob, payload=bytes([blob["payload"][0] ^ 0xFF]) + blob["payload"][1:])
        with pytest.raises(ProtocolError, match="fails its digest"):
            transport.add_peer(msgspec.msgpack.encode(flipped), peer.spans)
        with pytest.raises(ProtocolError, match="corrupted or truncated"):
            transport.add_peer(peer.metadata[: len(peer.metadata) // 2], peer.spans)
        other = "mooncake" if backend == "nixl" else "nixl"
        with pytest.raises(ProtocolError, match=f"speaks transport '{other}'"):
            transport.add_peer(msgspec.msgpack.encode(dict(blob, backend=other)), peer.spans)
        assert transport.add_peer(peer.metadata, peer.spans) == "peer"
    finally:
        peer.close()
        transport.close()


@pytest.mark.skipif(bool(rdma_devices()), reason="this host has RDMA devices, so nothing would fall back to TCP")
@pytest.mark.parametrize("backend", BACKENDS)
def test_tcp_is_refused_unless_allowed(backend):
    """Mooncake refuses to start; NIXL once host caches are registered (GPU caches may still move by cuda_ipc within
    one node: test_intra_node.py)."""
    host = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ConfigError, match=r"would move KV over TCP.*--allow-tcp"):
        transport = create_transport("x", TransportConfig(backend=backend))
        try:
            transport.register([flat_region(host)])
        finally:
            transport.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_killed_mid_transfer_fails_bounded(backend):
    num_tokens = 4096
    table = np.arange(num_pages_for(num_tokens, 64))
    peer = Peer(backend, 64, table.size, table, num_tokens, fill=False)
    local = HostCaches(SPEC, page_tokens=64, num_pages=table.size)
    transport, agent = local_transport(backend, local, peer)
    try:
        plan = build_plan(peer.regions, local.regions, table, table, num_tokens=num_tokens, prefix_tokens=0)
        first = transport.post_plan(agent, plan, "READ")
        os.kill(peer.proc.pid, signal.SIGKILL)
        peer.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(TransferFailed):
            transport.wait(first, timeout_s=20)  # may have finished before the kill
            transport.release(first)
            for _ in range(3):
                xfer = transport.post_plan(agent, plan, "READ")
                transport.wait(xfer, timeout_s=20)
                transport.release(xfer)
        assert time.monotonic() - t0 < 45
    finally:
        transport.close()

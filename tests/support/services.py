"""A prefill service and decode services in one process, on real NIXL agents and real host caches.

What the service tests drive: grants, loads, restarts and hostile replies, with the leftovers of both
sides readable at any moment. TCP/shared memory is allowed: the test machines have no RDMA NIC.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from glm_pd_common.handoff.decode.service import DecodeService, LoadJob, LoadResult, RemotePrefill
from glm_pd_common.handoff.prefill.caps import DEFAULT_CAPS, PeerCaps
from glm_pd_common.handoff.prefill.lease import Finished
from glm_pd_common.handoff.prefill.service import PrefillService
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import Endpoint
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient
from glm_pd_common.handoff.wire.trust import OPEN, Trust
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.hostmem import HostCaches, host_staging
from glm_pd_common.transport.base import TransportConfig
from glm_pd_common.transport.devices import ThreadSetup, host_only
from glm_pd_common.transport.factory import create_transport
from glm_pd_common.transport.memory import HOST, MemoryReader
from tests.support.faults import FaultyTransport, Injector

PAGE_TOKENS, NUM_PAGES, SEED = 64, 16, 5
T = TypeVar("T")


def endpoint(
    spec: CacheSpec, name: str, timeout_s: float, *, slot_bytes: int = 0, pairs: int = 2
) -> tuple[HostCaches, Endpoint]:
    """A rank's host caches on a real NIXL agent; with ``slot_bytes``, a staging buffer of ``pairs`` slot pairs
    that every transfer goes through (mode ``always``: on DRAM ``auto`` would post directly)."""
    caches = HostCaches(spec, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES)
    transport = create_transport(name, TransportConfig(allow_tcp=True, timeout_s=timeout_s))
    transport.register(caches.regions)
    staging = None
    if slot_bytes:
        staging = host_staging(transport, caches.regions, slot_bytes=slot_bytes, pairs=pairs, mode="always")
    return caches, Endpoint(name, spec, caches.regions, transport, PeerShape(PAGE_TOKENS, 1, 0), staging=staging)


def wait_for(get: Callable[[], T], done: Callable[[T], bool], timeout_s: float) -> T:
    """Poll ``get`` until ``done`` holds or the bound passes; returns the last value either way."""
    deadline = time.monotonic() + timeout_s
    value = get()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.01)
        value = get()
    return value


class Prefill:
    """One prefill rank: its caches hold ``SEED`` content in every page; ``grant`` holds pages for decode."""

    def __init__(
        self,
        spec: CacheSpec,
        *,
        lease_s: float = 60.0,
        timeout_s: float = 10.0,
        idle_s: float = 1.0,
        streamed: bool = False,
        on_thread: ThreadSetup = host_only,
        caps: PeerCaps = DEFAULT_CAPS,
        trust: Trust = OPEN,
        memory: MemoryReader = HOST,
        slot_bytes: int = 0,
        pairs: int = 2,
    ) -> None:
        self.caches, local = endpoint(spec, "prefill-0", timeout_s, slot_bytes=slot_bytes, pairs=pairs)
        self.local = replace(local, on_thread=on_thread, trust=trust, memory=memory)
        self.table = np.arange(NUM_PAGES, dtype=np.int64)[::-1].copy()
        self.caches.write_tokens(self.table, 0, NUM_PAGES * PAGE_TOKENS, seed=SEED)
        self.service = PrefillService(
            self.local,
            host="127.0.0.1",
            port=0,
            lease_s=lease_s,
            timeout_s=timeout_s,
            peer_idle_s=idle_s,
            streamed=streamed,
            caps=caps,
        )
        self.remote = RemotePrefill("prefill-0", "127.0.0.1", self.service.port, 1)
        self.ended: list[Finished] = []

    def finished(self, request_id: str, timeout_s: float) -> Finished | None:
        """How ``request_id``'s lease ended, waiting at most ``timeout_s``."""

        def get() -> Finished | None:
            self.ended += self.service.finished()
            return next((f for f in self.ended if f.request_id == request_id), None)

        return wait_for(get, lambda f: f is not None, timeout_s)

    def close(self) -> None:
        self.service.close()
        self.local.transport.close()


class Decode:
    """One decode rank (a process's worth: its own agent and caches); ``load`` pulls one request."""

    def __init__(
        self,
        spec: CacheSpec,
        name: str = "decode-0",
        *,
        timeout_s: float = 10.0,
        beat_s: float = 0.2,
        on_thread: ThreadSetup = host_only,
        memory: MemoryReader = HOST,
        trust: Trust = OPEN,
        verify: bool = True,
        slot_bytes: int = 0,
    ) -> None:
        self.caches, local = endpoint(spec, name, timeout_s, slot_bytes=slot_bytes)
        self.faults = Injector()
        transport = FaultyTransport(local.transport, self.faults)
        self.local = replace(local, transport=transport, on_thread=on_thread, memory=memory, trust=trust)
        self.service = DecodeService(
            self.local, timeout_s=timeout_s, verify_digests=verify, heartbeat_s=beat_s, faults=self.faults
        )

    def load(self, prefill: Prefill, request_id: str, num_tokens: int, fault: str = "") -> LoadResult:
        pages = np.arange(NUM_PAGES, dtype=np.int64)
        n_src = -(-num_tokens // PAGE_TOKENS)
        prefill.service.grant(request_id, prefill.table[:n_src])
        if fault:
            self.faults.kinds[request_id] = fault
        job = LoadJob(request_id, prefill.remote, prefill.table[:n_src], pages[:n_src], num_tokens, 0)
        self.service.submit(job)
        results = wait_for(self.service.results, bool, 30.0)
        assert results, f"no result for {request_id} within 30 s"
        return results[0]

    def close(self) -> None:
        self.service.close()
        self.local.transport.close()


def handshaken(spec: CacheSpec, port: int, engine: str, proof: bytes = b"") -> SideChannelClient:
    """A decode engine ``engine`` (its own agent, named ``engine``) that passed prefill's handshake, driven by
    hand."""
    _, local = endpoint(spec, engine, 10.0)
    client = SideChannelClient("127.0.0.1", port)
    client.send(local.hello(local.transport.metadata(), proof))
    assert isinstance(client.recv(10.0), protocol.Hello)
    return client


def claim(client: SideChannelClient, request_id: str, pages: np.ndarray, slot_bytes: int = 0) -> protocol.Message:
    """Claim whole ``pages`` of prefill's (into decode pages 0, 1, ...); prefill's answer."""
    src = [int(p) for p in pages]
    client.send(protocol.TransferRequest(v=PROTOCOL_VERSION, request_id=request_id, num_tokens=len(src) * PAGE_TOKENS,
                                         prefix_tokens=0, src_pages=src, dst_pages=list(range(len(src))),
                                         slot_bytes=slot_bytes))  # fmt: skip
    return client.recv(10.0)


@contextmanager
def rivals(spec: CacheSpec, **prefill_args: Any) -> Iterator[tuple[Prefill, SideChannelClient, SideChannelClient]]:
    """A prefill rank and two decode engines handshaken with it: the one that acts first, and another."""
    prefill = Prefill(spec, **prefill_args)
    owner = handshaken(spec, prefill.service.port, "owner")
    other = handshaken(spec, prefill.service.port, "other")
    try:
        yield prefill, owner, other
    finally:
        owner.close()
        other.close()
        prefill.close()

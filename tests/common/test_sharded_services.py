"""The services with context-parallel caches, in one process on real NIXL agents and host caches: each decode
rank claims from every prefill rank it reads (several per request under sharding), pulls exactly its share,
verifies digests, and every prefill rank's lease ends released. Streamed, every prefill rank announces the
request in steps, each step's tokens written (over stale content) just before they are announced, and decode
reads each rank's share as it comes."""

from __future__ import annotations

import numpy as np
import pytest

from glm_pd_common.handoff.decode.service import DecodeService, LoadJob, LoadResult, RemotePrefill
from glm_pd_common.handoff.prefill.lease import Finished
from glm_pd_common.handoff.prefill.service import PrefillService
from glm_pd_common.handoff.wire.handshake import Endpoint
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.shards import Sharding, token_shard
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.layout.tp import SideLayout
from glm_pd_common.tools.hostmem import HostCaches, host_staging
from glm_pd_common.transport.base import TransportConfig
from glm_pd_common.transport.factory import create_transport
from tests.support.ports import free_port_range
from tests.support.services import wait_for

SEED, TIMEOUT_S = 9, 10.0


class Rank:
    """One rank of a side: its caches hold its shard (tokens and layers) of the request at its local slots."""

    def __init__(self, spec: CacheSpec, engine: str, shape: PeerShape, num_pages: int, slot_bytes: int = 0) -> None:
        layout = SideLayout.of(shape.tp_size, shape.sharding, spec.geometry)
        self.caches = HostCaches(
            spec,
            page_tokens=shape.page_tokens,
            num_pages=num_pages,
            shard=token_shard(shape.tp_rank, shape.sharding),
            held=layout.layers(shape.tp_rank),
        )
        agent = f"{engine}-{shape.tp_rank}"
        transport = create_transport(agent, TransportConfig(allow_tcp=True, timeout_s=TIMEOUT_S))
        transport.register(self.caches.regions)
        staging = None
        if slot_bytes:  # staged where both ranks stage: always, on DRAM
            staging = host_staging(transport, self.caches.regions, slot_bytes=slot_bytes, pairs=2, mode="always")
        self.local = Endpoint(engine, spec, self.caches.regions, transport, shape, staging=staging)


def run_request(
    spec: CacheSpec,
    prefill: tuple[int, int, Sharding],
    decode: tuple[int, int, Sharding],
    num_tokens: int,
    prefix_tokens: int,
    slot_bytes: int = 0,
    streamed: bool = False,
) -> tuple[list[LoadResult], list[Finished], list[HostCaches], np.ndarray]:
    """Prefill ranks hold the request in shared page tables; every decode rank loads it (``streamed``: while
    prefill announces it in steps). Returns decode's results, every prefill rank's lease outcome, decode's caches
    and decode's page table."""
    (p_tp, p_pt, p_sh), (d_tp, d_pt, d_sh) = prefill, decode
    p_span, d_span = p_pt * p_sh.token_shards, d_pt * d_sh.token_shards
    p_pages, d_pages = -(-num_tokens // p_span), -(-num_tokens // d_span)
    p_table = np.arange(p_pages, dtype=np.int64)[::-1] + 2  # not the identity: pages are named, not implied
    d_table = (np.arange(d_pages, dtype=np.int64) * 3) % (d_pages + 5)
    base = free_port_range(p_tp)
    prefills, services = [], []
    decodes: list[Rank] = []
    loaders: list[DecodeService] = []
    try:
        for r in range(p_tp):
            rank = Rank(spec, "prefill", PeerShape(p_pt, p_tp, r, sharding=p_sh), p_pages + 2, slot_bytes)
            rank.caches.write_tokens(p_table, 0, num_tokens, seed=SEED + 1 if streamed else SEED)
            prefills.append(rank)
            service = PrefillService(
                rank.local, host="127.0.0.1", port=base + r, lease_s=30.0, timeout_s=TIMEOUT_S, streamed=streamed
            )
            services.append(service)
            if streamed:
                service.open_stream("req", num_tokens)
            else:
                service.grant("req", p_table)
        # streamed params name prefill's address only: rank 0's hello says the rest
        remote = RemotePrefill("prefill", "127.0.0.1", base, 0 if streamed else p_tp, p_sh)
        for r in range(d_tp):
            rank = Rank(spec, "decode", PeerShape(d_pt, d_tp, r, sharding=d_sh), d_pages + 5, slot_bytes)
            rank.caches.write_tokens(d_table, 0, prefix_tokens, seed=SEED)  # its prefix hit
            decodes.append(rank)
            loader = DecodeService(rank.local, timeout_s=TIMEOUT_S, verify_digests=True)
            loaders.append(loader)
            stream_id = "req" if streamed else ""
            loader.submit(LoadJob("req", remote, p_table, d_table, num_tokens, prefix_tokens, stream_id=stream_id))
        if streamed:
            announce(prefills, services, p_table, p_span, num_tokens)
        results = [wait_for(loader.results, bool, 60.0)[0] for loader in loaders]
        ended: list[Finished] = []
        for service in services:
            ended += wait_for(service.finished, bool, 10.0)
        return results, ended, [rank.caches for rank in decodes], d_table
    finally:
        for loader in loaders:
            loader.close()
        for service in services:
            service.close()
        for rank in prefills + decodes:
            rank.local.transport.close()


def announce(
    prefills: list[Rank], services: list[PrefillService], table: np.ndarray, span: int, num_tokens: int
) -> None:
    """Prefill's steps: each writes its tokens on every rank, then announces them with the pages they are in (as
    the engine does once the step's event completed); the last one grants the lease."""
    done = 0
    for upto in (num_tokens // 5, num_tokens // 2 + 7, num_tokens - 30, num_tokens):
        for rank in prefills:
            rank.caches.write_tokens(table, done, upto, seed=SEED)
        for service in services:
            service.advance_stream("req", table[-(-done // span) : -(-upto // span)], upto)
        done = upto
    for service in services:
        service.grant_stream("req#0", "req", table, num_tokens)


@pytest.mark.parametrize(
    ("prefill", "decode", "prefix"),
    [
        ((2, 64, Sharding(2, 16)), (2, 32, Sharding(2, 1)), 128),  # DCP to DCP, different pages and turns
        ((2, 64, Sharding(2, 1)), (1, 64, Sharding()), 64),  # one replicated decode rank reads both shards
        ((4, 64, Sharding(layer_shards=2)), (2, 64, Sharding(2, 32)), 0),  # layer split to DCP
        ((2, 32, Sharding()), (4, 64, Sharding(4, 64)), 256),  # replicated prefill to DCP 4
    ],
    ids=["dcp2-to-dcp2", "dcp2-to-replicated", "layer-split-to-dcp2", "replicated-to-dcp4"],
)
@pytest.mark.parametrize("slot_bytes", [0, 16384], ids=["direct", "staged"])
@pytest.mark.parametrize("streamed", [False, True], ids=["pull", "streamed"])
def test_every_decode_rank_loads_its_share_and_every_prefill_lease_is_released(
    small_spec, prefill, decode, prefix, slot_bytes, streamed
):
    """Staged (16 KiB slots, many per request, cutting runs mid-page), every byte lands as posted directly."""
    num_tokens = 700
    results, ended, caches, d_table = run_request(small_spec, prefill, decode, num_tokens, prefix, slot_bytes, streamed)
    for rank, (result, held) in enumerate(zip(results, caches, strict=True)):
        assert result.ok, f"decode rank {rank}: {result.reason}"
        assert held.mismatched_tokens(d_table, 0, num_tokens, seed=SEED) == [], f"decode rank {rank}"
        assert result.staged_bytes == (sum(result.bytes_by_kind.values()) if slot_bytes else 0)
    assert sorted(f.outcome for f in ended) == ["released"] * prefill[0]
    g = small_spec.geometry
    per_token = len(g.all_layers) * small_spec.row.row_bytes + len(g.indexer_layers) * small_spec.indexer.row_bytes
    copies = decode[0] // decode[2].token_shards  # decode ranks holding the same tokens each read them
    moved = sum(sum(r.bytes_by_kind.values()) for r in results)
    # pages are copied in chunks, so a shard's last page may carry a few tokens past the end
    assert copies * per_token * (num_tokens - prefix) <= moved <= copies * per_token * (num_tokens - prefix + 64 * 4)

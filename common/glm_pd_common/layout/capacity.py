"""The capacity account of one request: bytes, pages, regions, runs, link time and how much of it is exposed,
pulled after prefill or streamed chunk by chunk during it (``exposure``).

Run counts come from real plans over synthetic address spaces (a contiguous allocator and one where no
two pages are adjacent on both sides), so the account and the transfer path share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from glm_pd_common.layout.exposure import DEFAULT_CHUNK_TOKENS, exposure
from glm_pd_common.layout.formats import IndexerFormat, MainRowFormat
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import num_pages_for, suffix_page_span
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.layout.regions import Region, build_regions
from glm_pd_common.layout.shards import REPLICATED, Sharding, token_shard
from glm_pd_common.layout.tp import SideLayout, Source, release_set, sources


@dataclass(frozen=True)
class AccountInputs:
    geometry: ModelGeometry
    row: MainRowFormat
    indexer: IndexerFormat
    num_tokens: int
    prefill_page_tokens: int = 64
    decode_page_tokens: int = 64
    prefix_tokens: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1
    link_gbps: float = 400.0
    nics_per_rank: int = 1
    prefill_sharding: Sharding = REPLICATED
    decode_sharding: Sharding = REPLICATED
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS["h200"]
    prefill_tokens_per_s: float | None = None  # unknown: no streamed figure, only its floor
    rtt_s: float | None = None  # one side-channel round trip; unknown: counted, not timed

    def layouts(self) -> tuple[SideLayout, SideLayout]:
        return (
            SideLayout.of(self.prefill_tp, self.prefill_sharding, self.geometry),
            SideLayout.of(self.decode_tp, self.decode_sharding, self.geometry),
        )


def synthetic_regions(
    geometry: ModelGeometry, row: MainRowFormat, indexer: IndexerFormat, *, page_tokens: int, num_pages: int
) -> list[Region]:
    """Regions laid out one after another in a fake address space (plans never touch the memory)."""
    main_page = row.row_bytes * page_tokens
    index_page = indexer.row_bytes * page_tokens
    addr, main_addrs, index_addrs = 1 << 40, {}, {}
    for layer in geometry.all_layers:
        main_addrs[layer] = addr
        addr += main_page * num_pages + (1 << 20)
        if geometry.is_full(layer):
            index_addrs[layer] = addr
            addr += index_page * num_pages + (1 << 20)
    return build_regions(
        geometry,
        row,
        indexer,
        page_tokens=page_tokens,
        num_pages=num_pages,
        main_addrs=main_addrs,
        indexer_addrs=index_addrs,
    )


def allocator_pages(num_pages: int, allocator: str, *, seed: int = 0) -> np.ndarray:
    """Page tables of the two allocators the account and benchmark use."""
    if allocator == "contiguous":
        return np.arange(num_pages, dtype=np.int64)
    if allocator == "shuffled":
        return np.random.default_rng(seed).permutation(num_pages).astype(np.int64)
    if allocator == "worst_case":
        # Every other page: never adjacent, so no two pages ever merge on that side.
        return np.arange(num_pages, dtype=np.int64) * 2
    raise ValueError(f"unknown allocator {allocator!r}")


def plan_for(inputs: AccountInputs, allocator: str, decode_rank: int = 0, source: Source | None = None) -> TransferPlan:
    """The plan of what ``decode_rank`` reads from ``source`` (default: its first source)."""
    g = inputs.geometry
    p_pt, d_pt = inputs.prefill_page_tokens, inputs.decode_page_tokens
    prefill, decode = inputs.layouts()
    source = source or sources(decode_rank, prefill, decode)[0]
    mine = token_shard(decode_rank, inputs.decode_sharding)
    p_span, d_span = source.shard.table_tokens(p_pt), mine.table_tokens(d_pt)
    p_first, p_end = suffix_page_span(inputs.num_tokens, inputs.prefix_tokens, p_span, align_tokens=d_span)
    d_first, d_end = suffix_page_span(inputs.num_tokens, inputs.prefix_tokens, d_span, align_tokens=d_span)
    p_pages = p_end - p_first
    d_pages = d_end - d_first
    src_regions = synthetic_regions(g, inputs.row, inputs.indexer, page_tokens=p_pt, num_pages=2 * p_pages + 1)
    dst_regions = synthetic_regions(g, inputs.row, inputs.indexer, page_tokens=d_pt, num_pages=2 * d_pages + 1)
    dst_kind = "contiguous" if allocator == "contiguous" else "worst_case"
    return build_plan(
        src_regions,
        dst_regions,
        allocator_pages(p_pages, allocator),
        allocator_pages(d_pages, dst_kind),
        num_tokens=inputs.num_tokens,
        prefix_tokens=inputs.prefix_tokens,
        src_shard=source.shard,
        dst_shard=mine,
        layers=source.layers,
    )


@dataclass(frozen=True)
class Traffic:
    """What every rank moves for one request: bytes each decode rank reads and each prefill rank sends."""

    received: dict[int, dict[str, int]]  # decode rank -> bytes by kind
    sent: dict[int, int]  # prefill rank -> bytes
    runs: dict[str, int]  # the busiest decode rank's runs, per allocator
    sources: dict[int, list[int]]  # decode rank -> the prefill ranks it reads
    first_rank: list[TransferPlan]  # decode rank 0's pieces, one per source (contiguous allocator)
    round_trips: int  # the busiest decode rank's, after prefill answers: a claim per source, a release per holder


def traffic(inputs: AccountInputs) -> Traffic:
    """Plan every (decode rank, source) pair. Decode ranks holding the same token shard read alike, so each
    distinct piece is planned once and counted for every rank that reads it."""
    prefill, decode = inputs.layouts()
    received: dict[int, dict[str, int]] = {}
    sent = dict.fromkeys(range(inputs.prefill_tp), 0)
    runs = {"contiguous": 0, "worst_case": 0}
    planned: dict[tuple[int, Source], tuple[dict[str, int], int, int]] = {}
    first_rank: list[TransferPlan] = []
    for d in range(inputs.decode_tp):
        shard = token_shard(d, inputs.decode_sharding).index
        got = {"main": 0, "indexer": 0}
        rank_runs = {"contiguous": 0, "worst_case": 0}
        for source in sources(d, prefill, decode):
            key = (shard, source)
            if key not in planned:
                contiguous = plan_for(inputs, "contiguous", d, source)
                worst = plan_for(inputs, "worst_case", d, source)
                planned[key] = (contiguous.bytes_by_kind(), contiguous.num_runs, worst.num_runs)
                if d == 0:
                    first_rank.append(contiguous)
            by_kind, n_contiguous, n_worst = planned[key]
            for kind, n in by_kind.items():
                got[kind] += n
            sent[source.rank] += sum(by_kind.values())
            rank_runs["contiguous"] += n_contiguous
            rank_runs["worst_case"] += n_worst
        received[d] = got
        runs = {k: max(runs[k], rank_runs[k]) for k in runs}
    reads = {d: [s.rank for s in sources(d, prefill, decode)] for d in range(inputs.decode_tp)}
    trips = max(len(reads[d]) + len(release_set(d, prefill, decode)) for d in range(inputs.decode_tp))
    return Traffic(received, sent, runs, reads, first_rank, trips)


def account(inputs: AccountInputs) -> dict[str, object]:
    """The whole account as plain values (the ``glm-pd plan --json`` object)."""
    g, row, idx = inputs.geometry, inputs.row, inputs.indexer
    per_token_main = g.num_layers * row.row_bytes
    per_token_index = len(g.full_indexer_layers) * idx.row_bytes
    per_token_mtp = g.num_mtp_layers * (row.row_bytes + idx.row_bytes)
    n = inputs.num_tokens
    moves = traffic(inputs)
    entries = [e for plan in moves.first_rank for e in plan.entries]  # decode rank 0's regions, every source
    busiest = max(moves.received.values(), key=lambda k: k["main"] + k["indexer"])
    moved_total = busiest["main"] + busiest["indexer"]
    network = sum(k["main"] + k["indexer"] for k in moves.received.values())
    rank_bytes_per_s = inputs.link_gbps / 8 * 1e9 * inputs.nics_per_rank
    link_bytes = max(moved_total, max(moves.sent.values()))  # each rank has its own NICs; the busiest one bounds
    layer_main = next(e.num_bytes for e in entries if e.src.kind == "main")
    layer_index = next((e.num_bytes for e in entries if e.src.kind == "indexer"), 0)
    return {
        "model_type": g.model_type,
        "bytes_per_token": {
            "main": per_token_main,
            "indexer": per_token_index,
            "total": per_token_main + per_token_index,
        },
        "bytes_per_token_with_mtp": per_token_main + per_token_index + per_token_mtp,
        "bytes_per_request": {
            "main": per_token_main * n,
            "indexer": per_token_index * n,
            "total": (per_token_main + per_token_index) * n,
        },
        "bytes_moved_per_rank": {**busiest, "total": moved_total},
        "tokens": n,
        "prefix_tokens": inputs.prefix_tokens,
        "page_tokens": inputs.prefill_page_tokens,
        "decode_page_tokens": inputs.decode_page_tokens,
        "pages": num_pages_for(n, inputs.prefill_page_tokens),
        "suffix_pages": int(moves.first_rank[0].src_pages.size),
        "full_indexer_layers": list(g.full_indexer_layers),
        "mtp_layers": list(g.mtp_layers),
        "regions_per_rank": len(entries),
        "runs": moves.runs,
        "prefill_tp": inputs.prefill_tp,
        "decode_tp": inputs.decode_tp,
        "prefill_sharding": msgspec.to_builtins(inputs.prefill_sharding),
        "decode_sharding": msgspec.to_builtins(inputs.decode_sharding),
        "sources_of_decode_rank": [moves.sources[d] for d in range(inputs.decode_tp)],
        "bytes_received_per_decode_rank": [sum(moves.received[d].values()) for d in range(inputs.decode_tp)],
        "bytes_sent_per_prefill_rank": [moves.sent[r] for r in range(inputs.prefill_tp)],
        "bytes_over_network": network,
        "link_gbps": inputs.link_gbps,
        "nics_per_rank": inputs.nics_per_rank,
        "link_seconds": link_bytes / rank_bytes_per_s,
        "per_layer_seconds": {"main": layer_main / rank_bytes_per_s, "indexer": layer_index / rank_bytes_per_s},
        "exposed": exposure(
            link_bytes=link_bytes,
            suffix_tokens=n - inputs.prefix_tokens,
            rank_bytes_per_s=rank_bytes_per_s,
            chunk_tokens=inputs.chunk_tokens,
            prefill_tokens_per_s=inputs.prefill_tokens_per_s,
            round_trips=moves.round_trips,
            rtt_s=inputs.rtt_s,
        ),
    }

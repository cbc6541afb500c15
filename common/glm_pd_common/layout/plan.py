"""The transfer plan of one request: per layer in ascending order, main runs then indexer runs, suffix only.

All regions of a rank share one page table (one KV-cache group), so the relative runs depend only on the
page format and the two strides; they are computed once per distinct (format, strides) and offset by each
region's base address. That keeps a 1M-token, 101-region plan to a few vectorized passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glm_pd_common.errors import PlanError
from glm_pd_common.layout.pages import (
    Chunks,
    as_page_ids,
    check_unique,
    chunk_runs,
    coalesce,
    suffix_page_span,
    transfer_chunks,
)
from glm_pd_common.layout.regions import Region, plan_order
from glm_pd_common.layout.shards import WHOLE, TokenShard


@dataclass(frozen=True)
class RegionRuns:
    """The coalesced runs between one source region and its destination region (offsets from each base)."""

    src: Region
    dst: Region
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_runs(self) -> int:
        return int(self.lengths.size)


@dataclass(frozen=True)
class TransferPlan:
    """Everything that moves for one request between one source rank and one destination rank."""

    entries: tuple[RegionRuns, ...]
    chunks: Chunks
    src_pages: np.ndarray
    dst_pages: np.ndarray
    num_tokens: int
    prefix_tokens: int
    src_shard: TokenShard = WHOLE
    dst_shard: TokenShard = WHOLE

    @property
    def num_runs(self) -> int:
        return sum(e.num_runs for e in self.entries)

    @property
    def num_bytes(self) -> int:
        return sum(e.num_bytes for e in self.entries)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {"main": 0, "indexer": 0}
        for e in self.entries:
            out[e.src.kind] += e.num_bytes
        return out

    def runs_by_kind(self) -> dict[str, int]:
        out = {"main": 0, "indexer": 0}
        for e in self.entries:
            out[e.src.kind] += e.num_runs
        return out

    def layers(self) -> list[tuple[int, list[RegionRuns]]]:
        """Entries grouped by layer, in plan order (a pull posts the first layer apart from the rest)."""
        groups: dict[int, list[RegionRuns]] = {}
        for e in self.entries:
            groups.setdefault(e.src.layer_id, []).append(e)
        return list(groups.items())

    def chunk_runs(self, entry: RegionRuns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The entry's runs before coalescing (one per chunk and segment), offsets from each region's base."""
        return chunk_runs(
            self.chunks,
            entry.src.page_format,
            self.src_pages,
            self.dst_pages,
            src_page_tokens=entry.src.page_tokens,
            dst_page_tokens=entry.dst.page_tokens,
            src_stride=entry.src.page_stride,
            dst_stride=entry.dst.page_stride,
        )

    def absolute_runs(self, entries: list[RegionRuns] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src address, dst address, length)`` of the given entries (default: all), in plan order."""
        chosen = list(self.entries) if entries is None else entries
        if not chosen:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        src = np.concatenate([e.src_offsets + e.src.base_addr for e in chosen])
        dst = np.concatenate([e.dst_offsets + e.dst.base_addr for e in chosen])
        return src, dst, np.concatenate([e.lengths for e in chosen])


def build_plan(
    src_regions: list[Region],
    dst_regions: list[Region],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    *,
    num_tokens: int,
    prefix_tokens: int,
    src_shard: TokenShard = WHOLE,
    dst_shard: TokenShard = WHOLE,
    layers: tuple[int, ...] | None = None,
) -> TransferPlan:
    """Plan one request. ``src_pages``/``dst_pages`` are each side's *suffix* pages (see ``suffix_pages``).

    With sharded caches (``shards``) only the tokens both ranks hold move, and only ``layers`` (default:
    every region's), so a plan is one piece of what a decode rank reads. Page ids, usually supplied by the
    remote peer, are bounds-checked against every region before any run is produced; a page listed twice
    is refused.
    """
    src_sorted, dst_sorted = plan_order(_chosen(src_regions, layers)), plan_order(_chosen(dst_regions, layers))
    _check_pairing(src_sorted, dst_sorted)
    src_pt = _common_page_tokens(src_sorted, "source")
    dst_pt = _common_page_tokens(dst_sorted, "destination")
    src_span, dst_span = src_shard.table_tokens(src_pt), dst_shard.table_tokens(dst_pt)
    src_ids = _checked_pages(src_pages, src_sorted, num_tokens, prefix_tokens, src_span, dst_span, side="source")
    dst_ids = _checked_pages(dst_pages, dst_sorted, num_tokens, prefix_tokens, dst_span, dst_span, side="destination")
    chunks = transfer_chunks(num_tokens, prefix_tokens, src_pt, dst_pt, src_shard, dst_shard)
    cache: dict[tuple[object, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    entries = []
    for src, dst in zip(src_sorted, dst_sorted, strict=True):
        key = (src.page_format, src.page_stride, dst.page_stride)
        if key not in cache:
            raw = chunk_runs(
                chunks,
                src.page_format,
                src_ids,
                dst_ids,
                src_page_tokens=src_pt,
                dst_page_tokens=dst_pt,
                src_stride=src.page_stride,
                dst_stride=dst.page_stride,
            )
            cache[key] = coalesce(*raw)
        s, d, n = cache[key]
        entries.append(RegionRuns(src=src, dst=dst, src_offsets=s, dst_offsets=d, lengths=n))
    return TransferPlan(
        entries=tuple(entries),
        chunks=chunks,
        src_pages=src_ids,
        dst_pages=dst_ids,
        num_tokens=num_tokens,
        prefix_tokens=prefix_tokens,
        src_shard=src_shard,
        dst_shard=dst_shard,
    )


def _chosen(regions: list[Region], layers: tuple[int, ...] | None) -> list[Region]:
    if layers is None:
        return regions
    wanted = set(layers)
    return [r for r in regions if r.layer_id in wanted]


def _check_pairing(src: list[Region], dst: list[Region]) -> None:
    src_keys, dst_keys = [r.key for r in src], [r.key for r in dst]
    if src_keys != dst_keys:
        only_src = sorted(set(src_keys) - set(dst_keys))
        only_dst = sorted(set(dst_keys) - set(src_keys))
        raise PlanError(f"regions do not pair: only on source {only_src}, only on destination {only_dst}")
    for s, d in zip(src, dst, strict=True):
        if s.page_format != d.page_format:
            raise PlanError(
                f"region {s.name}: page formats differ, source {s.page_format.segment_bytes_per_token} B/token "
                f"per segment vs destination {d.page_format.segment_bytes_per_token}"
            )


def _common_page_tokens(regions: list[Region], side: str) -> int:
    sizes = {r.page_tokens for r in regions}
    if len(sizes) != 1:
        raise PlanError(f"{side} regions use several page sizes {sorted(sizes)}; one KV-cache group has one")
    return sizes.pop()


def _checked_pages(
    pages: np.ndarray,
    regions: list[Region],
    num_tokens: int,
    prefix_tokens: int,
    table_tokens: int,
    align_tokens: int,
    *,
    side: str,
) -> np.ndarray:
    first, end = suffix_page_span(num_tokens, prefix_tokens, table_tokens, align_tokens=align_tokens)
    ids = as_page_ids(pages, side=side)
    if ids.ndim != 1 or ids.size != end - first:
        raise PlanError(
            f"{side} lists {ids.size} suffix pages; tokens {prefix_tokens}..{num_tokens} in pages of "
            f"{table_tokens} need {end - first}"
        )
    by_bound: dict[int, Region] = {}
    for r in regions:
        by_bound.setdefault(r.num_pages, r)
    checked = ids
    for region in by_bound.values():
        checked = region.check_pages(ids, side=side)
    check_unique(checked, side=side)
    return checked

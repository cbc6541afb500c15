"""Page math for one request: the suffix rule, page-size conversion and run coalescing (vectorized numpy).

Tokens are cut into *chunks* of ``gcd(src_page_tokens, dst_page_tokens)`` tokens: each chunk lies inside one
source page and one destination page, so for every page segment it is one contiguous byte range on both
sides. Chunks are then coalesced into the fewest runs that are contiguous on both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from glm_pd_common.errors import PageOutOfRange, PlanError
from glm_pd_common.layout.formats import PageFormat
from glm_pd_common.layout.shards import WHOLE, TokenShard


def num_pages_for(num_tokens: int, page_tokens: int) -> int:
    return -(-num_tokens // page_tokens)


def suffix_page_span(num_tokens: int, prefix_tokens: int, page_tokens: int, *, align_tokens: int) -> tuple[int, int]:
    """Indices ``[first, end)`` into a request's page table of the pages that hold tokens past the prefix.

    ``prefix_tokens`` is decode's local prefix hit; it must be a multiple of ``align_tokens`` (decode's
    page size) so that decode's held pages are whole. Both sides call this with the same numbers.
    """
    if num_tokens <= 0:
        raise PlanError(f"num_tokens must be positive, got {num_tokens}")
    if not 0 <= prefix_tokens <= num_tokens:
        raise PlanError(f"prefix_tokens {prefix_tokens} is outside 0..num_tokens ({num_tokens})")
    if prefix_tokens % align_tokens:
        raise PlanError(f"prefix_tokens {prefix_tokens} is not page-aligned (decode page size {align_tokens} tokens)")
    return prefix_tokens // page_tokens, num_pages_for(num_tokens, page_tokens)


def suffix_pages(
    page_table: np.ndarray, num_tokens: int, prefix_tokens: int, page_tokens: int, *, align_tokens: int
) -> np.ndarray:
    """The page ids that must travel, cut from a request's full page table."""
    first, end = suffix_page_span(num_tokens, prefix_tokens, page_tokens, align_tokens=align_tokens)
    table = np.asarray(page_table, dtype=np.int64)
    if table.ndim != 1 or table.size < end:
        raise PlanError(f"page table holds {table.size} pages; {num_tokens} tokens need {end}")
    return table[first:end]


@dataclass(frozen=True)
class Chunks:
    """Where each chunk of a request's transferred tokens sits on both sides (indices into suffix pages)."""

    chunk_tokens: int
    src_page_index: np.ndarray
    src_token_in_page: np.ndarray
    dst_page_index: np.ndarray
    dst_token_in_page: np.ndarray

    @property
    def count(self) -> int:
        return int(self.src_page_index.size)


def transfer_chunks(
    num_tokens: int,
    prefix_tokens: int,
    src_page_tokens: int,
    dst_page_tokens: int,
    src_shard: TokenShard = WHOLE,
    dst_shard: TokenShard = WHOLE,
) -> Chunks:
    """Chunks covering the tokens of ``[prefix, roundup(num_tokens, chunk))`` that both shards hold.

    A chunk is ``gcd`` of both pages and both interleaves, so it lies inside one interleave turn and one
    page on each side: contiguous on both. Rounding up to a whole chunk stays inside the last page of both
    sides; with equal page sizes and no sharding a chunk is a whole page, so pages are copied whole, as
    SGLang's checksum expects. Page indices count page-table entries past the prefix (``table_tokens``
    global tokens each); the token in a page is the token's local slot on its shard.
    """
    grains = [src_page_tokens, dst_page_tokens] + [g for g in (src_shard.grain(), dst_shard.grain()) if g]
    chunk = math.gcd(*grains)
    src_span, dst_span = src_shard.table_tokens(src_page_tokens), dst_shard.table_tokens(dst_page_tokens)
    suffix_page_span(num_tokens, prefix_tokens, dst_span, align_tokens=dst_span)
    starts = np.arange(prefix_tokens, num_pages_for(num_tokens, chunk) * chunk, chunk, dtype=np.int64)
    if src_shard.count > 1 or dst_shard.count > 1:
        starts = starts[src_shard.owns(starts) & dst_shard.owns(starts)]
    return Chunks(
        chunk_tokens=chunk,
        src_page_index=starts // src_span - prefix_tokens // src_span,
        src_token_in_page=src_shard.local(starts) % src_page_tokens,
        dst_page_index=starts // dst_span - prefix_tokens // dst_span,
        dst_token_in_page=dst_shard.local(starts) % dst_page_tokens,
    )


def chunk_runs(
    chunks: Chunks,
    fmt: PageFormat,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    *,
    src_page_tokens: int,
    dst_page_tokens: int,
    src_stride: int,
    dst_stride: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Uncoalesced runs ``(src offset, dst offset, length)`` relative to each region's base, one per chunk
    and segment, in token order within each segment."""
    widths = np.asarray(fmt.segment_bytes_per_token, dtype=np.int64)
    src = (src_pages[chunks.src_page_index] * src_stride)[None, :] + (
        fmt.segment_starts(src_page_tokens)[:, None] + widths[:, None] * chunks.src_token_in_page[None, :]
    )
    dst = (dst_pages[chunks.dst_page_index] * dst_stride)[None, :] + (
        fmt.segment_starts(dst_page_tokens)[:, None] + widths[:, None] * chunks.dst_token_in_page[None, :]
    )
    lengths = np.broadcast_to((widths * chunks.chunk_tokens)[:, None], src.shape)
    return src.ravel(), dst.ravel(), lengths.ravel().copy()


def coalesce(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs contiguous on both sides into the fewest runs, sorted by source offset.

    Source ranges are disjoint, so each run has at most one source successor; merging along source order
    therefore joins every mergeable pair and the result is the minimum number of runs.
    """
    if src.size == 0:
        return src, dst, lengths
    order = np.argsort(src, kind="stable")
    s, d, n = src[order], dst[order], lengths[order]
    starts = np.ones(s.size, dtype=bool)
    starts[1:] = (s[1:] != s[:-1] + n[:-1]) | (d[1:] != d[:-1] + n[:-1])
    idx = np.flatnonzero(starts)
    return s[idx], d[idx], np.add.reduceat(n, idx)


INT64_MAX = (1 << 63) - 1  # the one bound: page ids, token counts and addresses are int64 everywhere


def as_page_ids(pages: object, *, side: str) -> np.ndarray:
    """Page ids (often a peer's) as int64 where they are integers. An id past int64 is refused as sent:
    numpy would turn a list holding one into floats or objects, or wrap a uint64 array's into negatives.
    Only such hostile input is looked at element by element; a valid list converts in one numpy call."""
    ids = np.asarray(pages)
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) > INT64_MAX:
        raise PageOutOfRange(f"{side} page id {int(ids.max())} is not a 64-bit page id")
    if ids.dtype.kind in "fO" and not isinstance(pages, np.ndarray):
        flat = np.ravel(np.asarray(pages, dtype=object))
        big = next((p for p in flat if isinstance(p, int) and not -INT64_MAX <= p <= INT64_MAX), None)
        if big is not None:
            raise PageOutOfRange(f"{side} page id {big} is not a 64-bit page id")
    # non-integers pass through: each region's check refuses them, naming the region
    return ids.astype(np.int64, copy=False) if np.issubdtype(ids.dtype, np.integer) else ids


MAX_PAGES_PER_BLOCK = 256  # a 4096-token scheduler block of 16-token kernel pages; more is hostile


def block_pages(block_ids: object, pages_per_block: int, *, side: str = "local") -> np.ndarray:
    """The kernel pages of scheduler blocks, block by block: block ``b`` is pages ``b·r .. b·r + r - 1``.

    vLLM splits a scheduler block into ``r`` kernel blocks that sit one after another in memory (its
    ``[r·B, 1, K, C]`` views), and each kernel block has the page layout of a ``K``-token page: for the
    indexer, ``K`` keys then ``K`` scales. Regions are therefore registered per kernel page, and block ids
    (often a peer's) are translated here. An id whose pages would pass int64 is refused, not wrapped.
    """
    if not 1 <= pages_per_block <= MAX_PAGES_PER_BLOCK:
        raise PlanError(f"{side} pages_per_block must be in 1..{MAX_PAGES_PER_BLOCK}, got {pages_per_block}")
    ids = as_page_ids(block_ids, side=side)
    if ids.ndim != 1:
        raise PlanError(f"{side} block ids must be one list, got shape {ids.shape}")
    if not ids.size:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise PageOutOfRange(f"{side} block ids are not integers (dtype {ids.dtype})")
    if pages_per_block == 1:
        return ids
    limit = (INT64_MAX - pages_per_block + 1) // pages_per_block
    bad = (ids < 0) | (ids > limit)
    if np.any(bad):
        raise PageOutOfRange(f"{side} block id {int(ids[np.argmax(bad)])} has no kernel pages (valid 0..{limit})")
    return (ids[:, None] * pages_per_block + np.arange(pages_per_block, dtype=np.int64)).ravel()


def check_unique(pages: np.ndarray, *, side: str) -> None:
    """A page listed twice would make two tokens' bytes land on one place: refuse it."""
    # Sort-based rather than np.unique: np.unique imports numpy.ma on first use, seconds of GIL-bound work
    # that starves a service thread while the engine's step loop spins (seen on a 2-core vLLM CPU box).
    ordered = np.sort(pages, kind="stable")
    repeats = int(np.count_nonzero(ordered[1:] == ordered[:-1]))
    if repeats:
        raise PlanError(f"{side} page ids repeat a page ({repeats} duplicate(s))")

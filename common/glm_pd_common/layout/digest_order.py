"""Which bytes a digest covers, and in what order: the rules both peers follow so their numbers compare.

Pure run arithmetic over a plan or a region's page list; reading and hashing the bytes is the transport's
(``glm_pd_common.transport.digests``), since it alone knows how a region's memory can be read.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from glm_pd_common.layout.plan import RegionRuns, TransferPlan
from glm_pd_common.layout.regions import Region

Side = Literal["src", "dst"]


def side_runs(entry: RegionRuns, side: Side) -> tuple[Region, np.ndarray]:
    """One side of a region pair: its region and the byte offsets of the pair's runs there."""
    if side == "src":
        return entry.src, entry.src_offsets
    if side == "dst":
        return entry.dst, entry.dst_offsets
    raise ValueError(f"side must be 'src' or 'dst', got {side!r}")


def runs_by_page(plan: TransferPlan, entry_index: int, side: Side) -> tuple[Region, np.ndarray, np.ndarray, np.ndarray]:
    """The runs of one region pair regrouped by the destination page they land in, as
    ``(region, offsets, lengths, page_starts)``: the runs of destination page position ``i`` are
    ``page_starts[i]:page_starts[i + 1]``, in the order its bytes are read."""
    entry = plan.entries[entry_index]
    src, dst, lengths = plan.chunk_runs(entry)
    region, _ = side_runs(entry, side)
    offsets = src if side == "src" else dst
    segments = len(entry.src.page_format.segment_bytes_per_token)
    page_of_run = np.tile(plan.chunks.dst_page_index, segments)
    order = np.argsort(page_of_run, kind="stable")
    runs_per_page = np.bincount(page_of_run, minlength=plan.dst_pages.size)
    return region, offsets[order], lengths[order], np.concatenate([[0], np.cumsum(runs_per_page)]).astype(np.int64)


def source_page(plan: TransferPlan, dst_page_index: int) -> int:
    """The first source page feeding a destination page position."""
    hit = np.flatnonzero(plan.chunks.dst_page_index == dst_page_index)
    return int(plan.src_pages[plan.chunks.src_page_index[hit[0]]])


def moved_byte(plan: TransferPlan) -> tuple[Region, int]:
    """A destination byte the plan writes (the last byte of its last run), as region and offset: a change there
    is always among the bytes a check compares, whatever the page sizes and prefix."""
    entry = next(e for e in reversed(plan.entries) if e.num_runs)
    return entry.dst, int(entry.dst_offsets[-1]) + int(entry.lengths[-1]) - 1


def page_list_runs(region: Region, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A region's listed pages, whole and in list order, as byte runs; consecutive pages of a densely packed
    region become one run. (SGLang's contract: both sides copy whole pages of equal size, so source and
    destination digests over their own suffix lists compare with no shared plan.)"""
    ids = region.check_pages(pages)
    if ids.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if region.page_stride == region.page_bytes:
        starts = np.flatnonzero(np.diff(ids, prepend=ids[0] - 2) != 1)
        lengths = np.diff(np.append(starts, ids.size)) * region.page_bytes
        return ids[starts] * region.page_stride, lengths
    return ids * region.page_stride, np.full(ids.size, region.page_bytes, dtype=np.int64)

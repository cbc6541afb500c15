"""Digests of the bytes a plan moves, read from registered memory.

Both sides digest the same runs in the same order (``layout.digest_order``) by the same definition
(``layout.digest_words``), so one digest per region pair compares the source bytes with what landed. On a
mismatch, per-page digests of that one region name the first bad page. The bytes are read through a
``MemoryReader`` (``memory``): host memory directly, device memory on its device (or staged to the host), so a
digest never dereferences a device address from the CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from glm_pd_common.errors import ChecksumMismatch
from glm_pd_common.layout.digest_order import Side, page_list_runs, runs_by_page, side_runs, source_page
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.layout.regions import Region
from glm_pd_common.transport.memory import HOST, MemoryReader


def plan_digests(plan: TransferPlan, side: Side, memory: MemoryReader = HOST) -> list[int]:
    """One digest per region pair of the plan, over that side's bytes."""
    out = []
    for entry in plan.entries:
        region, offsets = side_runs(entry, side)
        out.append(memory.digest(region, offsets, entry.lengths))
    return out


def page_digests(plan: TransferPlan, entry_index: int, side: Side, memory: MemoryReader = HOST) -> list[int]:
    """Per destination page of one region pair: the digest of the bytes that land in that page, each page a
    stream of its own (its word positions start at 0), so either side computes it from that page's runs alone."""
    region, offsets, lengths, page_starts = runs_by_page(plan, entry_index, side)
    return [memory.digest(region, offsets[a:b], lengths[a:b]) for a, b in itertools.pairwise(page_starts.tolist())]


MAX_PAGE_QUERIES = 8  # regions whose per-page digests decode asks for, and prefill answers, on a mismatch


def check_landed(
    plan: TransferPlan,
    expected: list[int],
    page_digests_of: Callable[[list[int]], dict[int, list[int]]],
    memory: MemoryReader = HOST,
) -> None:
    """The digest exchange, decode's side: compare what landed with the source's region digests; on a
    mismatch ask the source (``page_digests_of``) for per-page digests of the differing regions, so the
    error names the first bad page. Both replies come from the peer and are checked before use."""
    bad = mismatched_regions(plan, expected, memory)
    verify(plan, expected, remote_pages=page_digests_of(bad[:MAX_PAGE_QUERIES]) if bad else None, memory=memory)


def verify(
    plan: TransferPlan,
    expected: list[int],
    *,
    remote_pages: dict[int, list[int]] | None = None,
    memory: MemoryReader = HOST,
) -> None:
    """Compare the destination's bytes with the source's digests; raise naming layer, kind and page.

    ``remote_pages`` optionally holds the source's per-page digests of regions already known to differ,
    which lets the error name the first differing destination page.
    """
    _check_counts(plan, expected)
    for index, pages in (remote_pages or {}).items():
        if not 0 <= index < len(plan.entries) or len(pages) != plan.dst_pages.size:
            raise ChecksumMismatch(
                f"peer sent per-page digests for region {index}: {len(pages)} digests; the plan has "
                f"{len(plan.entries)} regions of {plan.dst_pages.size} destination pages"
            )
    local = plan_digests(plan, "dst", memory)
    for index, (entry, got, want) in enumerate(zip(plan.entries, local, expected, strict=True)):
        if got == want:
            continue
        where = f"layer {entry.dst.layer_id} {entry.dst.kind} region"
        if remote_pages and index in remote_pages:
            mine = page_digests(plan, index, "dst", memory)
            bad = [i for i, (a, b) in enumerate(zip(mine, remote_pages[index], strict=True)) if a != b]
            if bad:
                page = int(plan.dst_pages[bad[0]])
                raise ChecksumMismatch(
                    f"checksum mismatch in {where}, destination page {page} "
                    f"(source page {source_page(plan, bad[0])}); {len(bad)} page(s) differ"
                )
        raise ChecksumMismatch(f"checksum mismatch in {where}: digest {got:#018x}, source sent {want:#018x}")


def mismatched_regions(plan: TransferPlan, expected: list[int], memory: MemoryReader = HOST) -> list[int]:
    """Indices of region pairs whose destination bytes differ from the source digests."""
    _check_counts(plan, expected)
    return [i for i, (a, b) in enumerate(zip(plan_digests(plan, "dst", memory), expected, strict=True)) if a != b]


def _check_counts(plan: TransferPlan, expected: list[int]) -> None:
    if len(expected) != len(plan.entries):
        raise ChecksumMismatch(f"peer sent {len(expected)} region digests; the plan has {len(plan.entries)} regions")


def region_pages_digest(region: Region, pages: np.ndarray, memory: MemoryReader = HOST) -> int:
    """One digest of a region's listed pages, whole and in list order (``page_list_runs``)."""
    return memory.digest(region, *page_list_runs(region, pages))

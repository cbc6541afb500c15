"""Digests of the bytes a plan moves, read from registered memory.

Both sides digest the same runs in the same order (``layout.digest_order``) by the same definition
(``layout.digest_words``), so one digest per region pair compares the source bytes with what landed. On a
mismatch, per-page digests of that one region name the first bad page. The bytes are read through a
``MemoryReader`` (``memory``): host memory directly, device memory on its device (or staged to the host), so a
digest never dereferences a device address from the CPU.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import numpy as np

from glm_pd_common.errors import ChecksumMismatch
from glm_pd_common.layout.digest_order import Side, page_list_runs, runs_by_page, side_runs, source_page
from glm_pd_common.layout.digest_words import BLOCK_BYTES, MASK, finish
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.slots import runs_between
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
    *,
    local: list[int] | None = None,
) -> None:
    """The digest exchange, decode's side: compare what landed (``local``: its region digests, taken as it
    landed; else read now) with the source's region digests; on a mismatch ask the source (``page_digests_of``)
    for per-page digests of the differing regions, so the error names the first bad page. Both replies come
    from the peer and are checked before use."""
    _check_counts(plan, expected)
    local = plan_digests(plan, "dst", memory) if local is None else local
    bad = [i for i, (a, b) in enumerate(zip(local, expected, strict=True)) if a != b]
    if bad:
        verify(plan, expected, remote_pages=page_digests_of(bad[:MAX_PAGE_QUERIES]), memory=memory, local=local)


def verify(
    plan: TransferPlan,
    expected: list[int],
    *,
    remote_pages: dict[int, list[int]] | None = None,
    memory: MemoryReader = HOST,
    local: list[int] | None = None,
) -> None:
    """Compare the destination's bytes (``local``: their region digests, if taken already) with the source's
    digests; raise naming layer, kind and page.

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
    local = plan_digests(plan, "dst", memory) if local is None else local
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


def _check_counts(plan: TransferPlan, expected: list[int]) -> None:
    if len(expected) != len(plan.entries):
        raise ChecksumMismatch(f"peer sent {len(expected)} region digests; the plan has {len(plan.entries)} regions")


def region_pages_digest(region: Region, pages: np.ndarray, memory: MemoryReader = HOST) -> int:
    """One digest of a region's listed pages, whole and in list order (``page_list_runs``)."""
    return memory.digest(region, *page_list_runs(region, pages))


class LandedDigests:
    """Decode's region digests of a plan's destination, taken as its bytes land: the plan's stream is its region
    pairs' runs in plan order (as ``transport.staging`` cuts it into slots), and ``landed(upto)`` says its first
    ``upto`` bytes are in decode's pages. Each region pair's whole blocks landed by then are summed at once (on
    whichever thread calls: a digest thread while later slots move); ``digests()`` sums the rest. A byte is read
    once, after it landed; a later write to it (there is none in a staged read: slots are disjoint) would go
    unseen. Thread-safe."""

    def __init__(self, plan: TransferPlan, memory: MemoryReader) -> None:
        self._plan, self._memory = plan, memory
        sizes = np.array([int(e.lengths.sum()) for e in plan.entries], dtype=np.int64)
        self._sizes, self._starts = sizes, np.cumsum(sizes) - sizes
        self._summed = np.zeros(sizes.size, dtype=np.int64)  # bytes of each pair summed into ``_h``
        self._h = [0] * sizes.size
        self._lock = threading.Lock()

    def landed(self, upto: int) -> None:
        with self._lock:
            here = np.clip(upto - self._starts, 0, self._sizes)
            # a pair summed in parts is cut at whole blocks; one landed whole is summed to its end
            ends = np.where(here == self._sizes, here, here // BLOCK_BYTES * BLOCK_BYTES)
            for i in np.flatnonzero(ends > self._summed).tolist():
                entry = self._plan.entries[i]
                first, last = int(self._summed[i]), int(ends[i])
                offsets, lengths = runs_between(entry.dst_offsets, entry.lengths, first, last)
                self._h[i] = (self._h[i] + self._memory.word_sum(entry.dst, offsets, lengths, first)) & MASK
                self._summed[i] = last

    def digests(self) -> list[int]:
        """One digest per region pair, over everything the plan wrote (what has not been summed is, now)."""
        self.landed(int(self._sizes.sum()))
        return [finish(h, int(n)) for h, n in zip(self._h, self._sizes.tolist(), strict=True)]

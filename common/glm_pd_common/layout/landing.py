"""Where a peer may make bytes land: runs it names, checked to lie wholly in pages this rank holds for a request.

A staged push names the destination runs of each slot (the writer computed them from its plan); before the slot
is scattered, every run must fall inside one region, within the page data (never a page's padding), and touch
only pages listed for the request. Vectorized: one pass over the runs, whatever their number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glm_pd_common.layout.regions import Region


def stray_run(regions: Sequence[Region], pages: np.ndarray, addrs: np.ndarray, lengths: np.ndarray) -> str:
    """Why some run ``(addrs, lengths)`` does not lie wholly in ``pages`` of one of ``regions`` ("" if all do)."""
    if addrs.size == 0:
        return ""
    ordered = sorted(regions, key=lambda r: r.base_addr)
    bases = np.array([r.base_addr for r in ordered], dtype=np.int64)
    strides = np.array([r.page_stride for r in ordered], dtype=np.int64)
    page_bytes = np.array([r.page_bytes for r in ordered], dtype=np.int64)
    num_pages = np.array([r.num_pages for r in ordered], dtype=np.int64)
    idx = np.clip(np.searchsorted(bases, addrs, side="right") - 1, 0, None)
    rel = addrs - bases[idx]
    size = strides[idx] * num_pages[idx]
    # sane before any sum: peer numbers near 2**63 must not wrap into a range that passes
    ok = (rel >= 0) & (rel < size) & (lengths > 0) & (lengths <= size)
    rel, lengths = np.where(ok, rel, 0), np.where(ok, lengths, 1)
    first, last = rel // strides[idx], (rel + lengths - 1) // strides[idx]
    # a run over several pages crosses no padding: only where pages are packed (stride == page bytes)
    packed = (first == last) | (strides[idx] == page_bytes[idx])
    ok &= (last < num_pages[idx]) & packed
    ok &= rel % strides[idx] < page_bytes[idx]
    ok &= (rel + lengths - 1) % strides[idx] < page_bytes[idx]
    allowed = np.zeros(int(num_pages.max()) + 1, dtype=np.int64)
    listed = pages[(pages >= 0) & (pages < allowed.size - 1)]
    allowed[listed] = 1
    held = np.concatenate([[0], np.cumsum(allowed)])
    safe_first, safe_last = np.clip(first, 0, allowed.size - 1), np.clip(last, 0, allowed.size - 1)
    ok &= held[safe_last + 1] - held[safe_first] == safe_last - safe_first + 1
    if ok.all():
        return ""
    bad = int(np.argmin(ok))
    return (
        f"run {bad} [{int(addrs[bad]):#x}, +{int(lengths[bad])}) does not lie in the request's pages of one region "
        f"(nearest {ordered[int(idx[bad])].name}, pages {int(first[bad])}..{int(last[bad])}); "
        f"{int((~ok).sum())} such run(s)"
    )

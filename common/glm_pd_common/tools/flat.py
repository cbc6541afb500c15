"""One flat buffer described as a region, for single-run measurements beside the paged caches."""

from __future__ import annotations

import numpy as np

from glm_pd_common.layout.formats import PageFormat
from glm_pd_common.layout.regions import MemKind, Region

FLAT_LAYER_ID = -1


def flat_region(buf: np.ndarray) -> Region:
    """A host buffer as one page of one "token" of its whole size: never part of a plan, only of raw posts."""
    return flat_span(buf.ctypes.data, buf.nbytes)


def flat_span(base_addr: int, size: int, mem_kind: MemKind = "DRAM", device_id: int = 0) -> Region:
    """``flat_region`` for memory numpy cannot hold (a GPU buffer: its address, size and device)."""
    return Region(
        kind="main",
        layer_id=FLAT_LAYER_ID,
        is_mtp=False,
        base_addr=base_addr,
        page_tokens=1,
        page_bytes=size,
        page_stride=size,
        num_pages=1,
        page_format=PageFormat((size,)),
        mem_kind=mem_kind,
        device_id=device_id,
    )

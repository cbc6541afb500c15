"""One flat host buffer described as a region, for single-run measurements beside the paged caches."""

from __future__ import annotations

import numpy as np

from glm_pd_common.layout.formats import PageFormat
from glm_pd_common.layout.regions import Region

FLAT_LAYER_ID = -1


def flat_region(buf: np.ndarray) -> Region:
    """The buffer as one page of one "token" of its whole size: never part of a plan, only of raw posts."""
    return Region(
        kind="main",
        layer_id=FLAT_LAYER_ID,
        is_mtp=False,
        base_addr=buf.ctypes.data,
        page_tokens=1,
        page_bytes=buf.nbytes,
        page_stride=buf.nbytes,
        num_pages=1,
        page_format=PageFormat((buf.nbytes,)),
    )

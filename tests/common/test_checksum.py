import ctypes

import numpy as np
import pytest

from glm_pd_common.errors import ChecksumMismatch
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.digests import page_digests, plan_digests, verify


def _moved(spec, p=64, d=32):
    src = HostCaches(spec, page_tokens=p, num_pages=8)
    dst = HostCaches(spec, page_tokens=d, num_pages=16)
    src.write_tokens(np.arange(8)[::-1], 0, 300, seed=1)
    plan = build_plan(
        src.regions, dst.regions, np.arange(8)[::-1][:5], np.arange(16)[2:12], num_tokens=300, prefix_tokens=0
    )
    for s, t, n in zip(*plan.absolute_runs(), strict=True):
        ctypes.memmove(int(t), int(s), int(n))
    return src, dst, plan


def test_digests_match_after_a_faithful_copy(small_spec):
    _src, _dst, plan = _moved(small_spec)  # held: the plan's regions point into these caches
    expected = plan_digests(plan, "src")
    assert plan_digests(plan, "dst") == expected
    verify(plan, expected)


def test_a_flipped_byte_names_layer_kind_and_page(small_spec):
    _src, dst, plan = _moved(small_spec)  # _src held: the plan's source regions point into it
    expected = plan_digests(plan, "src")
    index = next(i for i, e in enumerate(plan.entries) if e.dst.kind == "indexer" and e.dst.layer_id == 3)
    remote_pages = {index: page_digests(plan, index, "src")}
    dst_page = int(plan.dst_pages[4])
    dst.buffers["indexer", 3][dst_page, 32 * 128 + 5] ^= 0xFF  # a scale byte of token 1 in that page
    with pytest.raises(ChecksumMismatch, match=rf"layer 3 indexer region, destination page {dst_page} "):
        verify(plan, expected, remote_pages=remote_pages)
    with pytest.raises(ChecksumMismatch, match="layer 3 indexer region: digest"):
        verify(plan, expected)


def test_wrong_digest_count_is_refused(small_spec):
    _, _, plan = _moved(small_spec)
    with pytest.raises(ChecksumMismatch, match="region digests"):
        verify(plan, [1, 2])

"""Plans over real host memory: every suffix byte moves exactly once, to the place the layout says."""

import ctypes
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm_pd_common.errors import PageOutOfRange, PlanError
from glm_pd_common.layout.capacity import AccountInputs, plan_for
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import suffix_pages
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.hostmem import HostCaches

SIZES = [16, 32, 64, 128]


def reference_pieces(region, table, tokens, page_tokens):
    """Per token and segment, straight from the layout facts: (byte offset in region, length)."""
    widths = region.page_format.segment_bytes_per_token
    out = []
    for t in tokens:
        page = int(table[t // page_tokens])
        seg_start = 0
        for w in widths:
            out.append((page * region.page_stride + seg_start + (t % page_tokens) * w, w))
            seg_start += page_tokens * w
    return out


def coverage(size, offsets, lengths):
    diff = np.zeros(size + 1, dtype=np.int64)
    np.add.at(diff, offsets, 1)
    np.add.at(diff, offsets + lengths, -1)
    return np.cumsum(diff)[:-1]


def min_runs(src_pieces, dst_pieces):
    """Fewest runs: pieces minus the pairs where one piece continues another on both sides."""
    ends = {(s + n, d + n) for (s, n), (d, _) in zip(src_pieces, dst_pieces, strict=True)}
    return sum((s, d) not in ends for (s, _), (d, _) in zip(src_pieces, dst_pieces, strict=True))


@st.composite
def cases(draw):
    p, d = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    num_tokens = draw(st.integers(1, 700))
    prefix = draw(st.integers(0, num_tokens // d)) * d
    if prefix == num_tokens:
        prefix -= d
    prefix = max(prefix, 0)
    p_pages, d_pages = math.ceil(num_tokens / p), math.ceil(num_tokens / d)
    p_pool, d_pool = p_pages + draw(st.integers(0, 5)), d_pages + draw(st.integers(0, 5))
    shuffle = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    p_table = rng.permutation(p_pool)[:p_pages] if shuffle else np.arange(p_pages) + (p_pool - p_pages)
    d_table = rng.permutation(d_pool)[:d_pages] if shuffle else np.arange(d_pages)
    padding = draw(st.sampled_from([0, 0, 64]))
    return p, d, num_tokens, prefix, p_pool, d_pool, p_table, d_table, padding


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_runs_move_every_suffix_byte_once_to_the_right_place(small_spec, case):
    p, d, num_tokens, prefix, p_pool, d_pool, p_table, d_table, padding = case
    src = HostCaches(small_spec, page_tokens=p, num_pages=p_pool, page_padding=padding)
    dst = HostCaches(small_spec, page_tokens=d, num_pages=d_pool)
    src.write_tokens(p_table, 0, num_tokens, seed=7)
    dst.write_tokens(d_table, 0, prefix, seed=7)  # decode's prefix hit: same content, already there
    sp = suffix_pages(p_table, num_tokens, prefix, p, align_tokens=d)
    dp = suffix_pages(d_table, num_tokens, prefix, d, align_tokens=d)
    plan = build_plan(src.regions, dst.regions, sp, dp, num_tokens=num_tokens, prefix_tokens=prefix)

    for s, t, n in zip(*plan.absolute_runs(), strict=True):
        ctypes.memmove(int(t), int(s), int(n))
    assert dst.mismatched_tokens(d_table, 0, num_tokens, seed=7) == []

    chunk = math.gcd(p, d)
    moved_tokens = range(prefix, math.ceil(num_tokens / chunk) * chunk)
    for entry in plan.entries:
        for region, table, pt, offsets in (
            (entry.src, p_table, p, entry.src_offsets),
            (entry.dst, d_table, d, entry.dst_offsets),
        ):
            assert np.all(offsets >= 0) and np.all(offsets + entry.lengths <= region.size_bytes)
            cov = coverage(region.size_bytes, offsets, entry.lengths)
            want = np.zeros(region.size_bytes, dtype=np.int64)
            for off, n in reference_pieces(region, table, moved_tokens, pt):
                want[off : off + n] += 1
            assert np.array_equal(cov, want)
        assert entry.num_runs == min_runs(
            reference_pieces(entry.src, p_table, moved_tokens, p),
            reference_pieces(entry.dst, d_table, moved_tokens, d),
        )


def test_plan_order_layers_ascending_main_then_indexer_mtp_last(small_spec):
    src = HostCaches(small_spec, page_tokens=64, num_pages=4)
    dst = HostCaches(small_spec, page_tokens=64, num_pages=4)
    plan = build_plan(src.regions[::-1], dst.regions, np.arange(2), np.arange(2), num_tokens=100, prefix_tokens=0)
    order = [(e.src.layer_id, e.src.kind) for e in plan.entries]
    assert order == [
        (0, "main"),
        (0, "indexer"),
        (1, "main"),
        (2, "main"),
        (3, "main"),
        (3, "indexer"),
        (4, "main"),
        (5, "main"),
        (6, "main"),
        (6, "indexer"),
    ]
    assert plan.entries[-1].src.is_mtp


def test_bytes_by_kind_count_suffix_only(small_spec):
    src = HostCaches(small_spec, page_tokens=64, num_pages=8)
    dst = HostCaches(small_spec, page_tokens=64, num_pages=8)
    plan = build_plan(src.regions, dst.regions, np.arange(2, 6), np.arange(4), num_tokens=512, prefix_tokens=256)
    by_kind = plan.bytes_by_kind()
    assert by_kind["main"] == 7 * 656 * 256
    assert by_kind["indexer"] == 3 * 132 * 256
    assert plan.num_runs == 10  # contiguous on both sides: one run per region


@pytest.mark.parametrize("bad", [-1, 8, 2**40])
def test_remote_page_ids_are_bounds_checked(small_spec, bad):
    src = HostCaches(small_spec, page_tokens=64, num_pages=8)
    dst = HostCaches(small_spec, page_tokens=64, num_pages=8)
    with pytest.raises(PageOutOfRange, match=rf"page id {bad} is outside region main\[layer 0\] \(valid 0..7\)"):
        build_plan(src.regions, dst.regions, np.array([0, bad]), np.arange(2), num_tokens=128, prefix_tokens=0)


def test_duplicate_and_miscounted_pages_are_refused(small_spec):
    src = HostCaches(small_spec, page_tokens=64, num_pages=8)
    dst = HostCaches(small_spec, page_tokens=64, num_pages=8)
    with pytest.raises(PlanError, match="duplicate"):
        build_plan(src.regions, dst.regions, np.arange(2), np.array([3, 3]), num_tokens=128, prefix_tokens=0)
    with pytest.raises(PlanError, match="need 2"):
        build_plan(src.regions, dst.regions, np.arange(3), np.arange(2), num_tokens=128, prefix_tokens=0)
    with pytest.raises(PlanError, match="not page-aligned"):
        build_plan(src.regions, dst.regions, np.arange(2), np.arange(2), num_tokens=128, prefix_tokens=10)


def test_unpaired_regions_are_refused(small_spec):
    src = HostCaches(small_spec, page_tokens=64, num_pages=8)
    dst = HostCaches(small_spec, page_tokens=64, num_pages=8)
    with pytest.raises(PlanError, match=r"only on source \[\('indexer', 3\)\]"):
        build_plan(
            src.regions,
            [r for r in dst.regions if r.key != ("indexer", 3)],
            np.arange(2),
            np.arange(2),
            num_tokens=128,
            prefix_tokens=0,
        )


def test_glm53_million_token_contiguous_plan_is_one_run_per_region():
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    plan = plan_for(AccountInputs(spec.geometry, spec.row, spec.indexer, 1 << 20), "contiguous")
    assert len(plan.entries) == 101
    assert plan.num_runs == 101
    assert plan.src_pages.size == 16_384

"""Where a staged push may make bytes land (``layout.landing``): runs inside a request's pages of one region pass;
a run touching another page, a page's padding, or no region at all is named."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm_pd_common.layout.landing import stray_run
from glm_pd_common.tools.hostmem import HostCaches

PAGES = 12


def _regions(spec):
    return HostCaches(spec, page_tokens=64, num_pages=PAGES).regions


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # spec: read only
@given(st.sets(st.integers(0, PAGES - 1), min_size=1), st.data())
def test_runs_within_listed_pages_pass_and_one_byte_outside_fails(small_spec, listed, data) -> None:
    regions = _regions(small_spec)
    region = regions[data.draw(st.integers(0, len(regions) - 1))]
    pages = np.array(sorted(listed), dtype=np.int64)
    page = int(data.draw(st.sampled_from(sorted(listed))))
    start = data.draw(st.integers(0, region.page_bytes - 1))
    length = data.draw(st.integers(1, region.page_bytes - start))
    addr = np.array([region.base_addr + page * region.page_stride + start], dtype=np.int64)
    assert stray_run(regions, pages, addr, np.array([length])) == ""
    others = sorted(set(range(PAGES)) - listed)
    if others:
        elsewhere = np.array([region.base_addr + others[0] * region.page_stride + start], dtype=np.int64)
        assert "does not lie in the request's pages" in stray_run(regions, pages, elsewhere, np.array([length]))


def test_a_run_over_two_listed_pages_passes_only_where_pages_are_packed(small_spec) -> None:
    regions = _regions(small_spec)
    main = next(r for r in regions if r.kind == "main")
    pages = np.array([3, 4], dtype=np.int64)
    across = np.array([main.base_addr + 3 * main.page_stride + main.page_bytes - 8], dtype=np.int64)
    assert (stray_run(regions, pages, across, np.array([16])) == "") == (main.page_stride == main.page_bytes)
    only_three = np.array([3], dtype=np.int64)
    assert "pages 3..4" in stray_run(regions, only_three, across, np.array([16]))


def test_runs_outside_every_region_or_empty_are_named(small_spec) -> None:
    regions = _regions(small_spec)
    pages = np.arange(PAGES, dtype=np.int64)
    low = min(r.base_addr for r in regions)
    assert "1 such run" in stray_run(regions, pages, np.array([low - 64], dtype=np.int64), np.array([8]))
    assert "run 0" in stray_run(regions, pages, np.array([low], dtype=np.int64), np.array([0]))
    end = max(r.base_addr + r.num_pages * r.page_stride for r in regions)
    assert stray_run(regions, pages, np.array([end - 4], dtype=np.int64), np.array([8])) != ""


def test_numbers_near_the_int64_edge_do_not_wrap_into_a_passing_run(small_spec) -> None:
    regions = _regions(small_spec)
    pages = np.arange(PAGES, dtype=np.int64)  # every page listed: only the arithmetic can refuse these
    big = (1 << 63) - 1
    first = regions[0]
    for addr, length in [(first.base_addr, big), (big - 8, big), (first.base_addr + 64, big - first.base_addr)]:
        assert stray_run(regions, pages, np.array([addr], dtype=np.int64), np.array([length], dtype=np.int64)) != ""

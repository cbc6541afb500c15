"""Digests read memory through a reader: host memory directly, device memory staged (issue 15 item 3).

Hashing a CUDA region through a host pointer segfaults the engine; the host reader now refuses device memory by
name, and ``StagedMemory`` copies device runs to the host in batches. Its batching is checked here with a copier
that reads host memory (a test double standing in for the device-to-host copy; tests/gpu checks the CUDA reader):
digests and per-page digests must equal the host reader's over the same bytes, whatever the staging size.
"""

import ctypes
import dataclasses
import re

import numpy as np
import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.digest_words import digest_bytes
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import suffix_pages
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.digests import page_digests, plan_digests, region_pages_digest
from glm_pd_common.transport.memory import HOST, StagedMemory

PAGE_TOKENS = 64
SPEC = CacheSpec.create(ModelGeometry.preset("glm-5.3"))


def as_vram(region, device=5):
    return dataclasses.replace(region, mem_kind="VRAM", device_id=device)


class HostCopier:
    """Test double for a device-to-host copy: reads the runs from host memory, counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.largest = 0

    def __call__(self, region, offsets, lengths):
        self.calls += 1
        total = int(lengths.sum())
        self.largest = max(self.largest, total)
        out = bytearray(total)
        at = 0
        for off, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
            out[at : at + n] = (ctypes.c_char * n).from_address(region.base_addr + off).raw
            at += n
        return memoryview(out)


@pytest.fixture(scope="module")
def caches():
    c = HostCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=24)
    c.write_tokens(np.arange(24), 0, 24 * PAGE_TOKENS, seed=5)
    return c


def test_the_host_reader_refuses_device_memory_by_name(caches) -> None:
    region = as_vram(caches.regions[3], device=2)
    with pytest.raises(ConfigError, match=r"is VRAM on device 2: its digest cannot be read through a host pointer"):
        HOST.digest(region, np.array([0]), np.array([16]))
    with pytest.raises(ConfigError, match=re.escape(region.name)):
        HOST.digest(region, np.array([16]), np.array([1]))


@pytest.mark.parametrize("staging", [1, 100, 4096, 1 << 20])
def test_staged_digests_equal_host_digests(caches, staging) -> None:
    """Runs cut and merged across staging buffers of every size (words cut in two included) digest to the bytes'
    own digest."""
    copier = HostCopier()
    staged = StagedMemory(copier, staging_bytes=staging)
    rng = np.random.default_rng(staging)
    pages = rng.permutation(24)[:9]
    for region in caches.regions[:5]:
        host = region_pages_digest(region, pages)
        assert region_pages_digest(as_vram(region), pages, staged) == host
        raw = b"".join(
            (ctypes.c_char * region.page_bytes).from_address(region.base_addr + int(p) * region.page_stride).raw
            for p in pages
        )
        assert host == digest_bytes(raw)
    assert copier.largest <= staging


def test_staged_page_digests_of_a_converted_plan(caches) -> None:
    """A 64 -> 32-token plan (each source page feeds two destination pages): per-page digests through staging
    equal the host reader's."""
    dst = HostCaches(SPEC, page_tokens=32, num_pages=40)
    num_tokens, prefix = 700, 128
    src_pages = suffix_pages(np.arange(12), num_tokens, prefix, PAGE_TOKENS, align_tokens=32)
    dst_pages = suffix_pages(np.arange(22)[::-1].copy(), num_tokens, prefix, 32, align_tokens=32)
    plan = build_plan(caches.regions, dst.regions, src_pages, dst_pages, num_tokens=num_tokens, prefix_tokens=prefix)
    vplan = dataclasses.replace(plan, entries=[dataclasses.replace(e, src=as_vram(e.src)) for e in plan.entries])
    staged = StagedMemory(HostCopier(), staging_bytes=3000)
    assert plan_digests(vplan, "src", staged) == plan_digests(plan, "src")
    for index in (0, len(plan.entries) - 1):
        assert page_digests(vplan, index, "src", staged) == page_digests(plan, index, "src")
    with pytest.raises(ConfigError, match="VRAM"):
        plan_digests(vplan, "src")


def test_two_threads_digesting_at_once_through_one_reader_get_their_own_bytes(caches) -> None:
    """Two threads digest two regions' short runs (packed through the host reader's slot) at once, 40 times each,
    and every digest is the region's own: the slot is the calling thread's (a shared one let one lane's runs
    overwrite the other's before they were summed; 70 of 80 wrong on an H200 with the old pinned buffer)."""
    from tests.support.device_double import concurrent_misses

    regions = caches.regions[:2]
    pages = np.arange(24)[::-1].copy()
    alone = [region_pages_digest(r, pages) for r in regions]
    assert alone[0] != alone[1]
    wrong = concurrent_misses(lambda i: region_pages_digest(regions[i], pages), alone)
    assert wrong == [], f"{len(wrong)} of 80 digests differed from the region's own"

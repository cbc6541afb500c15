"""Digests on the device (issue 28 item 2), with torch's CPU ops here (tests/gpu runs the same reader on CUDA): the
torch reader's digest equals the host reader's (numpy) for the same bytes, over random runs cut into slots of
any number of blocks, tails that end mid-word and runs that cross slot boundaries, and summed in parts; per-page
digests of a converted plan agree; two threads digesting through one reader get their own bytes. (The vLLM
suite, because the core's venv has no torch.)"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pd_common.layout.digest_words import BLOCK_BYTES, MASK, finish
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import suffix_pages
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.layout.slots import runs_between
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.flat import flat_span
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.digests import page_digests, plan_digests, region_pages_digest
from glm_pd_common.transport.memory import HOST
from glm_pd_common.transport.torch_memory import TorchMemory, reader_for
from tests.support.device_double import concurrent_misses

torch = pytest.importorskip("torch")

MEMORY = np.random.default_rng(11).integers(0, 256, 5 * BLOCK_BYTES + 3, dtype=np.uint8)
SPEC = CacheSpec.create(ModelGeometry.preset("glm-5.3"))


def test_torch_int64_multiply_and_sum_wrap_mod_2_64() -> None:
    """The definition relies on it (numpy's uint64 wraps by definition; torch's int64 in practice)."""
    big = torch.tensor([2**62 + 1, -(2**63), 3], dtype=torch.int64)
    assert (big * 4).tolist() == [4, 0, 12]
    assert torch.tensor([2**63 - 1, 2], dtype=torch.int64).sum().item() == -(2**63) + 1
    wide = torch.tensor([-1], dtype=torch.int32) * torch.tensor([2**63 - 1], dtype=torch.int64)
    assert wide.tolist() == [-(2**63 - 1)]  # int32 words are sign-extended, as numpy's copy to int64 does


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_torch_digests_equal_numpy_digests(data: st.DataObject) -> None:
    region = flat_span(MEMORY.ctypes.data, MEMORY.size)
    reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES * data.draw(st.integers(1, 3)))
    align = data.draw(st.sampled_from([1, 4096]))  # rows of one byte, or of 4 KiB (several slots per index upload)
    length = st.one_of(st.integers(0, 97), st.integers(0, 2 * BLOCK_BYTES // align))
    lengths = np.array(data.draw(st.lists(length, max_size=12)), dtype=np.int64) * align
    offsets = np.array(
        [data.draw(st.integers(0, (MEMORY.size - int(n)) // align)) * align for n in lengths], dtype=np.int64
    )
    assert reader.digest(region, offsets, lengths) == HOST.digest(region, offsets, lengths)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_torch_sums_of_a_streams_parts_add_up_to_its_numpy_digest(data: st.DataObject) -> None:
    """A staged read's landed slots are summed in parts from whole blocks (``LandedDigests``)."""
    region = flat_span(MEMORY.ctypes.data, MEMORY.size)
    reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES * data.draw(st.integers(1, 2)))
    lengths = np.array(data.draw(st.lists(st.integers(0, 2 * BLOCK_BYTES), min_size=1, max_size=6)), dtype=np.int64)
    offsets = np.array([data.draw(st.integers(0, MEMORY.size - int(n))) for n in lengths], dtype=np.int64)
    total = int(lengths.sum())
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, total // BLOCK_BYTES)), max_size=3))))
    bounds = [0, *(c * BLOCK_BYTES for c in cuts if c * BLOCK_BYTES < total), total]
    h = 0
    for first, last in itertools.pairwise(bounds):
        h = (h + reader.word_sum(region, *runs_between(offsets, lengths, first, last), first)) & MASK
    assert finish(h, total) == HOST.digest(region, offsets, lengths)


def test_a_changed_byte_changes_the_torch_digest() -> None:
    memory = MEMORY.copy()
    region = flat_span(memory.ctypes.data, memory.size)
    reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES)
    offsets, lengths = np.array([BLOCK_BYTES + 5, 0]), np.array([2 * BLOCK_BYTES, 1001])
    before = reader.digest(region, offsets, lengths)
    for at in (0, 1000, BLOCK_BYTES + 5, 2 * BLOCK_BYTES, 3 * BLOCK_BYTES + 4):
        memory[at] ^= 0x80
        assert reader.digest(region, offsets, lengths) != before, at
        memory[at] ^= 0x80
    assert reader.digest(region, offsets, lengths) == before


def test_plan_and_page_digests_of_a_converted_plan_agree() -> None:
    """A 64 -> 32-token plan: region and per-page digests through torch equal numpy's, on both sides."""
    src = HostCaches(SPEC, page_tokens=64, num_pages=12)
    dst = HostCaches(SPEC, page_tokens=32, num_pages=24)
    src.write_tokens(np.arange(12), 0, 12 * 64, seed=3)
    num_tokens, prefix = 700, 128
    src_pages = suffix_pages(np.arange(12), num_tokens, prefix, 64, align_tokens=32)
    dst_pages = suffix_pages(np.arange(22)[::-1].copy(), num_tokens, prefix, 32, align_tokens=32)
    plan = build_plan(src.regions, dst.regions, src_pages, dst_pages, num_tokens=num_tokens, prefix_tokens=prefix)
    reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES)
    assert plan_digests(plan, "src", reader) == plan_digests(plan, "src")
    assert plan_digests(plan, "dst", reader) == plan_digests(plan, "dst")
    for index in (0, len(plan.entries) - 1):
        assert page_digests(plan, index, "src", reader) == page_digests(plan, index, "src")


def test_two_threads_digesting_at_once_through_one_reader_get_their_own_bytes() -> None:
    """Each thread gathers into a scratch of its own: with one shared between lanes (the old pinned buffer),
    70 of 80 digests were wrong on an H200."""
    caches = HostCaches(SPEC, page_tokens=64, num_pages=24)
    caches.write_tokens(np.arange(24), 0, 24 * 64, seed=5)
    regions = caches.regions[:2]
    reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES)
    pages = np.arange(24)[::-1].copy()
    alone = [region_pages_digest(r, pages) for r in regions]
    assert alone[0] != alone[1]
    wrong = concurrent_misses(lambda i: region_pages_digest(regions[i], pages, reader), alone)
    assert wrong == [], f"{len(wrong)} of 80 digests differed from the region's own"


def test_the_adapters_reader_is_the_host_one_on_dram_and_torch_on_vram() -> None:
    host = flat_span(MEMORY.ctypes.data, MEMORY.size)
    assert reader_for([host, host], torch) is HOST
    assert isinstance(reader_for([host, flat_span(1 << 40, 4096, "VRAM", 0)], torch), TorchMemory)
    with pytest.raises(ValueError, match="multiple of"):
        TorchMemory(torch, scratch_bytes=BLOCK_BYTES + 4)

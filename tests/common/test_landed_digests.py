"""A staged read's digests taken as its slots land (``transport.digests.LandedDigests``): a stream summed in parts
from whole blocks adds up to its digest, for every reader; a plan's region digests taken over landings in any
increments, from two threads at once, equal the digests of the same bytes read after; and a staged load with
``verify_checksums`` sums its landed slots on the digest threads, still failing a corrupted load by name."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pd_common.layout.digest_words import BLOCK_BYTES, MASK, finish
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.slots import runs_between
from glm_pd_common.tools.flat import flat_span
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.digests import LandedDigests, plan_digests
from glm_pd_common.transport.memory import HOST, HostMemory, StagedMemory
from glm_pd_common.transport.staging import Mover
from tests.common.test_memory import HostCopier, as_vram
from tests.support.services import NUM_PAGES, PAGE_TOKENS, SEED, Decode, Prefill

SPACE = np.random.default_rng(3).integers(0, 256, 6 * BLOCK_BYTES + 7, dtype=np.uint8)


@st.composite
def runs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint-or-not runs over ``SPACE``, of any lengths (tails mid-word, empty runs)."""
    length = st.one_of(st.integers(0, 40), st.integers(0, 2 * BLOCK_BYTES))
    lengths = np.array(draw(st.lists(length, min_size=1, max_size=10)), dtype=np.int64)
    offsets = np.array([draw(st.integers(0, SPACE.size - int(n))) for n in lengths], dtype=np.int64)
    return offsets, lengths


@settings(max_examples=80, deadline=None)
@given(runs(), st.data())
def test_runs_between_hold_exactly_those_bytes_of_the_concatenation(case, data) -> None:
    offsets, lengths = case
    whole = np.concatenate([SPACE[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)])
    first = data.draw(st.integers(0, whole.size))
    last = data.draw(st.integers(first, whole.size))
    got_offsets, got_lengths = runs_between(offsets, lengths, first, last)
    assert (got_lengths > 0).all()
    got = [SPACE[o : o + n] for o, n in zip(got_offsets.tolist(), got_lengths.tolist(), strict=True)]
    assert np.array_equal(np.concatenate([np.zeros(0, np.uint8), *got]), whole[first:last])


@settings(max_examples=60, deadline=None)
@given(runs(), st.data(), st.sampled_from(["host", "staged"]))
def test_a_stream_summed_in_parts_from_whole_blocks_adds_up_to_its_digest(case, data, reader) -> None:
    offsets, lengths = case
    region = flat_span(SPACE.ctypes.data, SPACE.size)
    memory: HostMemory = HOST
    if reader == "staged":  # device memory copied to the host (a test double of the copy), a few KiB at a time
        memory, region = StagedMemory(HostCopier(), staging_bytes=4100), as_vram(region)
    total = int(lengths.sum())
    cuts = sorted(set(data.draw(st.lists(st.integers(0, total // BLOCK_BYTES), max_size=4))))
    bounds = [0, *(c * BLOCK_BYTES for c in cuts if 0 < c * BLOCK_BYTES < total), total]
    h = 0
    for first, last in itertools.pairwise(bounds):
        h = (h + memory.word_sum(region, *runs_between(offsets, lengths, first, last), first)) & MASK
    assert finish(h, total) == memory.digest(region, offsets, lengths) == HOST.digest(flat(region), offsets, lengths)


def flat(region: Region) -> Region:
    return flat_span(region.base_addr, region.size_bytes)


def test_a_part_that_starts_inside_a_block_is_refused() -> None:
    region = flat_span(SPACE.ctypes.data, SPACE.size)
    with pytest.raises(ValueError, match="whole blocks"):
        HOST.word_sum(region, np.array([0]), np.array([8]), 4)


@pytest.fixture
def plan_bytes(small_spec):
    """A plan between two shuffled host caches whose destination holds the source's bytes."""
    rng = np.random.default_rng(17)
    prefill = HostCaches(small_spec, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES)
    decode = HostCaches(small_spec, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES)
    src, dst = rng.permutation(NUM_PAGES), rng.permutation(NUM_PAGES)
    num_tokens = NUM_PAGES * PAGE_TOKENS - 5
    prefill.write_tokens(src, 0, num_tokens, seed=SEED)
    decode.write_tokens(dst, 0, num_tokens, seed=SEED)
    plan = build_plan(
        prefill.regions, decode.regions, src[1:], dst[1:], num_tokens=num_tokens, prefix_tokens=PAGE_TOKENS
    )
    return plan, decode, prefill  # the caches held while the plan's addresses are read


def test_digests_taken_as_bytes_land_equal_those_read_after(plan_bytes) -> None:
    plan, _, _ = plan_bytes
    total = plan.num_bytes
    assert total > 4 * BLOCK_BYTES  # several pairs summed in parts
    landed = LandedDigests(plan, HOST)
    steps = np.sort(np.random.default_rng(5).integers(0, total, 40))
    threads = [threading.Thread(target=lambda part=part: [landed.landed(int(n)) for n in part]) for part in
               (steps[0::2], steps[1::2])]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert landed.digests() == plan_digests(plan, "dst") == plan_digests(plan, "src")


def test_bytes_are_summed_once_they_land_and_the_rest_when_asked(plan_bytes) -> None:
    """What landed is read then (a later change to it goes unseen: it documents when the bytes were read); what
    had not landed is read by ``digests()``."""
    plan, decode, _ = plan_bytes
    before = plan_digests(plan, "dst")
    entry = next(e for e in plan.entries if e.lengths.sum() > 2 * BLOCK_BYTES)
    index = plan.entries.index(entry)
    start = sum(int(e.lengths.sum()) for e in plan.entries[:index])
    landed = LandedDigests(plan, HOST)
    landed.landed(start + BLOCK_BYTES)  # this pair's first block is in
    early, _ = runs_between(entry.dst_offsets, entry.lengths, 0, 1)
    late, _ = runs_between(entry.dst_offsets, entry.lengths, BLOCK_BYTES, BLOCK_BYTES + 1)
    for offset in (early, late):
        decode.flip(entry.dst, int(offset[0]))
    got = landed.digests()
    assert got[index] != before[index]  # the late byte's change is seen ...
    decode.flip(entry.dst, int(early[0]))
    assert got[index] == plan_digests(plan, "dst")[index]  # ... the early one's, made after it was read, is not
    decode.flip(entry.dst, int(early[0]))
    decode.flip(entry.dst, int(late[0]))
    assert LandedDigests(plan, HOST).digests()[index] != before[index]  # ... and the early one's, read now
    assert [g for i, g in enumerate(got) if i != index] == [b for i, b in enumerate(before) if i != index]


class ThreadNoting(HostMemory):
    """The host reader, noting the thread each part was summed on; ``summed_aside`` is set once a part was summed
    on a digest thread."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []
        self.summed_aside = threading.Event()

    def word_sum(self, region: Region, offsets: np.ndarray, lengths: np.ndarray, first_byte: int) -> int:
        name = threading.current_thread().name
        self.threads.append(name)
        try:
            return super().word_sum(region, offsets, lengths, first_byte)
        finally:
            if name.startswith("glm-pd-landed-"):
                self.summed_aside.set()


class GatedMover:
    """Prefill's mover (a test double around the real one): the gather of slot 2, which decode's read of slot 2
    waits for, waits (bounded) until decode summed a landed slot on a digest thread, so the premise (a sum taken
    while slots still move, not only after the read) holds however loaded the machine is. Slots are gathered in
    the order decode asks for them, so the third gather begun is slot 2's."""

    def __init__(self, mover: Mover, gate: threading.Event) -> None:
        self.mover, self.gate = mover, gate
        self.begun = 0
        self._lock = threading.Lock()

    def gather(self, addrs: np.ndarray, lengths: np.ndarray, into: int) -> None:
        with self._lock:
            k, self.begun = self.begun, self.begun + 1
        if k >= 2:
            self.gate.wait(30.0)
        self.mover.gather(addrs, lengths, into)

    def scatter(self, source: int, addrs: np.ndarray, lengths: np.ndarray) -> None:
        self.mover.scatter(source, addrs, lengths)


@pytest.mark.parametrize("fault", ["", "corrupt"])
def test_a_staged_verified_load_sums_landed_slots_on_digest_threads(small_spec, fault) -> None:
    memory = ThreadNoting()
    prefill = Prefill(small_spec, slot_bytes=2 * BLOCK_BYTES)
    decode = Decode(small_spec, slot_bytes=2 * BLOCK_BYTES, memory=memory)
    staging = prefill.local.staging
    assert staging is not None
    staging.mover = GatedMover(staging.mover, memory.summed_aside)
    try:
        num_tokens = NUM_PAGES * PAGE_TOKENS - 3
        result = decode.load(prefill, "r", num_tokens, fault=fault)
        assert result.staged_bytes and result.batches > 2, result
        assert any(name.startswith("glm-pd-landed-") for name in memory.threads), memory.threads
        if fault:  # a byte of the last slot changed after it landed: summed after the read, so seen
            assert not result.ok and "checksum mismatch" in result.reason, result
        else:
            assert result.ok, result.reason
            pages = np.arange(NUM_PAGES, dtype=np.int64)
            assert decode.caches.mismatched_tokens(pages, 0, num_tokens, seed=SEED) == []
    finally:
        decode.close()
        prefill.close()

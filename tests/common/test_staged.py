"""Staged transfers (``transport.staging``): runs gathered into slots, each slot moved as one descriptor and
scattered, byte-exact against the bytes posting them directly would move; the slot pairs always go back.

The movers are checked against plain slicing; the services run on real NIXL agents over host caches (staging
forced on: on DRAM ``auto`` posts directly). Hostile slot requests are refused naming what was wrong.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pd_common.handoff.decode.service import LoadJob
from glm_pd_common.handoff.prefill.staged import GatherDone, StagedReads
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.base import Span
from glm_pd_common.transport.staging import DIRECT_RUN_BYTES, HostMover, Staging, staged_runs, stages
from tests.support.services import NUM_PAGES, PAGE_TOKENS, SEED, Decode, Prefill, claim, rivals, wait_for

V = PROTOCOL_VERSION
SLOT = 8192


@st.composite
def runs(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A source buffer and disjoint runs in it, in a random order."""
    size = draw(st.integers(64, 4096))
    cuts = sorted(set(draw(st.lists(st.integers(1, size - 1), min_size=1, max_size=40))))
    pieces = list(zip([0, *cuts], [*cuts, size], strict=True))
    chosen = draw(st.permutations(pieces))[: draw(st.integers(1, len(pieces)))]
    data = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8).copy()
    return data, chosen


@settings(max_examples=60, deadline=None)
@given(runs())
def test_the_host_mover_gathers_and_scatters_runs_in_order(case) -> None:
    data, chosen = case
    out = np.zeros_like(data)
    slot = np.zeros(data.size, dtype=np.uint8)
    mover = HostMover([Span(n, a.ctypes.data, a.size) for n, a in (("src", data), ("dst", out), ("slot", slot))])
    addrs = np.array([data.ctypes.data + a for a, _ in chosen], dtype=np.int64)
    lengths = np.array([b - a for a, b in chosen], dtype=np.int64)
    mover.gather(addrs, lengths, slot.ctypes.data)
    expected = np.concatenate([data[a:b] for a, b in chosen])
    assert bytes(slot[: expected.size]) == bytes(expected)
    mover.scatter(slot.ctypes.data, addrs - data.ctypes.data + out.ctypes.data, lengths)
    for a, b in chosen:
        assert bytes(out[a:b]) == bytes(data[a:b])
    untouched = np.ones(data.size, dtype=bool)
    for a, b in chosen:
        untouched[a:b] = False
    assert not out[untouched].any()


def _plan(spec, src_pages, dst_pages, num_tokens, prefix_tokens=0):
    prefill = HostCaches(spec, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES)
    decode = HostCaches(spec, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES)
    return build_plan(
        prefill.regions,
        decode.regions,
        np.asarray(src_pages, dtype=np.int64),
        np.asarray(dst_pages, dtype=np.int64),
        num_tokens=num_tokens,
        prefix_tokens=prefix_tokens,
    )


def _bytes_of(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every byte address the runs cover, in run order."""
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))


@pytest.mark.parametrize("slot_bytes", [4096, 12288, 1 << 20])
def test_slots_map_every_source_byte_to_the_destination_byte_the_plan_names(small_spec, slot_bytes) -> None:
    plan = _plan(small_spec, [2, 9, 0], [7, 3, 4], 3 * PAGE_TOKENS + 10, PAGE_TOKENS)
    src, dst, lengths = plan.absolute_runs(list(plan.entries))
    cut = staged_runs(plan, slot_bytes)
    pieces = [(*cut.side(k, "src"), cut.side(k, "dst")[0]) for k in range(cut.num_slots)]
    assert all(int(n.sum()) <= slot_bytes for _, n, _ in pieces)
    assert all(int(n.sum()) == slot_bytes for _, n, _ in pieces[:-1])  # every slot full but the last
    got_src = np.concatenate([_bytes_of(s, n) for s, n, _ in pieces])
    got_dst = np.concatenate([_bytes_of(d, n) for _, n, d in pieces])
    assert np.array_equal(got_src, _bytes_of(src, lengths)) and np.array_equal(got_dst, _bytes_of(dst, lengths))


def test_auto_stages_only_short_runs_in_gpu_memory(small_spec) -> None:
    scattered = _plan(small_spec, [5, 2, 9, 0], [1, 7, 3, 4], 4 * PAGE_TOKENS)
    assert scattered.num_bytes < scattered.num_runs * DIRECT_RUN_BYTES  # pages of a few KB each
    assert stages(scattered, "auto", "VRAM") and not stages(scattered, "auto", "DRAM")
    assert stages(scattered, "always", "DRAM") and not stages(scattered, "never", "VRAM")
    empty = _plan(small_spec, [], [], PAGE_TOKENS, PAGE_TOKENS)
    assert not stages(empty, "always", "VRAM")


def _pairs_back(prefill: Prefill, *decodes: Decode) -> None:
    held = wait_for(prefill.service.leftovers, lambda h: h["staging_pairs"] == 0, 5.0)
    assert held["staging_pairs"] == 0
    for decode in decodes:
        assert decode.local.staging is not None and decode.local.staging.pairs.lent() == 0


def test_a_staged_load_lands_every_byte_and_gives_its_pairs_back(small_spec) -> None:
    prefill, decode = Prefill(small_spec, slot_bytes=SLOT), Decode(small_spec, slot_bytes=SLOT)
    try:
        num_tokens = 5 * PAGE_TOKENS + 17
        result = decode.load(prefill, "r", num_tokens)
        assert result.ok, result.reason
        moved = sum(result.bytes_by_kind.values())
        assert result.staged_bytes == moved > 0
        assert result.batches == -(-moved // SLOT)  # one descriptor per slot, every slot full but the last
        pages = np.arange(NUM_PAGES, dtype=np.int64)
        assert decode.caches.mismatched_tokens(pages, 0, num_tokens, seed=SEED) == []
        assert prefill.finished("r", 5.0).outcome == "released"
        _pairs_back(prefill, decode)
    finally:
        decode.close()
        prefill.close()


def test_a_decode_stages_only_with_a_prefill_that_does(small_spec) -> None:
    prefill, decode = Prefill(small_spec), Decode(small_spec, slot_bytes=SLOT)
    try:
        result = decode.load(prefill, "r", 3 * PAGE_TOKENS)
        assert result.ok and result.staged_bytes == 0 and sum(result.bytes_by_kind.values()) > 0
    finally:
        decode.close()
        prefill.close()


def test_reads_beyond_prefills_pairs_wait_for_one_and_all_land(small_spec) -> None:
    prefill = Prefill(small_spec, slot_bytes=SLOT, pairs=1)
    decodes = [Decode(small_spec, f"decode-{i}", slot_bytes=SLOT) for i in range(3)]
    try:
        pages = np.arange(NUM_PAGES, dtype=np.int64)
        n = 6 * PAGE_TOKENS
        for i, decode in enumerate(decodes):
            prefill.service.grant(f"r{i}", prefill.table[:6])
            decode.service.submit(LoadJob(f"r{i}", prefill.remote, prefill.table[:6], pages[:6], n, 0))
        results = [wait_for(d.service.results, bool, 30.0) for d in decodes]
        assert all(r and r[0].ok and r[0].staged_bytes for r in results), results
        for decode in decodes:
            assert decode.caches.mismatched_tokens(pages, 0, n, seed=SEED) == []
        _pairs_back(prefill, *decodes)
    finally:
        for decode in decodes:
            decode.close()
        prefill.close()


@pytest.mark.parametrize("fault", ["transport_error", "stall_mid:0.2"])
def test_a_staged_load_that_fails_mid_way_frees_everything(small_spec, fault) -> None:
    prefill = Prefill(small_spec, slot_bytes=SLOT, timeout_s=2.0)
    decode = Decode(small_spec, slot_bytes=SLOT, timeout_s=2.0)
    try:
        result = decode.load(prefill, "r", 6 * PAGE_TOKENS, fault=fault)
        if fault.startswith("stall"):  # a short stall between slots only delays the load
            assert result.ok, result.reason
        else:
            assert not result.ok and result.code == "transport", result
            assert prefill.finished("r", 5.0).outcome == "aborted"
        _pairs_back(prefill, decode)
        again = decode.load(prefill, "r2", 2 * PAGE_TOKENS)  # the next request stages as before
        assert again.ok and again.staged_bytes
    finally:
        decode.close()
        prefill.close()


def _refusal(client: SideChannelClient, code: str) -> str:
    reply = client.recv(10.0)
    assert isinstance(reply, protocol.Failed) and reply.code == code, reply
    return reply.reason


def test_slot_requests_outside_a_decodes_own_staged_claim_are_refused(small_spec) -> None:
    with rivals(small_spec, slot_bytes=SLOT, pairs=1) as (prefill, owner, other):
        table = prefill.table[:4]
        prefill.service.grant("r", table)
        too_big = _refusal_of(claim(owner, "r", table, 2 * SLOT), "invalid_params")
        assert f"slots of {2 * SLOT} B: this rank's slots hold {SLOT} B" in too_big
        assert prefill.service.leftovers()["leases"] == 1  # refused before the claim: nothing changed
        assert isinstance(claim(owner, "r", table, SLOT), protocol.Claimed)
        slots = -(-4 * sum(r.page_bytes for r in prefill.local.regions) // SLOT)
        owner.send(protocol.Gather(v=V, request_id="r", slot=slots))
        assert f"slot {slots} of a read of {slots} slots" in _refusal(owner, "invalid_params")
        other.send(protocol.Gather(v=V, request_id="r", slot=0))  # not its claim: nothing is gathered for it
        assert "no claimed lease or subscription of this decode" in _refusal(other, "lease_expired")
        for k in (0, 1, 1, 3):  # the second 1 again, then 3 before 2: each refused, naming the slot expected
            owner.send(protocol.Gather(v=V, request_id="r", slot=k))
        answers = [owner.recv(10.0) for _ in range(4)]
        assert [a.slot for a in answers if isinstance(a, protocol.Gathered)] == [0, 1]
        assert [a.reason for a in answers if isinstance(a, protocol.Failed)] == [
            f"slot {k} asked out of order: slots are asked once each, in order; next is 2" for k in (1, 3)
        ]
        owner.send(protocol.Done(v=V, request_id="r"))
        assert isinstance(owner.recv(10.0), protocol.Released)
        assert wait_for(prefill.service.leftovers, lambda h: h["staging_pairs"] == 0, 5.0)["staging_pairs"] == 0


def _refusal_of(reply: protocol.Message, code: str) -> str:
    assert isinstance(reply, protocol.Failed) and reply.code == code, reply
    return reply.reason


class _NoCopy:
    """A mover that copies nothing (the order of gathers is what the case is about)."""

    def gather(self, addrs: np.ndarray, lengths: np.ndarray, into: int) -> None:
        return None

    def scatter(self, source: int, addrs: np.ndarray, lengths: np.ndarray) -> None:
        return None


def test_a_read_holding_the_only_pair_goes_on_while_an_earlier_read_waits_for_it(small_spec) -> None:
    """Prefill's reads take pairs first come, first served, but one that holds a pair is never held up by one
    waiting for a pair (it would wait for the pair that read holds: a deadlock, seen 1 run in 6 before)."""
    plan = _plan(small_spec, [2, 9, 0], [7, 3, 4], 3 * PAGE_TOKENS)
    buffer = np.zeros(2 * SLOT, dtype=np.uint8)
    staging = Staging(Span("staging", buffer.ctypes.data, buffer.size), SLOT, _NoCopy(), "always")  # one pair
    finished: queue.SimpleQueue[GatherDone] = queue.SimpleQueue()
    reads = StagedReads(staging, "test", lambda: None, finished.put)
    try:
        reads.open(b"A", "a", plan, SLOT)  # A opened first, so it is first in line for a pair
        reads.open(b"B", "b", plan, SLOT)
        assert reads.ask(b"B", protocol.Gather(v=V, request_id="b", slot=0)) == ""  # B takes the pair
        assert reads.ask(b"A", protocol.Gather(v=V, request_id="a", slot=0)) == ""  # A waits for it
        first = finished.get(timeout=10)
        assert (first.ident, first.slot) == (b"B", 0) and isinstance(reads.done(first), protocol.Gathered)
        assert reads.ask(b"B", protocol.Gather(v=V, request_id="b", slot=1)) == ""
        second = finished.get(timeout=10)
        assert (second.ident, second.slot) == (b"B", 1)
        reads.done(second)
        reads.close("b")  # B's decode confirmed: A gets the pair
        assert finished.get(timeout=10).ident == b"A"
    finally:
        reads.shutdown()

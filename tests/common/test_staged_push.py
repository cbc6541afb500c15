"""Staged pushes' data plane (``handoff.staged_push``) between two real NIXL agents over host caches: every byte
lands where a direct push puts it, each slot's gather overlaps the previous slot's WRITE and decode's scatter of
the one before, and a push that fails leaves no WRITE in flight. The messages are the engine's (SGLang's:
tests/sglang); here ``Replies`` carries them in-process to a decode half that calls the same ``land_slot`` the
engine does."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from glm_pd_common.errors import ProtocolError, TransferFailed
from glm_pd_common.handoff import staged_push
from glm_pd_common.handoff.staged_push import land_slot, lent_slots, push_slots
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.tools.hostmem import HostCaches, host_staging
from glm_pd_common.transport.base import Span, Transfer, Transport, TransportConfig
from glm_pd_common.transport.factory import create_transport
from glm_pd_common.transport.staging import Staging, staged_runs

PAGE_TOKENS, NUM_PAGES, SEED = 64, 16, 11
SLOT = 8192
TIMEOUT_S = 10.0


@dataclass
class Rank:
    caches: HostCaches
    transport: Transport
    staging: Staging


def _rank(spec: Any, name: str) -> Rank:
    caches = HostCaches(spec, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES)
    transport = create_transport(name, TransportConfig(allow_tcp=True, timeout_s=TIMEOUT_S))
    transport.register(caches.regions)
    return Rank(caches, transport, host_staging(transport, caches.regions, slot_bytes=SLOT, pairs=1, mode="always"))


@pytest.fixture
def ranks(small_spec) -> Iterator[tuple[Rank, Rank, str]]:
    prefill, decode = _rank(small_spec, "push-prefill"), _rank(small_spec, "push-decode")
    spans = [Span(r.name, r.base_addr, r.size_bytes) for r in decode.caches.regions] + [decode.staging.span]
    peer = prefill.transport.add_peer(decode.transport.metadata(), spans)
    stop = threading.Event()
    progress = threading.Thread(target=_progress, args=(decode.transport, stop), daemon=True)
    progress.start()
    try:
        yield prefill, decode, peer
    finally:
        stop.set()
        progress.join()
        prefill.transport.close()
        decode.transport.close()


def _progress(transport: Transport, stop: threading.Event) -> None:
    """Decode's agent polled, as its engine's listener does: a peer's WRITE into it completes only meanwhile."""
    while not stop.wait(0.001):
        transport.notifs()


class Recorded:
    """Test double of a rank's transport and mover calls: the real ones, each call noted in ``events``."""

    def __init__(self, inner: Any, events: list[tuple[str, int]], slot_of: dict[int, int], clock: Clock) -> None:
        self.inner, self.events, self.slot_of, self.clock = inner, events, slot_of, clock
        self.waits: list[tuple[int, float]] = []  # (slot, the seconds its wait was given)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class RecordedTransport(Recorded):
    slots = 0  # the push's slots, once it returned

    def post(self, peer: str, op: Any, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, **kw: Any):
        xfer = self.inner.post(peer, op, local, remote, lengths, **kw)
        self.slot_of[id(xfer)] = len([e for e in self.events if e[0] == "post"])
        self.events.append(("post", self.slot_of[id(xfer)]))
        return xfer

    def wait(self, xfer: Transfer, timeout_s: float | None = None) -> None:
        self.waits.append((self.slot_of[id(xfer)], timeout_s or 0.0))
        self.inner.wait(xfer, timeout_s)
        self.events.append(("written", self.slot_of[id(xfer)]))

    def release(self, xfer: Transfer) -> None:
        if xfer.handle is not None:
            self.events.append(("release", self.slot_of[id(xfer)]))
        self.inner.release(xfer)


class RecordedMover(Recorded):
    def gather(self, addrs: np.ndarray, lengths: np.ndarray, into: int) -> None:
        self.events.append(("gather", len([e for e in self.events if e[0] == "gather"])))
        self.inner.gather(addrs, lengths, into)
        self.clock.now += self.clock.per_gather


@dataclass
class Clock:
    """Test double of ``staged_push``'s monotonic clock: it moves only as gathers run (``per_gather`` each)."""

    per_gather: float = 0.0
    now: float = 1000.0

    def monotonic(self) -> float:
        return self.now


@dataclass
class Replies:
    """Test double of the engine's wire: each landed slot goes at once to decode's ``land_slot``; ``refuse``
    names slots decode's answer refuses."""

    decode: Rank
    pages: np.ndarray
    events: list[tuple[str, int]]
    refuse: set[int] = field(default_factory=set)
    answers: dict[int, str] = field(default_factory=dict)

    def landed(self, k: int, last: bool, addrs: np.ndarray, lengths: np.ndarray) -> None:
        self.events.append(("landed", k))
        error = "refused by the test" if k in self.refuse else ""
        error = error or land_slot(self.decode.staging, self.decode.caches.regions, self.pages, 0, k, addrs, lengths)
        self.answers[k] = error

    def freed(self, k: int) -> None:
        self.events.append(("freed", k))
        if k not in self.answers:
            raise ProtocolError(f"slot {k} freed before it landed")
        if self.answers[k]:
            raise TransferFailed(self.answers[k])


def _push(
    prefill: Rank, decode: Rank, peer: str, replies: Replies, events: list, src, dst, clock: Clock | None = None
) -> RecordedTransport:
    tokens = src.size * PAGE_TOKENS
    plan = build_plan(prefill.caches.regions, decode.caches.regions, src, dst, num_tokens=tokens, prefix_tokens=0)
    runs = staged_runs(plan, SLOT)
    slot_of: dict[int, int] = {}
    clock = clock or Clock()
    transport = RecordedTransport(prefill.transport, events, slot_of, clock)
    mover = RecordedMover(prefill.staging.mover, events, slot_of, clock)
    mine = Staging(prefill.staging.span, SLOT, mover, "always")
    base, size = decode.staging.span.base_addr, decode.staging.span.size_bytes
    there = lent_slots([decode.staging.slot_offset(0, 0), decode.staging.slot_offset(0, 1)], base, size, SLOT)
    push_slots(transport, peer, mine, 0, there, runs, TIMEOUT_S, replies)  # type: ignore[arg-type]
    transport.slots = runs.num_slots
    return transport


def test_a_staged_push_lands_every_byte_and_overlaps_each_gather_with_the_moves_before_it(ranks) -> None:
    prefill, decode, peer = ranks
    src = np.random.default_rng(SEED).permutation(NUM_PAGES)[:10]
    dst = np.random.default_rng(SEED + 1).permutation(NUM_PAGES)[:10]
    prefill.caches.write_tokens(src, 0, src.size * PAGE_TOKENS, seed=SEED)
    events: list[tuple[str, int]] = []
    replies = Replies(decode, dst, events)
    slots = _push(prefill, decode, peer, replies, events, src, dst).slots
    assert slots >= 4, f"the case needs several slots per pair, got {slots}"
    assert decode.caches.mismatched_tokens(dst, 0, src.size * PAGE_TOKENS, seed=SEED) == []
    at = {e: i for i, e in enumerate(events)}
    for k in range(slots):
        assert at[("written", k)] < at[("landed", k)] < at[("freed", k)]
        if k >= 1:  # gathered while the previous slot's WRITE was in flight
            assert at[("post", k - 1)] < at[("gather", k)] < at[("written", k - 1)], events
        if k >= 2:  # gathered into its own slot once that slot's last WRITE was done, while decode scattered
            # slot k - 2; written into decode's slot only once decode freed it
            assert at[("written", k - 2)] < at[("gather", k)] < at[("freed", k - 2)] < at[("post", k)], events
    assert all(replies.answers[k] == "" for k in range(slots))


def test_each_write_is_given_up_on_timeout_s_after_its_post_not_after_its_wait_began(ranks, monkeypatch) -> None:
    """Decode rests a stopped push's pair for a bounded time: a WRITE waited for after the next slot's gather
    must not get a whole timeout_s more from there (the clock moves 3 s per gather, by construction)."""
    prefill, decode, peer = ranks
    clock = Clock(per_gather=3.0)
    monkeypatch.setattr(staged_push, "time", clock)
    src, dst = np.arange(10), np.arange(10)
    events: list[tuple[str, int]] = []
    pushed = _push(prefill, decode, peer, Replies(decode, dst, events), events, src, dst, clock)
    assert pushed.slots >= 3
    expected = [(k, TIMEOUT_S - 3.0) for k in range(pushed.slots - 1)] + [(pushed.slots - 1, TIMEOUT_S)]
    assert pushed.waits == expected  # the last slot's WRITE has no gather after its post


def test_a_refused_slot_fails_the_push_with_no_write_left_in_flight(ranks) -> None:
    prefill, decode, peer = ranks
    src, dst = np.arange(10), np.arange(10)
    events: list[tuple[str, int]] = []
    replies = Replies(decode, dst, events, refuse={1})
    with pytest.raises(TransferFailed, match="refused by the test"):
        _push(prefill, decode, peer, replies, events, src, dst)
    posted = {k for op, k in events if op == "post"}
    released = {k for op, k in events if op == "release"}
    assert posted == released == {0, 1, 2}, events  # slot 2 was in flight when slot 1's refusal was read
    assert events.index(("release", 2)) > events.index(("freed", 1)), events


def test_slots_outside_decodes_buffer_are_refused_before_a_byte_is_written() -> None:
    with pytest.raises(ProtocolError, match="outside its 65536 B buffer"):
        lent_slots([0, 65536 - SLOT + 1], 1 << 20, 65536, SLOT)
    with pytest.raises(ProtocolError):
        lent_slots([0], 1 << 20, 65536, SLOT)
    assert lent_slots([SLOT, 0], 1 << 20, 65536, SLOT) == ((1 << 20) + SLOT, 1 << 20)


def test_a_landed_slot_naming_pages_not_the_requests_is_refused_and_scatters_nothing(ranks) -> None:
    _, decode, _ = ranks
    region = decode.caches.regions[0]
    outside = region.base_addr + 5 * region.page_stride
    before = decode.caches.read_tokens(region, np.array([5]), np.arange(PAGE_TOKENS)).copy()
    staging, regions, at = decode.staging, decode.caches.regions, np.array([outside])
    refused = land_slot(staging, regions, np.array([2, 3]), 0, 0, at, np.array([64]))
    assert "does not lie in the request's pages" in refused
    assert f"for a {SLOT} B slot" in land_slot(staging, regions, np.array([5]), 0, 0, at, np.array([SLOT + 1]))
    assert (decode.caches.read_tokens(region, np.array([5]), np.arange(PAGE_TOKENS)) == before).all()

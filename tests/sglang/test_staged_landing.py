"""Decode's half of a staged push (glm_pd_sglang.staged.StagedLanding) against hostile or late slot messages.

``Landing`` below is a test double of the manager around the mixin: it holds what ``GlmPdKVManager`` would (host
caches, a staging buffer, the lock and maps) and records what it would send. The full path, both processes over
real transports, is tests/sglang/test_handoff.py's staged cases; these cases are the ones no honest prefill sends.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import numpy as np

from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.base import Span
from glm_pd_common.transport.staging import HostMover, Staging
from glm_pd_sglang import wire
from glm_pd_sglang.staged import StagedLanding

SLOT = 16384
PREFILL = ("10.0.0.9", 7000)


class Landing(StagedLanding):
    """Test double of the decode manager: one rank's host caches and a one-pair staging buffer."""

    def __init__(self, spec, *, timeout_s: float = 3600.0) -> None:
        self.caches = HostCaches(spec, page_tokens=64, num_pages=8)
        self.buffer = np.zeros(2 * SLOT, dtype=np.uint8)
        span = Span("staging", self.buffer.ctypes.data, self.buffer.size)
        spans = [*(Span(r.name, r.base_addr, r.size_bytes) for r in self.caches.regions), span]
        self.endpoint = SimpleNamespace(staging=Staging(span, SLOT, HostMover(spans), "always"))
        self.transport = SimpleNamespace(agent_name="decode-agent")
        self.glm_config = SimpleNamespace(timeout_s=timeout_s)
        self._lock = threading.Lock()
        self._room_pages, self._lent, self._resting = {}, {}, []
        self.sent: list[tuple[str, list[bytes]]] = []

    def _send_multipart_locked(self, endpoint: str, message: list[bytes]) -> None:
        self.sent.append((endpoint, message))

    def ask(self, room: int, rank: int = 0) -> wire.SlotLent:
        self._on_slot_ask(wire.SlotAsk(room, rank, *PREFILL))
        return msgspec.msgpack.decode(self.sent[-1][1][1], type=wire.SlotLent)

    def land(self, room: int, slot: int, addrs: list[int], lengths: list[int], *, last: bool = False) -> wire.SlotFree:
        count = len(self.sent)
        self._on_slot_landed(wire.SlotLanded(room, 0, slot, last, addrs, lengths))
        assert len(self.sent) == count + 1, "no answer"
        return msgspec.msgpack.decode(self.sent[-1][1][1], type=wire.SlotFree)


def test_a_pair_is_lent_once_per_room_and_rank_and_only_for_rooms_with_pages(small_spec) -> None:
    d = Landing(small_spec)
    assert d.ask(5).offsets == []  # no pages for room 5 here: push directly
    d._room_pages[5] = np.array([2, 3])
    assert d.ask(5).offsets == [0, SLOT]
    assert d.ask(5).offsets == []  # the same rank's push of it is still open
    assert d.ask(5, rank=1).offsets == []  # the only pair is lent
    assert d.sent[-1][0] == f"tcp://{PREFILL[0]}:{PREFILL[1]}"


def test_a_slot_lands_only_in_its_rooms_pages(small_spec) -> None:
    d = Landing(small_spec)
    d._room_pages[7] = np.array([2, 3])
    d.ask(7)
    region = d.caches.regions[0]
    d.buffer[:64] = np.arange(64, dtype=np.uint8) + 1
    outside = region.base_addr + 5 * region.page_stride  # page 5: not the room's
    refused = d.land(7, 0, [outside], [64])
    assert "does not lie in the request's pages" in refused.error
    view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 64).from_address(outside))
    assert not view.any(), "a refused slot wrote into another request's page"
    assert d._lent == {} and d.endpoint.staging.pairs.lent() == 1  # that push is over; its next WRITE may fly
    ((until, _),) = d._resting
    assert until - time.monotonic() > 1.5 * 3600, "rests less than twice timeout_s: prefill's WRITEs may outlive it"
    d._room_pages[8] = np.array([1])
    assert d.ask(8).offsets == [], "a refused push's pair was lent again while its next slot may still land"


def test_a_pair_refused_mid_push_is_lent_again_once_its_rest_is_over(small_spec) -> None:
    d = Landing(small_spec, timeout_s=0.0)
    d._room_pages[7] = d._room_pages[8] = np.array([2, 3])
    d.ask(7)
    outside = d.caches.regions[0].base_addr + 5 * d.caches.regions[0].page_stride
    assert d.land(7, 0, [outside], [64]).error
    assert d.ask(8).offsets == [0, SLOT]


def test_a_landed_slot_is_scattered_and_its_last_frees_the_pair(small_spec) -> None:
    d = Landing(small_spec)
    d._room_pages[8] = np.array([4])
    d.ask(8)
    region = d.caches.regions[1]
    target = region.base_addr + 4 * region.page_stride + 128
    d.buffer[:256] = np.arange(256, dtype=np.uint8)
    assert d.land(8, 0, [target, target + 512], [100, 156]).error == ""
    view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 668).from_address(target))
    assert bytes(view[:100]) == bytes(range(100)) and bytes(view[512:668]) == bytes(range(100, 256))
    assert d.endpoint.staging.pairs.lent() == 1
    assert d.land(8, 1, [target], [10], last=True).error == ""
    assert d.endpoint.staging.pairs.lent() == 0


def test_a_message_for_a_pair_lent_to_no_one_is_not_answered(small_spec) -> None:
    d = Landing(small_spec)
    d._room_pages[9] = np.array([1])
    d._on_slot_landed(wire.SlotLanded(9, 0, 0, True, [d.caches.regions[0].base_addr], [8]))
    assert d.sent == []


def test_a_pair_of_a_room_cleared_mid_push_rests_before_it_is_lent_again(small_spec) -> None:
    resting = Landing(small_spec)  # rests an hour
    resting._room_pages[1] = resting._room_pages[2] = np.array([1])
    assert resting.ask(1).offsets
    resting.release_room_slots(1)
    stop = msgspec.msgpack.decode(resting.sent[-1][1][1], type=wire.SlotFree)  # the push is told to stop
    assert (stop.room, resting.sent[-1][0]) == (
        1,
        f"tcp://{PREFILL[0]}:{PREFILL[1]}",
    ) and "ended the room" in stop.error
    assert resting.ask(2).offsets == [] and resting.endpoint.staging.pairs.lent() == 1
    rested = Landing(small_spec, timeout_s=0.0)  # its rest is over at once
    rested._room_pages[1] = rested._room_pages[2] = np.array([1])
    assert rested.ask(1).offsets
    rested.release_room_slots(1)
    assert rested.ask(2).offsets == [0, SLOT]

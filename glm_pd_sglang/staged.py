"""Staged pushes over SGLang's wire: the messages around ``handoff.staged_push`` (which gathers, writes and
scatters the slots).

Prefill asks the decode rank for a pair of its staging slots per room (``SlotAsk``); decode lends one if it has
one free (``SlotLent``), else none and prefill posts the runs directly. Prefill names where each written slot's
bytes go (``SlotLanded``); decode checks them against the room's own pages, scatters the slot on its listener
thread (never SGLang's scheduler thread) and answers ``SlotFree``. Prefill reports Success only once every slot
is scattered. Decode takes the pair back once the push's last slot is scattered; a room cleared mid-push (failed,
aborted), or a slot refused, leaves its pair resting first (``REST_TIMEOUTS`` of ``timeout_s``), so a write still
in flight from that push cannot land in another room's slot.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from sglang.srt.utils.network import NetworkAddress

from glm_pd_common.errors import ProtocolError, TransferFailed
from glm_pd_common.handoff.staged_push import REST_TIMEOUTS, land_slot, lent_slots, push_slots
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.transport.staging import Staging, staged_runs, stages
from glm_pd_sglang import wire
from glm_pd_sglang.rooms import Target

logger = logging.getLogger(__name__)

Reply = wire.SlotLent | wire.SlotFree


class Mailbox:
    """Decode's answers for the staged pushes prefill has open, by (room, decode agent); others are dropped, so a
    stranger cannot make prefill hold messages."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, str], queue.SimpleQueue[Reply]] = {}
        self._lock = threading.Lock()

    def open(self, room: int, agent: str) -> None:
        with self._lock:
            self._open[(room, agent)] = queue.SimpleQueue()

    def close(self, room: int, agent: str) -> None:
        with self._lock:
            self._open.pop((room, agent), None)

    def put(self, reply: Reply) -> None:
        with self._lock:
            box = self._open.get((reply.room, reply.agent_name))
        if box is not None:
            box.put(reply)

    def take(self, room: int, agent: str, timeout_s: float) -> Reply:
        with self._lock:
            box = self._open[(room, agent)]
        try:
            return box.get(timeout=timeout_s)
        except queue.Empty:
            raise TransferFailed(
                f"decode {agent} did not answer a staged slot of room {room} in {timeout_s:g} s"
            ) from None

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


class StagedPush:
    """Prefill's half (mixed into ``GlmPdKVManager`` beside ``PrefillTransfers``)."""

    endpoint: Any
    transport: Any
    glm_config: Any
    local_ip: str
    rank_port: int
    _slot_mail: Mailbox

    if TYPE_CHECKING:

        def _send_multipart_locked(self, endpoint: str, message: list[bytes]) -> None: ...
        def _prefill_unique_rank(self) -> int: ...
        def _add_stat(self, key: str, value: float) -> None: ...

    def _push_staged(self, room: int, t: Target, theirs: Any, plan: TransferPlan) -> bool:
        """Push ``plan`` to decode rank ``t`` through staging slots; False (nothing moved) where it cannot be staged:
        either rank has no buffer, the plan is one direct posting serves (``stages``), or no pair is free."""
        mine: Staging | None = self.endpoint.staging
        if mine is None or theirs is None or not stages(plan, mine.mode, plan.entries[0].src.mem_kind):
            return False
        pair = mine.pairs.take()
        if pair is None:
            return False
        address = NetworkAddress(t.endpoint, t.dst_port).to_tcp()
        timeout = self.glm_config.timeout_s
        self._slot_mail.open(room, t.agent_name)
        try:
            rank = self._prefill_unique_rank()
            ask = wire.SlotAsk(room, rank, self.local_ip, self.rank_port)
            self._send_multipart_locked(address, wire.frames(wire.TAG_SLOT_ASK, ask))
            lent = self._slot_mail.take(room, t.agent_name, timeout)
            if not isinstance(lent, wire.SlotLent) or not lent.offsets:
                return False  # decode has no pair free: direct
            slot_bytes = min(mine.slot_bytes, lent.slot_bytes)
            there = lent_slots(lent.offsets, theirs.base_addr, theirs.size_bytes, slot_bytes)
            runs = staged_runs(plan, slot_bytes)
            replies = _Replies(self, room, rank, t.agent_name, address, timeout)
            push_slots(self.transport, t.agent_name, mine, pair, there, runs, timeout, replies)
        finally:
            self._slot_mail.close(room, t.agent_name)
            mine.pairs.give(pair)
        for kind, n in plan.bytes_by_kind().items():
            self._add_stat(f"{kind}_bytes", n)
        for kind, n in plan.runs_by_kind().items():
            self._add_stat(f"{kind}_runs", n)
        self._add_stat("staged_bytes", plan.num_bytes)
        self._add_stat("slots", runs.num_slots)
        return True


@dataclass
class _Replies:
    """``staged_push.SlotReplies`` over SGLang's wire: ``SlotLanded`` out, decode's ``SlotFree`` from the mailbox."""

    push: StagedPush
    room: int
    rank: int
    agent: str
    address: str
    timeout_s: float

    def landed(self, k: int, last: bool, addrs: np.ndarray, lengths: np.ndarray) -> None:
        landed = wire.SlotLanded(self.room, self.rank, k, last, addrs.tolist(), lengths.tolist())
        self.push._send_multipart_locked(self.address, wire.frames(wire.TAG_SLOT_LANDED, landed))

    def freed(self, k: int) -> None:
        free = self.push._slot_mail.take(self.room, self.agent, self.timeout_s)
        if isinstance(free, wire.SlotFree) and free.error:
            why = f"decode {self.agent} refused staged slot {free.slot} of room {self.room}: {free.error}"
            raise TransferFailed(why)
        if not isinstance(free, wire.SlotFree) or free.slot != k:
            raise ProtocolError(f"decode {self.agent} answered {type(free).__name__} where slot {k} was to be freed")


@dataclass
class Lending:
    """A pair decode lent to one prefill rank's push of one room, and where that rank hears back."""

    pair: int
    reply_to: str


class StagedLanding:
    """Decode's half (mixed into ``GlmPdKVManager``): pairs lent per (room, prefill rank), scattered slots."""

    endpoint: Any
    caches: Any
    transport: Any
    glm_config: Any
    _lock: threading.Lock
    _room_pages: dict[int, np.ndarray]
    _lent: dict[tuple[int, int], Lending]
    _resting: list[tuple[float, int]]  # (monotonic time it may be lent again, pair)

    if TYPE_CHECKING:

        def _send_multipart_locked(self, endpoint: str, message: list[bytes]) -> None: ...

    def _on_slot_ask(self, ask: wire.SlotAsk) -> None:
        """Lend a pair to a prefill rank for a room this rank holds pages for; an empty answer makes it push
        directly (no staging here, none free, the room is not ours, or that rank's last push of it is not done)."""
        staging: Staging | None = self.endpoint.staging
        key = (ask.room, ask.prefill_rank)
        reply_to = NetworkAddress(ask.prefill_ip, ask.prefill_port).to_tcp()
        offsets: list[int] = []
        with self._lock:
            self._reclaim_rested(staging)
            if staging is not None and ask.room in self._room_pages and key not in self._lent:
                pair = staging.pairs.take()
                if pair is not None:
                    self._lent[key] = Lending(pair, reply_to)
                    offsets = [staging.slot_offset(pair, 0), staging.slot_offset(pair, 1)]
        lent = wire.SlotLent(ask.room, self.transport.agent_name, offsets, staging.slot_bytes if staging else 0)
        self._send_multipart_locked(reply_to, wire.frames(wire.TAG_SLOT_LENT, lent))

    def _on_slot_landed(self, landed: wire.SlotLanded) -> None:
        """Scatter a written slot into the room's pages, every run checked to lie in them first; answered to the
        rank the pair was lent to (a message naming another room or rank changes nothing and is not answered)."""
        staging: Staging | None = self.endpoint.staging
        key = (landed.room, landed.prefill_rank)
        with self._lock:
            lending = self._lent.get(key)
            pages = self._room_pages.get(landed.room)
        if staging is None or lending is None or pages is None:
            logger.error("glm-pd decode: staged slot for room %d, whose pair is not lent to that rank", landed.room)
            return
        addrs = np.asarray(landed.addrs, dtype=np.int64)
        lengths = np.asarray(landed.lengths, dtype=np.int64)
        error = land_slot(staging, self.caches.regions, pages, lending.pair, landed.slot, addrs, lengths)
        if error:
            logger.error("glm-pd decode: refused staged slot %d of room %d: %s", landed.slot, landed.room, error)
        if landed.last or error:  # that push writes no more
            with self._lock:
                if self._lent.get(key) is lending:
                    del self._lent[key]
                    if landed.last:
                        staging.pairs.give(lending.pair)
                    else:  # its next slot's WRITE may be in flight already: the pair rests, as a cleared room's
                        self._resting.append((self._rest_until(), lending.pair))
        free = wire.SlotFree(landed.room, self.transport.agent_name, landed.slot, error)
        self._send_multipart_locked(lending.reply_to, wire.frames(wire.TAG_SLOT_FREE, free))

    def release_room_slots(self, room: int) -> None:
        """The room is done here: its pages are forgotten, and a pair still lent for it rests before it is lent
        again (its push may have a write in flight); that push is told at once, so it stops instead of waiting
        for slots nobody will free."""
        with self._lock:
            self._room_pages.pop(room, None)
            rest_until = self._rest_until()
            stopped = [self._lent.pop(key) for key in [k for k in self._lent if k[0] == room]]
            self._resting += [(rest_until, lending.pair) for lending in stopped]
        for lending in stopped:
            free = wire.SlotFree(room, self.transport.agent_name, 0, "decode ended the room during the push")
            self._send_multipart_locked(lending.reply_to, wire.frames(wire.TAG_SLOT_FREE, free))

    def _rest_until(self) -> float:
        """When a pair whose push this rank stopped may be lent again (``staged_push.REST_TIMEOUTS``)."""
        return time.monotonic() + REST_TIMEOUTS * self.glm_config.timeout_s

    def _reclaim_rested(self, staging: Staging | None) -> None:
        """Pairs whose rest is over go back to the pool (under ``_lock``)."""
        now = time.monotonic()
        back = [pair for until, pair in self._resting if until <= now]
        self._resting[:] = [(until, pair) for until, pair in self._resting if until > now]
        for pair in back:
            if staging is not None:
                staging.pairs.give(pair)

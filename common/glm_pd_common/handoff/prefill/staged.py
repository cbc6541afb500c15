"""Prefill's side of staged reads: each claimant's plan (or a subscriber's span of a streamed transfer) cut
into slots, gathered on request into a pair of staging slots on threads of their own (on a GPU: one indexed copy
per slot, waited for), and handed back to the service thread to answer ``Gathered``.

Decode asks for slots 0 and 1, then for slot ``k + 2`` once it has read slot ``k``, so slot ``k`` reuses the
pair's slot ``k % 2`` and the gather of the next slot overlaps decode's read of this one. A read holds its pair
from its first gather until decode's confirmation (``Done``, or ``ReadDone`` for a streamed span) or the end of
its lease or transfer; reads that find no pair free wait in order. What one decode can make prefill do is bounded
by what it was granted: one read per claim (per transfer at a time), each slot asked once, in order (asking
ahead only overwrites the asker's own slots).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from glm_pd_common.errors import GlmPdError
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.transport.devices import ThreadSetup
from glm_pd_common.transport.staging import StagedRuns, Staging, staged_runs

GATHER_THREADS = 2  # slots gathered at once (one per read at a time)


@dataclass(frozen=True)
class GatherDone:
    """A gathered slot on its way back to the service thread (or why it failed)."""

    ident: bytes
    request_id: str
    slot: int
    offset: int
    error: str = ""


@dataclass
class _Read:
    runs: StagedRuns
    asked: deque[int] = field(default_factory=deque)
    next_slot: int = 0  # the slot decode may ask for next: each once, in order
    pair: int | None = None
    busy: bool = False  # a gather into the pair is running
    closed: bool = False  # its lease ended or decode confirmed: the pair goes back once no gather runs


class StagedReads:
    """The staged reads of one prefill rank; ``deliver`` takes each ``GatherDone`` (the service's inbox)."""

    def __init__(
        self, staging: Staging | None, name: str, on_thread: ThreadSetup, deliver: Callable[[GatherDone], None]
    ) -> None:
        self.staging = staging
        self._deliver = deliver
        self._reads: dict[tuple[str, bytes], _Read] = {}  # insertion order: reads waiting for a pair, first first
        self._pool = ThreadPoolExecutor(
            GATHER_THREADS, thread_name_prefix=f"glm-pd-gather-{name}", initializer=on_thread
        )

    def refusal(self, ident: bytes, request_id: str, slot_bytes: int) -> str:
        """Why a claim or stream read asking for slots of ``slot_bytes`` cannot be read staged ("" if it can)."""
        if self.staging is None:
            return "this prefill rank has no staging buffer: post the runs directly"
        if not 0 < slot_bytes <= self.staging.slot_bytes:
            return f"staged slots of {slot_bytes} B: this rank's slots hold {self.staging.slot_bytes} B"
        if (request_id, ident) in self._reads:
            return "this decode rank already reads this request staged"
        return ""

    def open(self, ident: bytes, request_id: str, plan: TransferPlan, slot_bytes: int) -> None:
        """Cut a claim's or stream read's plan into decode's slots (``refusal`` said it may)."""
        self._reads[(request_id, ident)] = _Read(staged_runs(plan, slot_bytes))

    def open_stream(
        self,
        ident: bytes,
        msg: protocol.StreamRead,
        pages: np.ndarray,
        ready_tokens: int,
        plan_of: Callable[[np.ndarray, protocol.StreamRead], TransferPlan],
    ) -> str:
        """Open a subscriber's read of a span of its transfer (``pages`` announced so far, ``ready_tokens``
        written): none past the tokens written, its plan the claim's rule over those pages (``plan_of`` raises
        naming what is off). Returns why not ("" when opened)."""
        why = self.refusal(ident, msg.request_id, msg.slot_bytes)
        if not why and msg.num_tokens > ready_tokens:
            why = f"tokens up to {msg.num_tokens} asked; prefill has written {ready_tokens}"
        if not why:
            try:
                self.open(ident, msg.request_id, plan_of(pages, msg), msg.slot_bytes)
            except GlmPdError as exc:
                why = str(exc)
        return why

    def ask(self, ident: bytes, msg: protocol.Gather) -> str:
        """Queue a slot decode asked for; returns why not ("" when queued)."""
        read = self._reads.get((msg.request_id, ident))
        if read is None or read.closed:
            return "no staged read of this request is open for this decode (its claim did not ask for slots)"
        if not msg.slot < read.runs.num_slots:
            return f"slot {msg.slot} of a read of {read.runs.num_slots} slots"
        if msg.slot != read.next_slot:
            return f"slot {msg.slot} asked out of order: slots are asked once each, in order; next is {read.next_slot}"
        read.next_slot += 1
        read.asked.append(msg.slot)
        self._pump()
        return ""

    def done(self, done: GatherDone) -> protocol.Gathered | protocol.Failed | None:
        """A gather finished: the answer to send, if its read is still open (a closed one gives its pair back)."""
        read = self._reads.get((done.request_id, done.ident))
        if read is None:
            return None
        read.busy = False
        if read.closed:
            self._drop(done.request_id, done.ident)
        self._pump()
        if read.closed:
            return None
        if done.error:
            self.close(done.request_id, done.ident)
            reason = protocol.clip(f"gathering slot {done.slot} failed: {done.error}")
            return protocol.Failed(v=PROTOCOL_VERSION, request_id=done.request_id, reason=reason, code="transport")
        return protocol.Gathered(v=PROTOCOL_VERSION, request_id=done.request_id, slot=done.slot, offset=done.offset)

    def close(self, request_id: str, ident: bytes | None = None) -> None:
        """End the reads of a lease or transfer (``ident``: that decode rank's only); pairs go back once no gather
        runs."""
        for key in [k for k in self._reads if k[0] == request_id and ident in (None, k[1])]:
            self._reads[key].closed = True
            if not self._reads[key].busy:
                self._drop(*key)
        self._pump()

    def drop_peer(self, ident: bytes) -> None:
        for request_id, _ in [k for k in self._reads if k[1] == ident]:
            self.close(request_id, ident)

    def held(self) -> int:
        """Slot pairs lent to reads now (what a leak check counts; thread-safe)."""
        return 0 if self.staging is None else self.staging.pairs.lent()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _drop(self, request_id: str, ident: bytes) -> None:
        read = self._reads.pop((request_id, ident))
        if read.pair is not None and self.staging is not None:
            self.staging.pairs.give(read.pair)

    def _pump(self) -> None:
        """Start the next gather of every open read that has a slot asked and none running, in arrival order. Reads
        holding a pair always go on (they free it); those without take one first come, first served."""
        staging = self.staging
        if staging is None:
            return
        waiting = False  # a read found no pair free: later reads without one wait behind it
        for (request_id, ident), read in self._reads.items():
            if read.busy or read.closed or not read.asked:
                continue
            if read.pair is None:
                read.pair = None if waiting else staging.pairs.take()
                if read.pair is None:
                    waiting = True
                    continue
            read.busy = True
            self._pool.submit(self._gather, staging, ident, request_id, read.runs, read.pair, read.asked.popleft())

    def _gather(self, staging: Staging, ident: bytes, request_id: str, runs: StagedRuns, pair: int, k: int) -> None:
        try:
            staging.mover.gather(*runs.side(k, "src"), staging.slot_addr(pair, k))
            done = GatherDone(ident, request_id, k, staging.slot_offset(pair, k))
        except Exception as exc:  # memory this rank cannot copy (or a bug): that read fails, nothing else
            done = GatherDone(ident, request_id, k, 0, repr(exc))
        self._deliver(done)

"""Prefill's streamed transfers: what each running request has written so far, and who is reading it.

A streamed request is known by the transfer id the router gave both legs. The engine's calls arrive here as
``StreamCall`` (opened, or ended) and ``Advance`` (a step's written tokens and the pages they are in), through
``take``. A step is announced once its ready event has completed, in step order (``announce_ready``: a later
step's event completes later, so a step never overtakes the one before). The lease comes when the request
finishes (``finish``). Decode ranks ``subscribe`` (the first one's decode engine owns the transfer: no other may
subscribe or abort it); each is sent the pages it has not been sent yet. Nothing here
touches a socket or blocks: the service thread owns this table, polls the events and sends the ``Progress`` and
``Failed`` messages it returns, so the order of every change is that thread's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from glm_pd_common.handoff.prefill.ready import ReadyEvent
from glm_pd_common.handoff.recent import RecentIds
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION


@dataclass(frozen=True)
class Advance:
    """One step's progress on a streamed transfer, announced once ``ready`` (if any) completes."""

    transfer_id: str
    new_pages: np.ndarray
    ready_tokens: int
    ready: ReadyEvent | None


@dataclass(frozen=True)
class StreamCall:
    """The engine opened (``num_tokens`` > 0) or ended (``why``) a streamed transfer."""

    transfer_id: str
    num_tokens: int = 0
    why: str = ""


@dataclass
class _Stream:
    num_tokens: int = 0  # the prompt's length once the engine announced it
    pages: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    ready_tokens: int = 0
    subscribers: dict[bytes, int] = field(default_factory=dict)  # identity -> pages sent to it
    lease_id: str = ""
    owner: str = ""  # the decode engine of its first subscriber: no other may subscribe or abort it
    deadline: float = float("inf")  # subscribed before the engine announced it: wait this long
    last_sent: float = 0.0  # real time: a keepalive answers decode's wait, which runs on real time


Outgoing = list[tuple[bytes, protocol.Message]]


class StreamTable:
    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float],
        keepalive_s: float = protocol.HEARTBEAT_S,
        on_end: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.timeout_s = timeout_s
        self._on_end = on_end  # a transfer ended (its staged reads end with it)
        self.keepalive_s = keepalive_s
        self._clock = clock  # the service's: a subscription waiting for the engine waits in its time
        self._streams: dict[str, _Stream] = {}
        self._leases: dict[str, str] = {}  # lease id -> transfer id
        # ended transfer ids and why, so a late subscriber or a late grant is answered at once
        self._ended = RecentIds()
        self._advancing: deque[Advance] = deque()  # in step order: a step's progress waits for its event

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._streams

    def take(self, call: StreamCall | Advance) -> Outgoing:
        """An engine call, in the order the engine made it."""
        if isinstance(call, Advance):
            self._advancing.append(call)
            return []
        if call.why:
            return self.end(call.transfer_id, f"prefill ended the request: {call.why}")
        return self.open(call.transfer_id, call.num_tokens)

    def announce_ready(self) -> Outgoing:
        """Announce the steps whose writes have completed, in step order; a step whose event failed ends its
        transfer (what it wrote cannot be trusted)."""
        out: Outgoing = []
        while self._advancing:
            head = self._advancing[0]
            try:
                if head.ready is not None and not head.ready.query():
                    break
            except Exception as exc:  # a device error
                out += self.end(head.transfer_id, f"its step's ready event failed: {exc!r}")
                continue
            self._advancing.popleft()
            out += self.advance(head.transfer_id, head.new_pages, head.ready_tokens)
        return out

    def lease_of(self, transfer_id: str) -> str:
        stream = self._streams.get(transfer_id)
        return stream.lease_id if stream is not None else ""

    def open(self, transfer_id: str, num_tokens: int) -> Outgoing:
        """The engine has the request: subscribers wait for it as long as it runs."""
        if transfer_id in self._ended:
            return []
        stream = self._streams.setdefault(transfer_id, _Stream())
        stream.num_tokens, stream.deadline = num_tokens, float("inf")
        return self._send(transfer_id, stream)

    def advance(self, transfer_id: str, new_pages: np.ndarray, ready_tokens: int) -> Outgoing:
        """A step finished writing: the first ``ready_tokens`` tokens are in the table extended by ``new_pages``."""
        stream = self._streams.get(transfer_id)
        if stream is None or stream.lease_id:
            return []
        stream.pages = np.concatenate([stream.pages, np.asarray(new_pages, dtype=np.int64)])
        stream.ready_tokens = max(stream.ready_tokens, ready_tokens)
        return self._send(transfer_id, stream)

    def finish(self, transfer_id: str, lease_id: str, pages: np.ndarray, num_tokens: int) -> tuple[bool, Outgoing]:
        """The request finished and its pages are leased (and final): tell every subscriber the lease. False when
        the transfer already ended (decode gave up on it): the lease should end now."""
        if transfer_id in self._ended:
            return False, []
        stream = self._streams.setdefault(transfer_id, _Stream())
        stream.lease_id, stream.pages = lease_id, np.asarray(pages, dtype=np.int64)
        stream.num_tokens = stream.ready_tokens = num_tokens
        stream.deadline = float("inf")
        self._leases[lease_id] = transfer_id
        stream.subscribers = dict.fromkeys(stream.subscribers, 0)  # the whole table goes with the lease
        return True, self._send(transfer_id, stream)

    def owned(self, transfer_id: str, decode_engine: str) -> bool:
        """Whether ``decode_engine`` may act on this transfer (no other decode subscribed to it first)."""
        stream = self._streams.get(transfer_id)
        return stream is None or not stream.owner or stream.owner == decode_engine

    def subscribe(self, ident: bytes, msg: protocol.Subscribe, decode_engine: str) -> Outgoing:
        if msg.request_id in self._ended:
            return [(ident, _failed(msg.request_id, f"the transfer already ended: {self._ended.get(msg.request_id)}"))]
        if not self.owned(msg.request_id, decode_engine):
            why = "another decode subscribed to this transfer: it belongs to that decode"
            return [(ident, _failed(msg.request_id, why, "refused_peer"))]
        stream = self._streams.get(msg.request_id)
        if stream is None:  # decode's leg beat prefill's: wait for the engine a while
            stream = self._streams[msg.request_id] = _Stream(deadline=self._clock() + self.timeout_s)
        stream.owner = decode_engine
        stream.subscribers[ident] = 0
        return self._send(msg.request_id, stream, only=ident)

    def end(self, transfer_id: str, why: str) -> Outgoing:
        """The transfer cannot complete (prefill aborted or preempted the request, or decode gave up): every
        subscriber is told; a later grant or subscription is refused. Returns the messages."""
        stream = self._streams.pop(transfer_id, None)
        self._remember(transfer_id, why)
        self._advancing = deque(a for a in self._advancing if a.transfer_id != transfer_id)
        if stream is None:
            return []
        self._leases.pop(stream.lease_id, None)
        return [(ident, _failed(transfer_id, why)) for ident in stream.subscribers]

    def lease_ended(self, lease_id: str) -> None:
        """The lease was released, aborted or expired: the transfer is over."""
        transfer_id = self._leases.pop(lease_id, None)
        if transfer_id is not None:
            self._streams.pop(transfer_id, None)
            self._remember(transfer_id, "its lease ended")

    def readable(self, ident: bytes, transfer_id: str) -> tuple[np.ndarray, int] | None:
        """A subscriber's view of a running transfer: the pages announced (the whole table once leased) and the
        tokens written in them; None unless ``ident`` subscribed to it."""
        stream = self._streams.get(transfer_id)
        if stream is None or ident not in stream.subscribers:
            return None
        return stream.pages, stream.ready_tokens

    def subscriptions(self) -> int:
        return sum(len(stream.subscribers) for stream in self._streams.values())

    def subscribed(self, ident: bytes, transfer_id: str) -> bool:
        stream = self._streams.get(transfer_id)
        return stream is not None and ident in stream.subscribers

    def drop_subscriber(self, ident: bytes) -> None:
        for stream in self._streams.values():
            stream.subscribers.pop(ident, None)

    def tick(self) -> Outgoing:
        """Fail subscriptions the engine never announced in time (service time); keep quiet subscribers' waits
        alive (real time: after time away the keepalive is due at once, as decode's wait kept running)."""
        now, real = self._clock(), time.monotonic()
        out: Outgoing = []
        for transfer_id in [t for t, s in self._streams.items() if s.deadline < now]:
            out += self.end(transfer_id, "prefill has no request for this transfer id (it never arrived there)")
        for transfer_id, stream in self._streams.items():
            if stream.subscribers and real - stream.last_sent >= self.keepalive_s:
                out += self._send(transfer_id, stream)
        return out

    def _send(self, transfer_id: str, stream: _Stream, only: bytes | None = None) -> Outgoing:
        """Each subscriber gets the pages it was not sent yet (none, as a keepalive, when it has them all)."""
        out: Outgoing = []
        idents = [only] if only is not None else list(stream.subscribers)
        for ident in idents:
            first = stream.subscribers[ident]
            msg = protocol.Progress(
                v=PROTOCOL_VERSION,
                request_id=transfer_id,
                num_tokens=stream.num_tokens,
                ready_tokens=stream.ready_tokens,
                first_page=first,
                pages=stream.pages[first:].tolist(),
                lease_id=stream.lease_id,
            )
            stream.subscribers[ident] = int(stream.pages.size)
            out.append((ident, msg))
        stream.last_sent = time.monotonic()
        return out

    def _remember(self, transfer_id: str, why: str) -> None:
        self._ended.add(transfer_id, why)
        self._on_end(transfer_id)


def _failed(transfer_id: str, why: str, code: protocol.FailureCode = "aborted") -> protocol.Failed:
    return protocol.Failed(v=PROTOCOL_VERSION, request_id=transfer_id, reason=protocol.clip(why), code=code)

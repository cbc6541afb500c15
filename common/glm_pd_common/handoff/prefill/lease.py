"""Prefill's leases: one record per lease, its state, and everything that moves it. Read this file to know what
a lease can be and why it changes.

The rule that keeps freed pages from ever being served: decode may count a pull as good only when prefill confirms
that the pages were still held when the read finished. Prefill answers that confirmation from this table:
``release`` raises for a lease that expired (its pages may already hold other data), and decode must then fail or
recompute the request.

A lease belongs to one decode engine: the first to claim or renew it once granted (its id, unguessable, reached that
decode alone through the router); any other decode's message for it is refused and moves nothing.

States (``LeaseState``) and what moves them:

    AWAITED  -- engine grant ------------------> UNREADY (the GPU may still write the pages) or HELD
    UNREADY  -- its ready event completes -----> HELD (the lease clock starts now)
    HELD     -- a decode rank claims it -------> CLAIMED
    any      -- abort, or a second grant ------> ENDED (aborted)
    UNREADY  -- event fails / not done in ttl -> ENDED (aborted / expired)
    HELD, CLAIMED -- last confirmation --------> ENDED (released)
    HELD, CLAIMED -- past its expiry ----------> ENDED (expired)
    AWAITED  -- its last waiting message's bound passes, or its decode is forgotten: dropped (it was never a lease)

AWAITED: decode asked (a claim, or a release-only decode's confirmation) before the engine handed the finished
request over; its messages wait in the record, each with its own bound, and are answered once the pages are held.
UNREADY: granted, but no claim is answered (``Claimed`` is what lets decode read) and no lease clock runs until the
GPU work writing the pages has completed; messages wait as in AWAITED. HELD: the clock runs ``ttl_s``; decode
renews it while its request waits for blocks (each renewal holds the pages one more ttl from then; a renewal never
revives an expired lease). CLAIMED: held at least ``transfer_ttl_s`` from the claim; renewals no longer extend it.
An ENDED lease leaves the table; how it ended is remembered a while (``ended``), so a late claim fails at once.

Every time here is the service clock's (``clock``): it stands still while the service thread is away.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

import numpy as np

from glm_pd_common.errors import LeaseExpired
from glm_pd_common.handoff.prefill.ready import ReadyEvent
from glm_pd_common.handoff.recent import RecentIds
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.layout.plan import TransferPlan

Waiting = Union[protocol.TransferRequest, protocol.Done]  # what decode may send before the pages are held


@dataclass(frozen=True)
class Finished:
    """A request whose prefill pages may be freed, and why (what the service hands the engine)."""

    request_id: str
    outcome: str  # released | aborted | expired
    detail: str = ""


@dataclass(frozen=True)
class Grant:
    """The engine's grant of a finished request's pages, on its way to the service thread."""

    lease_id: str
    pages: np.ndarray
    ready: ReadyEvent | None
    stream: tuple[str, int] | None  # a streamed request's (transfer id, prompt tokens)


class LeaseState(enum.Enum):
    AWAITED = "awaited"
    UNREADY = "unready"
    HELD = "held"
    CLAIMED = "claimed"
    ENDED = "ended"


_ALLOWED = {
    LeaseState.AWAITED: {LeaseState.UNREADY, LeaseState.HELD, LeaseState.ENDED},
    LeaseState.UNREADY: {LeaseState.HELD, LeaseState.ENDED},
    LeaseState.HELD: {LeaseState.CLAIMED, LeaseState.ENDED},
    LeaseState.CLAIMED: {LeaseState.ENDED},
    LeaseState.ENDED: set(),
}
_LIVE = (LeaseState.HELD, LeaseState.CLAIMED)  # the pages are held and the lease clock runs


class IllegalTransition(RuntimeError):
    """A bug in the service, never a peer's doing: it names the lease and both states."""


@dataclass
class Lease:
    request_id: str  # the lease id: prefill's request id (a streamed request's is its own, not the transfer id)
    state: LeaseState = LeaseState.AWAITED
    pages: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    expires_at: float = float("inf")  # HELD/CLAIMED: the lease's end; UNREADY: when an unready grant gives up
    ready: ReadyEvent | None = None  # UNREADY: completes once the GPU wrote the pages
    stream: tuple[str, int] | None = None  # a streamed request's (transfer id, prompt tokens)
    waiting: dict[bytes, tuple[Waiting, float]] = field(default_factory=dict)  # identity -> its message, bound
    claimants: set[bytes] = field(default_factory=set)  # side-channel identities of the decode ranks reading
    plans: dict[bytes, TransferPlan] = field(default_factory=dict)  # per claimant, for its digest queries
    releases_left: int = 1  # decode ranks that still have to confirm (TP fan-out)
    expectation_set: bool = False
    owner: str = ""  # the decode engine it was granted to: the first to claim or renew it (``may_act``)

    def move(self, to: LeaseState) -> None:
        if to not in _ALLOWED[self.state]:
            raise IllegalTransition(f"lease {self.request_id}: illegal transition {self.state.name} -> {to.name}")
        self.state = to


class LeaseTable:
    """The leases of one prefill rank, by id, timed by ``clock`` (tests inject one to test expiry without
    sleeping). Not thread-safe: the service thread owns it."""

    def __init__(self, ttl_s: float, transfer_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.transfer_ttl_s = transfer_ttl_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        # the AWAITED and UNREADY ones again: what each turn polls for readiness and waiting bounds, without a
        # pass over every held lease
        self._unheld: dict[str, Lease] = {}
        self.ended = RecentIds()  # ended lease ids -> how (released, aborted, expired)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def held(self, request_id: str) -> Lease | None:
        """The lease if its pages are held for decode (HELD or CLAIMED, expired or not)."""
        lease = self._leases.get(request_id)
        return lease if lease is not None and lease.state in _LIVE else None

    def count(self, *states: LeaseState) -> int:
        return sum(lease.state in states for lease in self._leases.values())

    # -- the engine's side ------------------------------------------------------------------------
    def grant(
        self,
        request_id: str,
        pages: np.ndarray,
        releases: int = 1,
        *,
        ready: ReadyEvent | None = None,
        stream: tuple[str, int] | None = None,
    ) -> Lease:
        """The engine hands over a finished request's pages: held now, or once ``ready`` completes (``hold``
        starts the clock). Messages that came first stay waiting (``take_waiting``). A second grant of a live id
        is refused."""
        lease = self._leases.get(request_id)
        if lease is not None and lease.state is not LeaseState.AWAITED:
            raise ValueError(f"request {request_id} already holds a lease")
        self.ended.discard(request_id)  # an id used again after its earlier lease ended
        if lease is None:
            lease = Lease(request_id)
        lease.pages, lease.releases_left, lease.stream = np.asarray(pages, dtype=np.int64), releases, stream
        self._leases[request_id] = self._unheld[request_id] = lease
        if ready is None:
            self.hold(lease)
        else:
            lease.move(LeaseState.UNREADY)
            lease.ready, lease.expires_at = ready, self._clock() + self.ttl_s
        return lease

    def hold(self, lease: Lease) -> None:
        """The pages are final: the lease clock starts now (what waited is then ``take_waiting``'s to answer)."""
        lease.move(LeaseState.HELD)
        del self._unheld[lease.request_id]
        lease.ready, lease.expires_at = None, self._clock() + self.ttl_s

    @staticmethod
    def take_waiting(lease: Lease) -> list[tuple[bytes, Waiting]]:
        """The messages that waited for the pages, in arrival order, to answer now that they are held."""
        waiting = [(ident, msg) for ident, (msg, _) in lease.waiting.items()]
        lease.waiting.clear()
        return waiting

    def poll_ready(self) -> tuple[list[Lease], list[tuple[Lease, str, str]]]:
        """Unready grants whose event completed (to ``hold``), and those that end: (lease, outcome, why). Polled
        once per service turn, never blocked on: a hung GPU must not hold pages forever, and pages whose event
        failed cannot be trusted."""
        now = self._clock()
        ready: list[Lease] = []
        ended: list[tuple[Lease, str, str]] = []
        for lease in [x for x in self._unheld.values() if x.state is LeaseState.UNREADY]:
            assert lease.ready is not None
            try:
                done = lease.ready.query()
            except Exception as exc:  # a device error
                ended.append((lease, "aborted", f"its ready event failed: {exc!r}"))
                continue
            if done:
                ready.append(lease)
            elif now > lease.expires_at:
                why = "its pages were not ready (the GPU work writing them had not finished) within a lease"
                ended.append((lease, "expired", why))
        return ready, ended

    # -- decode's side ----------------------------------------------------------------------------
    def wait(self, request_id: str, ident: bytes, msg: Waiting, bound_s: float) -> None:
        """Decode asked before the pages are held: keep its (first) message ``bound_s`` at most."""
        lease = self._leases.get(request_id)
        if lease is None:
            lease = self._leases[request_id] = self._unheld[request_id] = Lease(request_id)
        lease.waiting.setdefault(ident, (msg, self._clock() + bound_s))

    def waiting_load(self, ident: bytes) -> tuple[int, int]:
        """(messages ``ident`` keeps waiting, page ids every waiting claim holds): what prefill's caps bound."""
        mine = pages = 0
        for lease in self._unheld.values():
            for who, (msg, _) in lease.waiting.items():
                mine += who == ident
                if isinstance(msg, protocol.TransferRequest):
                    pages += len(msg.src_pages) + len(msg.dst_pages)
        return mine, pages

    def may_act(self, request_id: str, decode_engine: str) -> bool:
        """Whether ``decode_engine`` may act on this lease: any decode until one claimed or renewed it (its id
        reached that decode alone, through the router), that decode only from then on."""
        lease = self._leases.get(request_id)
        return lease is None or not lease.owner or lease.owner == decode_engine

    def claimed_by(self, request_id: str, ident: bytes) -> bool:
        """Whether decode rank ``ident`` claimed this live lease (and may read it)."""
        lease = self._leases.get(request_id)
        return lease is not None and lease.state is LeaseState.CLAIMED and ident in lease.claimants

    def expect(self, request_id: str, releases: int) -> None:
        """Set how many decode ranks will confirm, once (the first decode rank to speak knows the TP shape)."""
        lease = self._leases.get(request_id)
        if lease is not None and not lease.expectation_set:
            lease.releases_left, lease.expectation_set = releases, True

    def claim(self, request_id: str, by: bytes = b"", owner: str = "") -> Lease:
        """Decode (rank ``by`` of engine ``owner``) is about to read: extend the hold to cover the transfer, or
        refuse an expired lease."""
        lease = self._live(request_id)
        if lease.state is LeaseState.HELD:
            lease.move(LeaseState.CLAIMED)
        lease.claimants.add(by)
        lease.owner = lease.owner or owner
        lease.expires_at = max(lease.expires_at, self._clock() + self.transfer_ttl_s)
        return lease

    def renew(self, request_id: str, owner: str = "") -> bool:
        """Decode (engine ``owner``) still waits to claim: hold the pages ``ttl_s`` from now (never shorter than
        they were held). False for a claimed lease (the claim's hold governs); ``LeaseExpired`` for an unknown or
        expired one."""
        lease = self._live(request_id)
        lease.owner = lease.owner or owner
        if lease.state is LeaseState.CLAIMED:
            return False
        lease.expires_at = max(lease.expires_at, self._clock() + self.ttl_s)
        return True

    def release(self, request_id: str) -> Lease | None:
        """A decode rank confirms its read; raises ``LeaseExpired`` if the pages were not held to now. Returns the
        lease, ended, once the last expected confirmation arrives (the caller frees its pages), else None."""
        lease = self._live(request_id)
        lease.releases_left -= 1
        return self.end(request_id, "released") if lease.releases_left <= 0 else None

    def end(self, request_id: str, outcome: str) -> Lease | None:
        """End a lease whatever its state (released, aborted, expired): off the table, remembered as ``outcome``.
        An AWAITED record was never a lease: it is dropped, not remembered. None if unknown."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return None
        self._unheld.pop(request_id, None)
        if lease.state is not LeaseState.AWAITED:
            self.ended.add(request_id, outcome)
        lease.move(LeaseState.ENDED)
        return lease

    def expire(self) -> list[Lease]:
        """End and return every held lease past its expiry (the caller frees their pages)."""
        now = self._clock()
        gone = [x.request_id for x in self._leases.values() if x.state in _LIVE and x.expires_at <= now]
        return [lease for request_id in gone if (lease := self.end(request_id, "expired")) is not None]

    def expire_waiting(self) -> list[tuple[str, bytes]]:
        """(lease id, identity) of messages past their bound on leases never granted (an unready grant's wait for
        it); a record left with none is dropped."""
        now = self._clock()
        out = []
        for lease in [x for x in self._unheld.values() if x.state is LeaseState.AWAITED]:
            for ident in [i for i, (_, bound) in lease.waiting.items() if bound < now]:
                del lease.waiting[ident]
                out.append((lease.request_id, ident))
            if not lease.waiting:
                self.end(lease.request_id, "")
        return out

    def keep_plan(self, request_id: str, ident: bytes, plan: TransferPlan) -> None:
        lease = self._leases.get(request_id)
        if lease is not None:
            lease.plans[ident] = plan

    def plan(self, request_id: str, ident: bytes) -> TransferPlan | None:
        lease = self._leases.get(request_id)
        return None if lease is None else lease.plans.get(ident)

    def awaiting_answer(self) -> set[bytes]:
        """Every decode identity that holds a claim on a lease now, or waits for one."""
        out: set[bytes] = set()
        for lease in self._leases.values():
            out |= lease.claimants | lease.waiting.keys()
        return out

    def withdraw(self, request_id: str, ident: bytes) -> None:
        """``ident`` no longer waits for a lease not granted yet (its own message only: others' stay)."""
        lease = self._leases.get(request_id)
        if lease is not None and lease.state is LeaseState.AWAITED:
            lease.waiting.pop(ident, None)
            if not lease.waiting:
                self.end(request_id, "")

    def forget_peer(self, ident: bytes) -> None:
        """A decode peer is gone: what waited or was planned for it goes (its claims stay: the lease expires)."""
        for lease in list(self._leases.values()):
            lease.waiting.pop(ident, None)
            lease.plans.pop(ident, None)
            if lease.state is LeaseState.AWAITED and not lease.waiting:
                self.end(lease.request_id, "")

    def leftovers(self) -> dict[str, int]:
        """What is held now, by kind (every count is 0 once every request has ended)."""
        return {
            "leases": self.count(*_LIVE),
            "unready": self.count(LeaseState.UNREADY),
            "early_claims": sum(len(x.waiting) for x in self._leases.values()),
            "plans": sum(len(x.plans) for x in self._leases.values()),
        }

    def _live(self, request_id: str) -> Lease:
        lease = self.held(request_id)
        if lease is None:
            raise LeaseExpired(f"request {request_id}: no lease held (expired, released or never granted)")
        if lease.expires_at <= self._clock():
            # Left in the table: ``expire`` hands it to the caller, who frees its pages.
            raise LeaseExpired(f"request {request_id}: lease expired {self._clock() - lease.expires_at:.3f} s ago")
        return lease

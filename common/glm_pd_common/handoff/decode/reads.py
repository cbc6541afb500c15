"""How one load's bytes are read from its sources and counted: direct batches of runs, or staged slots.

A direct source is posted as two batches, the first layer's and the rest: each batch costs a post and a
completion to poll, and nothing on decode uses a layer before the whole load is in (79 per-layer batches reached
78 % of one batch's rate, ``benchmarks/posting_bench.py``); the first batch stays apart, so a fault injected
``mid_transfer`` acts between two batches (staged: between two slots). A staged source is read slot by slot
(``staged``); with digests on, each slot that landed is summed on a digest thread while the next ones move
(``LandedDigests``), so decode's check after the read sums only the last slot (a direct read lands all at once:
its digests follow it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from glm_pd_common.handoff.decode.links import PrefillLink, PrefillLinks
from glm_pd_common.handoff.decode.loads import LoadJob, LoadResult
from glm_pd_common.handoff.decode.staged import read_staged
from glm_pd_common.handoff.faults import FaultPoint
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import Endpoint
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.transport.base import Transfer, Transport
from glm_pd_common.transport.devices import ThreadSetup
from glm_pd_common.transport.digests import LandedDigests

DIGEST_THREADS = 2  # staged reads' landed slots summed at once, per decode rank


class Batches(list[Transfer]):
    """Batches a load posted: each is released when the ``with`` block ends, complete or not (a failed load
    leaves none posted)."""

    def __init__(self, transport: Transport) -> None:
        super().__init__()
        self.transport = transport

    def __enter__(self) -> Batches:
        return self

    def __exit__(self, *exc: object) -> None:
        for xfer in self:
            self.transport.release(xfer)

    def wait(self, timeout_s: float) -> None:
        for xfer in self:
            self.transport.wait(xfer, timeout_s)


class Reads:
    """The reads of one decode rank's loads (on the lane that runs each load), through the endpoint the service
    holds at the time (its transport and staging buffer), and digest threads that sum a staged read's landed
    slots while the next ones move."""

    def __init__(
        self,
        links: PrefillLinks,
        timeout_s: float,
        fault: Callable[[LoadJob, FaultPoint], None],
        name: str,
        on_thread: ThreadSetup,
    ) -> None:
        self._links, self.timeout_s, self._fault = links, timeout_s, fault
        self._digesting = ThreadPoolExecutor(
            DIGEST_THREADS, thread_name_prefix=f"glm-pd-landed-{name}", initializer=on_thread
        )

    def close(self) -> None:
        """Drop the sums not begun; wait for one being taken (it reads pages the engine may free next)."""
        self._digesting.shutdown(wait=True, cancel_futures=True)

    def pull(
        self,
        local: Endpoint,
        pieces: list[tuple[PrefillLink, TransferPlan]],
        slots: list[int],
        result: LoadResult,
        job: LoadJob,
        *,
        verify: bool,
    ) -> list[LandedDigests | None]:
        """Post every direct source's runs, then wait; read the staged ones slot by slot. Returns, per source
        read staged while ``verify``, its digests taken as slots landed (None: digested after the read)."""
        t0 = time.perf_counter()
        staged = 0
        landing: list[LandedDigests | None] = [
            LandedDigests(plan, local.memory) if slot_bytes and verify else None
            for (_, plan), slot_bytes in zip(pieces, slots, strict=True)
        ]
        with Batches(local.transport) as posted:
            for (peer, plan), slot_bytes, digests in zip(pieces, slots, landing, strict=True):
                if slot_bytes:
                    faults = partial(self._slot_fault, job, not posted and not staged)
                    landed = None if digests is None else self._summing(digests)
                    staged += self.staged(local, peer, plan, job.lease_id, slot_bytes, result, faults, landed=landed)
                    continue
                layers = [entries for _, entries in plan.layers() if any(e.num_runs for e in entries)]
                for entries in (layers[0] if layers else [], [e for rest in layers[1:] for e in rest]):
                    if not entries:
                        continue  # this rank holds none of the tokens that source has of these layers
                    if len(posted) < 2:  # before the load's first batch, and between its first two
                        self._fault(job, "mid_transfer" if posted else "posting")
                    posted.append(local.transport.post_plan(peer.agent, plan, "READ", entries=entries))
            posted.wait(self.timeout_s)
        result.seconds = time.perf_counter() - t0
        count(result, posted, pieces, staged)
        return landing

    def staged(
        self,
        local: Endpoint,
        peer: PrefillLink,
        plan: TransferPlan,
        request_id: str,
        slot_bytes: int,
        result: LoadResult,
        between: Callable[[int], None] = lambda _: None,
        *,
        opening: protocol.StreamRead | None = None,
        keep: frozenset[str] = frozenset(),
        landed: Callable[[int], object] | None = None,
    ) -> int:
        """Read one source's plan in slots (``read_staged``) and count its bytes; returns the slots moved."""
        assert local.staging is not None  # slot_bytes_for staged only with a buffer here
        slots = read_staged(
            self._links,
            peer,
            plan,
            request_id,
            slot_bytes,
            local.staging,
            local.transport,
            self.timeout_s,
            between,
            opening=opening,
            keep=keep,
            landed=landed,
        )
        result.staged_bytes += plan.num_bytes
        for kind, n in plan.bytes_by_kind().items():
            result.bytes_by_kind[kind] = result.bytes_by_kind.get(kind, 0) + n
        return slots

    def _summing(self, digests: LandedDigests) -> Callable[[int], object]:
        """What a staged read calls as its slots land: sum them on a digest thread, in the background."""
        return lambda upto: self._digesting.submit(digests.landed, upto)

    def _slot_fault(self, job: LoadJob, first: bool, k: int) -> None:
        """A staged load's fault points: before its first slot and between its first two, as a direct one's."""
        if first and k < 2:
            self._fault(job, "mid_transfer" if k else "posting")


def count(
    result: LoadResult, posted: list[Transfer], pieces: list[tuple[PrefillLink, TransferPlan]], slots: int = 0
) -> None:
    """What a load moved, into ``result``: what the transport reported finished, not what the plan says it would
    move (a staged plan's bytes count once its every slot was read and scattered), its runs and its batches."""
    moved = {"main": 0, "indexer": 0, **result.bytes_by_kind}
    for xfer in posted:
        for kind, n in xfer.completed_bytes_by_kind.items():
            moved[kind] = moved.get(kind, 0) + n
    result.bytes_by_kind = moved
    runs = {"main": 0, "indexer": 0}
    for _, plan in pieces:
        for kind, n in plan.runs_by_kind().items():
            runs[kind] += n
    result.runs, result.runs_by_kind, result.batches = sum(runs.values()), runs, len(posted) + slots

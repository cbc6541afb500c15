"""The decode side of a handoff, engine-free: handshake, plan, claim, pull (or streamed reads), verify, release.

Loads run on service threads, never on the engine's step. Each prefill engine gets a lane (a thread) of its
own, up to ``LANES``, and its loads run there in order, so one hung or slow prefill delays only the loads
that depend on it; its side-channel clients are touched only by that lane. The adapter submits
``LoadJob``s and collects ``LoadResult``s (``loads``, re-exported here).
A load counts only after prefill confirms its pages were held until the read finished (``Released``);
anything else fails the request, and prefill is told to free its pages. A failed ``LoadResult`` says why in
``reason`` (for people) and ``code`` (one of ``FAILURE_CODES``, for metrics and policy): a lease that ran out
is ``lease_expired``, apart from ``transport``, ``timeout`` and the rest.
``renew`` keeps prefill's leases of requests that still wait for decode's blocks: the renewals go out on the
lane of their prefill engine (its side-channel clients are that lane's alone) at the lane's next turn, or,
while a load waits for an answer, to the ranks already connected. A transfer batch that hangs holds its
lane's renewals until it times out; those renewals are for the same prefill, whose data path is then sick.
A streamed load (``LoadJob.stream_id``) subscribes to every prefill rank it releases, reads each whole page as
its source announces it written (one batch per announcement, or staged slots where the plan stages), and when
the request finished there claims the lease for the rest as a pull would: prefill's digests of that claim cover
every byte that streamed. ``cancel`` ends a streamed load that waits for prefill (decode's client went); prefill
is told, and drops its lease.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from glm_pd_common.errors import GlmPdError, ProtocolError
from glm_pd_common.handoff.at_exit import close_at_exit
from glm_pd_common.handoff.decode.feeds import Feed
from glm_pd_common.handoff.decode.links import PrefillLink, PrefillLinks
from glm_pd_common.handoff.decode.loads import LoadJob, LoadResult, Phases, Refused, RemotePrefill, failure_code
from glm_pd_common.handoff.decode.reads import Batches, Reads, count
from glm_pd_common.handoff.decode.renewals import Renewals
from glm_pd_common.handoff.decode.staged import slot_bytes_for
from glm_pd_common.handoff.decode.states import Handoff, HandoffState
from glm_pd_common.handoff.faults import FaultPoint, HandoffFaults
from glm_pd_common.handoff.lanes import LanePool
from glm_pd_common.handoff.queues import drain
from glm_pd_common.handoff.recent import RecentIds
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import Endpoint, PeerView
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient, pending, recv_any
from glm_pd_common.layout.digest_order import moved_byte
from glm_pd_common.layout.pages import block_pages, suffix_pages
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.layout.shards import token_shard
from glm_pd_common.layout.tp import SideLayout, Source, release_set, sources
from glm_pd_common.transport.digests import LandedDigests, check_landed

__all__ = ["LANES", "DecodeService", "LoadJob", "LoadResult", "RemotePrefill"]  # the jobs live in ``loads``

logger = logging.getLogger(__name__)


LANES = 8  # service threads per decode rank; more prefill engines than this share lanes


# Failures of one request over a link that worked (a client gone, prefill ending or refusing that request): the
# link stays, so the next request skips the handshake.
_LINK_STAYS = ("aborted", "lease_expired", "invalid_params")


class DecodeService:
    def __init__(
        self,
        local: Endpoint,
        *,
        timeout_s: float,
        verify_digests: bool,
        lanes: int = LANES,
        heartbeat_s: float = protocol.HEARTBEAT_S,
        faults: HandoffFaults | None = None,
    ) -> None:
        self.local = local
        self.faults = faults  # a test's fault injector; None in production
        self.timeout_s = timeout_s
        self.verify_digests = verify_digests
        self.heartbeat_s = heartbeat_s
        self._beats = 0
        self._links = PrefillLinks(local, timeout_s, self._progress)
        self._results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._renewals = Renewals(lanes, self._links, local.shape.tp_rank, self._layouts)
        self._reads = Reads(self._links, timeout_s, self._fault, local.engine_id, local.on_thread)
        self._lock = threading.Lock()
        self._cancelled = RecentIds()  # under ``_lock``: cancelled request ids, for loads that have not looked yet
        # a prefill engine (rank 0's address) keeps its lane; renewals go out before each wait for a load, so
        # one never waits behind a backlog of loads
        self._lanes: LanePool[LoadJob] = LanePool(
            f"glm-pd-decode-{local.engine_id}",
            self._serve,
            count=lanes,
            idle_s=heartbeat_s,
            between=self._renewals.send,
            idle=self._heartbeat,
            start=local.on_thread,
        )
        self._withdraw_exit = close_at_exit(self.close)

    # -- engine-facing, thread-safe ---------------------------------------------------------------
    def submit(self, job: LoadJob) -> None:
        self._lanes.submit(job.remote.address, job)

    def renew(self, remote: RemotePrefill, remote_request_ids: list[str]) -> None:
        """Keep prefill's leases of these requests (prefill's ids) while they wait for decode's blocks: call it
        every ``protocol.renew_interval(lease_s)``. Returns at once, never raises; the lane of ``remote`` sends
        them (``Renewals.send``)."""
        if not remote_request_ids:
            return
        lane = self._lanes.lane_of(remote.address)
        if self._renewals.add(lane, remote, remote_request_ids):
            self._lanes.wake(lane)

    def cancel(self, request_id: str) -> None:
        """Decode no longer wants this streamed load (its client went): it ends at its next message, failed as
        ``aborted``, and prefill is told. Blocks stay the engine's until the load's result is collected."""
        with self._lock:
            self._cancelled.add(request_id)

    def results(self, wait_s: float = 0.0) -> list[LoadResult]:
        """The results of loads that ended; with none yet, waits up to ``wait_s`` for the first (an engine with
        nothing to compute but loads to wait for sleeps here instead of stepping)."""
        return drain(self._results, wait_s)

    def leftovers(self) -> dict[str, int]:
        """What this service holds now. Once every load has ended and its result was collected: ``queued``
        and ``results`` are 0, ``prefill_peers`` is at most the prefill ranks still in use, and
        ``transport_peers`` equals ``prefill_peers``. ``lanes_assigned`` (engine address -> lane) is bounded by
        the lanes' cap: a lane must stay its engine's while loads for it may be queued."""
        return {
            "queued": self._lanes.queued(),
            "results": self._results.qsize(),
            "prefill_peers": len(self._links),
            "transport_peers": len(self.local.transport.remote_peers()),
            "lanes_assigned": self._lanes.assigned(),
        }

    def close(self) -> None:
        self._withdraw_exit()
        self._lanes.close(self.timeout_s + 5)
        self._reads.close()
        self._links.close()

    # -- the service thread -----------------------------------------------------------------------
    def _serve(self, job: LoadJob) -> None:
        try:
            self._results.put(self._load(job))
        except Exception as exc:  # a bug must fail one request, never wedge the engine
            logger.exception("glm-pd decode: load of %s crashed", job.request_id)
            self._results.put(LoadResult(job.request_id, False, f"internal error: {exc!r}", "internal"))

    def _load(self, job: LoadJob) -> LoadResult:
        handoff = Handoff(job.request_id)
        result = LoadResult(job.request_id, ok=False)
        remote = job.remote
        group: tuple[int, ...] = ()  # stays empty if the params name a shape we cannot pair with: no one to tell
        mark = Phases(result.phases, job.submitted_at)
        mark("queued")
        lease_id = job.lease_id
        try:
            # a streamed load may wait on a prefill that has not answered yet: its client's abort ends it there too
            cancellable = self._progress_or_cancel(job)
            remote = self._links.known(remote, cancellable if job.stream_id else None)
            prefill, decode = self._layouts(remote)
            me = self.local.shape.tp_rank
            group = release_set(me, prefill, decode)
            readers = tuple(s.rank for s in sources(me, prefill, decode))  # their answers decide
            if job.read and job.stream_id:
                lease_id = self._stream(job, remote, group, result, handoff, mark, cancellable)
            elif job.read:
                pieces = []
                for source in sources(me, prefill, decode):
                    peer = self._links.get(remote, source.rank)
                    table = block_pages(job.remote_pages, peer.view.shape.pages_per_block, side="prefill")
                    pieces.append((peer, self._plan(job, peer.view, source, result, table)))
                mark("handshake")
                handoff.advance(HandoffState.WAITING_FOR_INPUT)
                self._fault(job, "before_claim")
                slots = [slot_bytes_for(self.local.staging, peer, plan) for peer, plan in pieces]
                claims = [self._claim(peer, plan, job, slot) for (peer, plan), slot in zip(pieces, slots, strict=True)]
                mark("claim")
                handoff.advance(HandoffState.TRANSFERRING)
                landing = self._reads.pull(self.local, pieces, slots, result, job, verify=self.verify_digests)
                moving = [plan for _, plan in pieces if plan.num_runs]
                if self.faults is not None and moving:
                    self.faults.landed(job.request_id, *moved_byte(moving[-1]))
                for (peer, plan), claim, landed in zip(pieces, claims, landing, strict=True):
                    if claim.verify:
                        self._verify(peer, plan, claim, landed)
                self._fault(job, "before_release")
                mark("pull")
            if job.stream_id and not job.read:  # nothing to read: prefill drops the transfer and its lease
                self._abort(remote, group, job.lease_id, "decode needs none of its bytes", connect=True)
            else:
                self._release(remote, group, readers, lease_id, job.request_id)
            mark("release")
            if job.read:
                handoff.advance(HandoffState.SUCCESS)
            result.ok = True
        except Exception as exc:  # a peer's error, or a bug: either way prefill is told to free its pages
            reason = str(exc) if isinstance(exc, GlmPdError) else f"internal error: {exc!r}"
            if not isinstance(exc, GlmPdError):
                logger.exception("glm-pd decode: load of %s crashed", job.request_id)
            handoff.fail(reason)
            result.reason, result.code = reason, failure_code(exc)
            self._abort(remote, group, job.lease_id, reason)  # a streamed load: its transfer id
            if result.code not in _LINK_STAYS:  # the next request re-handshakes: the peer may have restarted or changed
                self._links.forget(remote)
        finally:
            with self._lock:
                self._cancelled.discard(job.request_id)
        result.states = handoff.states
        moved = ", ".join(f"{kind} {n} B" for kind, n in result.bytes_by_kind.items()) or "0 B"
        if result.staged_bytes:
            moved += f", of which staged {result.staged_bytes} B"
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result.phases.items())
        logger.info("glm-pd decode: %s %s: %s; %s", job.request_id, "loaded" if result.ok else "failed", moved, phases)
        return result

    def _layouts(self, remote: RemotePrefill) -> tuple[SideLayout, SideLayout]:
        """Both sides' ranks as the pairing sees them: prefill's from the request's params, ours from our shape."""
        g = self.local.spec.geometry
        return SideLayout.of_shape(remote, g), SideLayout.of_shape(self.local.shape, g)

    def _plan(
        self,
        job: LoadJob,
        view: PeerView,
        source: Source,
        result: LoadResult | None,
        table: np.ndarray,
        span: tuple[int, int] | None = None,
    ) -> TransferPlan:
        """What this rank reads from one prefill rank (its page ``table``): its token shard of the layers
        ``source`` serves, over the tokens ``span`` (default: the suffix past decode's prefix). The whole
        suffix's plan is the one counted in ``result`` (a streamed load's reads are pieces of it)."""
        if view.shape.sharding != job.remote.sharding and job.remote.tp_size:
            raise Refused(
                f"prefill {view.engine_id} rank {source.rank} says its caches are sharded "
                f"{view.shape.sharding}; the request's params say {job.remote.sharding}",
                "refused_peer",
            )
        start, end = span or (job.prefix_tokens, job.num_tokens)
        mine = token_shard(self.local.shape.tp_rank, self.local.shape.sharding)
        d_span = mine.table_tokens(self.local.shape.page_tokens)
        s_span = source.shard.table_tokens(view.shape.page_tokens)
        src = suffix_pages(table, end, start, s_span, align_tokens=d_span)
        dst = suffix_pages(job.local_pages, end, start, d_span, align_tokens=d_span)
        t0 = time.perf_counter()
        plan = build_plan(
            view.regions,
            self.local.regions,
            src,
            dst,
            num_tokens=end,
            prefix_tokens=start,
            src_shard=source.shard,
            dst_shard=mine,
            layers=source.layers,
        )
        if result is not None:
            result.plan_ms += (time.perf_counter() - t0) * 1e3
            result.pages = {"prefill": result.pages.get("prefill", 0) + int(src.size), "decode": int(dst.size)}
        return plan

    def _stream(
        self,
        job: LoadJob,
        remote: RemotePrefill,
        group: tuple[int, ...],
        result: LoadResult,
        handoff: Handoff,
        mark: Phases,
        waiting: Callable[[], None],
    ) -> str:
        """Read a streamed transfer while prefill writes it; returns the lease id prefill finished under.
        ``waiting`` runs while it waits for prefill, and raises once the load is cancelled."""
        me = self.local.shape.tp_rank
        serving = {s.rank: s for s in sources(me, *self._layouts(remote))}
        feeds = [Feed(rank, rank in serving, job.prefix_tokens) for rank in group]
        peers = [self._links.get(remote, f.rank, waiting) for f in feeds]
        align = token_shard(me, self.local.shape.sharding).table_tokens(self.local.shape.page_tokens)
        mark("handshake")
        subscribe = protocol.Subscribe(v=PROTOCOL_VERSION, request_id=job.lease_id, num_tokens=job.num_tokens)
        for peer in peers:
            peer.client.send(subscribe)
        handoff.advance(HandoffState.WAITING_FOR_INPUT)
        pieces: list[tuple[PrefillLink, TransferPlan, protocol.TransferRequest]] = []
        t0 = time.perf_counter()
        local = self.local
        posted = Batches(local.transport)
        staged = 0
        clients = [p.client for p in peers]
        last_beat = time.monotonic()

        def beat(_slot: int = 0) -> None:
            """Prefill forgets a decode silent too long: beat while waiting, and between a staged read's slots."""
            nonlocal last_beat
            if time.monotonic() - last_beat > self.heartbeat_s:
                last_beat = time.monotonic()
                self._beat(clients)

        def read(i: int) -> None:
            """Read the tokens feed ``i`` allows now: posted (waited for at the end), or staged slot by slot
            (the messages of the transfer and of its lease that arrive meanwhile are kept for their readers)."""
            nonlocal staged
            span = feeds[i].next_read(align, job.num_tokens)
            if span is None:
                return
            plan = self._plan(job, peers[i].view, serving[feeds[i].rank], None, feeds[i].table, span)
            slot_bytes = slot_bytes_for(local.staging, peers[i], plan) if plan.num_runs else 0
            if slot_bytes:
                opening = protocol.StreamRead(
                    v=PROTOCOL_VERSION,
                    request_id=job.lease_id,
                    num_tokens=span[1],
                    prefix_tokens=span[0],
                    src_pages=plan.src_pages.tolist(),
                    dst_pages=plan.dst_pages.tolist(),
                    slot_bytes=slot_bytes,
                )
                keep = frozenset(f.lease_id for f in feeds if f.lease_id)
                staged += self._reads.staged(
                    local, peers[i], plan, job.lease_id, slot_bytes, result, beat, opening=opening, keep=keep
                )
            elif plan.num_runs:
                posted.append(local.transport.post_plan(peers[i].agent, plan, "READ"))
            feeds[i].read_to = span[1]

        with posted:
            while not all(f.lease_id for f in feeds):
                beat()
                first = recv_any(clients, self.timeout_s, waiting)
                heard = set()
                # What queued up while the last read was posted is read as one batch: each batch costs a
                # post and a completion, and 8 batches in place of 1 moved 9-13 % less per second here.
                for i, msg in [first, *pending(clients)]:
                    if getattr(msg, "request_id", None) != job.lease_id:
                        continue  # a late answer to an earlier request
                    if isinstance(msg, protocol.Failed):
                        raise Refused(f"prefill {remote.engine_id} rank {feeds[i].rank}: {msg.reason}", msg.code)
                    if not isinstance(msg, protocol.Progress):
                        raise ProtocolError(f"prefill answered {type(msg).__name__} to a subscription")
                    feeds[i].take(msg, job.num_tokens)
                    heard.add(i)
                for i in sorted(heard):
                    if not feeds[i].lease_id:  # past the lease, the rest is read once the claim is on its way
                        read(i)
            mark("stream")
            handoff.advance(HandoffState.TRANSFERRING)
            lease_ids = {f.lease_id for f in feeds}
            if len(lease_ids) != 1:
                raise ProtocolError(f"prefill ranks named different leases {sorted(lease_ids)}")
            claims = []
            for i, feed in enumerate(feeds):
                if feed.reads:  # the claim covers the whole suffix: prefill's digests cover what streamed
                    plan = self._plan(job, peers[i].view, serving[feed.rank], result, feed.table)
                    sent = self._claim_of(plan, replace(job, stream_id="", remote_request_id=feed.lease_id))
                    peers[i].client.send(sent)
                    claims.append((i, plan, sent))
            for i, _, _ in claims:  # the tail read and the claims' round trips overlap
                read(i)
            for i, plan, sent in claims:
                self._links.ask(peers[i], sent, feeds[i].lease_id, (protocol.Claimed,), send=False)
                pieces.append((peers[i], plan, sent))
            posted.wait(self.timeout_s)
        result.seconds = time.perf_counter() - t0
        count(result, posted, [(peer, plan) for peer, plan, _ in pieces], staged)
        for peer, plan, claim in pieces:
            if claim.verify:
                self._verify(peer, plan, claim)
        mark("pull")
        return feeds[0].lease_id

    def _progress_or_cancel(self, job: LoadJob) -> Callable[[], None]:
        """``_progress``, and a cancelled load ends here (its blocks stay until the engine collects the result)."""

        def progress() -> None:
            if job.request_id in self._cancelled:
                raise Refused("decode gave up on the request (its client went away)", "aborted")
            self._progress()

        return progress

    def _beat(self, clients: list[SideChannelClient]) -> None:
        self._beats += 1
        for client in clients:
            client.send(protocol.Heartbeat(v=PROTOCOL_VERSION, engine_id=self.local.engine_id, seq=self._beats))

    def _claim(self, peer: PrefillLink, plan: TransferPlan, job: LoadJob, slot_bytes: int) -> protocol.TransferRequest:
        """Claim ``plan``'s pages of ``peer``; returns the claim, once prefill answered that decode may read."""
        claim = self._claim_of(plan, job, slot_bytes)
        self._links.ask(peer, claim, job.lease_id, (protocol.Claimed,))
        return claim

    def _claim_of(self, plan: TransferPlan, job: LoadJob, slot_bytes: int = 0) -> protocol.TransferRequest:
        return protocol.TransferRequest(
            v=PROTOCOL_VERSION,
            request_id=job.lease_id,
            num_tokens=job.num_tokens,
            prefix_tokens=job.prefix_tokens,
            src_pages=plan.src_pages.tolist(),
            dst_pages=plan.dst_pages.tolist(),
            verify=self.verify_digests,
            slot_bytes=slot_bytes,
        )

    def _verify(
        self,
        peer: PrefillLink,
        plan: TransferPlan,
        claim: protocol.TransferRequest,
        landed: LandedDigests | None = None,
    ) -> None:
        """Check what landed (digested as it landed, or now) against prefill's digests of the claim's source pages
        (computed while decode read)."""
        local = None if landed is None else landed.digests()
        request_id = claim.request_id
        digests = self._links.ask(peer, claim, request_id, (protocol.SourceDigests,), send=False).digests

        def page_digests_of(regions: list[int]) -> dict[int, list[int]]:
            query = protocol.DigestQuery(v=PROTOCOL_VERSION, request_id=request_id, region_indices=regions)
            return self._links.ask(peer, query, request_id, (protocol.PageDigests,)).pages

        check_landed(plan, digests, page_digests_of, self.local.memory, local=local)

    def _release(
        self, remote: RemotePrefill, group: tuple[int, ...], readers: tuple[int, ...], lease_id: str, request_id: str
    ) -> None:
        """Confirm to every prefill rank holding this request; every source must answer ``Released`` (its pages
        were held until our read finished), the others only free their copy."""
        done = protocol.Done(v=PROTOCOL_VERSION, request_id=lease_id)
        sends = 1 if self.faults is None else self.faults.confirmations(request_id)
        for rank in group:
            try:
                peer = self._links.get(remote, rank)
                self._links.ask(peer, done, lease_id, (protocol.Released,), send=sends > 0)
                for _ in range(sends - 1):
                    peer.client.send(done)
            except GlmPdError:
                if rank in readers:
                    raise
                logger.warning("glm-pd decode: prefill rank %d did not confirm release of %s", rank, lease_id)

    def _fault(self, job: LoadJob, point: FaultPoint) -> None:
        if self.faults is not None:
            self.faults.at(job.request_id, point)

    def _abort(
        self, remote: RemotePrefill, group: tuple[int, ...], request_id: str, reason: str, *, connect: bool = False
    ) -> None:
        """Tell every prefill rank holding the request to free it (``connect``: handshaking where needed)."""
        for rank in group:
            peer = self._links.connected(remote, rank)
            if peer is None and connect:
                try:
                    peer = self._links.get(remote, rank)
                except GlmPdError as exc:
                    logger.warning("glm-pd decode: prefill rank %d not told to drop %s: %s", rank, request_id, exc)
            if peer is not None:
                abort = protocol.Abort(v=PROTOCOL_VERSION, request_id=request_id, reason=protocol.clip(reason))
                peer.client.send(abort)

    def _heartbeat(self, lane: int) -> None:
        """Tell this lane's prefill peers we are alive (an idle connection looks like a gone one)."""
        try:
            for peer in self._links.all():
                if self._lanes.lane_for(peer.engine) == lane:
                    self._beats += 1
                    peer.client.send(
                        protocol.Heartbeat(v=PROTOCOL_VERSION, engine_id=self.local.engine_id, seq=self._beats)
                    )
        except Exception as exc:  # a lost heartbeat only risks a re-handshake later
            logger.warning("glm-pd decode: heartbeat from lane %d failed: %r", lane, exc)

    def _progress(self) -> None:
        """While a lane waits for a peer: the transport's progress, and renewals that need no handshake."""
        self.local.transport.notifs()
        lane = self._lanes.current()
        if lane is not None and self._renewals.due(lane):
            self._renewals.send(lane, connect=False)

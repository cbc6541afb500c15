"""The decode side of a handoff, engine-free: handshake, plan, claim, layer-by-layer pull, verify, release.

Loads run on service threads, never on the engine's step. Each prefill engine gets a lane (a thread) of its
own, up to ``LANES``, and its loads run there in order, so one hung or slow prefill delays only the loads
that depend on it; its side-channel clients are touched only by that lane. The adapter submits
``LoadJob``s and collects ``LoadResult``s.
A load counts only after prefill confirms its pages were held until the read finished (``Released``);
anything else fails the request, and prefill is told to free its pages.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from glm_pd_common.errors import GlmPdError, ProtocolError
from glm_pd_common.handoff import protocol
from glm_pd_common.handoff.peer import Endpoint, PeerView, accept_hello
from glm_pd_common.handoff.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.queues import drain
from glm_pd_common.handoff.sidechannel import SideChannelClient
from glm_pd_common.handoff.states import Handoff, HandoffState
from glm_pd_common.layout.checksum import check_landed, flip_byte, moved_byte
from glm_pd_common.layout.pages import suffix_pages
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.layout.tp import release_group, source_rank
from glm_pd_common.transport.base import Transfer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prefill lives: its engine id, side-channel host, base port (rank r: +r), TP size."""

    engine_id: str
    host: str
    base_port: int
    tp_size: int


@dataclass(frozen=True)
class LoadJob:
    request_id: str
    remote: RemotePrefill
    remote_pages: np.ndarray  # prefill's whole page table for the request
    local_pages: np.ndarray  # decode's whole page table for the request
    num_tokens: int
    prefix_tokens: int  # decode's local prefix hit (page-aligned): those pages stay
    read: bool = True  # False: nothing to read (all tokens hit locally), only release prefill's pages
    test_fault: str = ""  # test hook, one of FAULTS ("kind" or "kind:seconds"); never set from remote input
    remote_request_id: str = ""  # prefill's id for the request, when the engines name it differently
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def lease_id(self) -> str:
        return self.remote_request_id or self.request_id


LANES = 8  # service threads per decode rank; more prefill engines than this share lanes
_MAX_REMEMBERED_ENGINES = 4096

# Test hooks (the fault matrix and the demo): what each does to one load.
FAULTS = {
    "corrupt": "flip one landed byte before verification",
    "stall_before_claim": "wait N s after the handshake, before claiming the lease",
    "stall_mid": "wait N s after posting the first layer's reads, before the others",
    "stall_before_release": "wait N s after the reads (and verification), before confirming",
    "transport_error": "the first batch fails as if the backend reported an error",
    "transport_hang": "the first batch never reports completion",
    "lose_release": "the confirmation is never sent (a lost message); its answer is still awaited",
    "duplicate_release": "the confirmation is sent twice",
}


@dataclass
class LoadResult:
    request_id: str
    ok: bool
    reason: str = ""
    states: list[str] = field(default_factory=list)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    runs: int = 0
    runs_by_kind: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    seconds: float = 0.0
    plan_ms: float = 0.0
    pages: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: queued, handshake, claim, pull, release


@dataclass
class _Peer:
    client: SideChannelClient
    view: PeerView
    agent: str


class DecodeService:
    def __init__(
        self,
        local: Endpoint,
        *,
        timeout_s: float,
        verify_digests: bool,
        lanes: int = LANES,
        heartbeat_s: float = protocol.HEARTBEAT_S,
    ) -> None:
        self.local = local
        self.timeout_s = timeout_s
        self.verify_digests = verify_digests
        self.heartbeat_s = heartbeat_s
        self._beats = 0
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._lanes: list[queue.SimpleQueue[LoadJob | None]] = [queue.SimpleQueue() for _ in range(lanes)]
        self._lane_of: dict[str, int] = {}  # prefill engine id -> its lane, first come first served
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"glm-pd-decode-{local.engine_id}-{i}", daemon=True)
            for i in range(lanes)
        ]
        for thread in self._threads:
            thread.start()

    # -- engine-facing, thread-safe ---------------------------------------------------------------
    def submit(self, job: LoadJob) -> None:
        engine = job.remote.engine_id
        with self._lock:
            lane = self._lane_of.get(engine)
            if lane is None:
                # Engine ids come from remote params: past the cap, lanes are picked by hash, not remembered.
                lane = len(self._lane_of) % len(self._lanes)
                if len(self._lane_of) < _MAX_REMEMBERED_ENGINES:
                    self._lane_of[engine] = lane
                else:
                    lane = _hash_lane(engine, len(self._lanes))
        self._lanes[lane].put(job)

    def results(self) -> list[LoadResult]:
        return drain(self._results)

    def leftovers(self) -> dict[str, int]:
        """What this service holds now. Once every load has ended and its result was collected: ``queued``
        and ``results`` are 0, ``prefill_peers`` is at most the prefill ranks still in use, and
        ``transport_peers`` equals ``prefill_peers``. ``lanes_assigned`` (engine id -> lane) is bounded by
        ``_MAX_REMEMBERED_ENGINES``: a lane must stay its engine's while loads for it may be queued."""
        return {
            "queued": sum(lane.qsize() for lane in self._lanes),
            "results": self._results.qsize(),
            "prefill_peers": len(self._peers),
            "transport_peers": len(self.local.transport.remote_peers()),
            "lanes_assigned": len(self._lane_of),
        }

    def close(self) -> None:
        for lane in self._lanes:
            lane.put(None)
        deadline = time.monotonic() + self.timeout_s + 5
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        for peer in self._peers.values():
            peer.client.close()
        self._peers.clear()

    # -- the service thread -----------------------------------------------------------------------
    def _run(self, lane: int) -> None:
        jobs = self._lanes[lane]
        while True:
            try:
                job = jobs.get(timeout=self.heartbeat_s)
            except queue.Empty:
                try:
                    self._heartbeat(lane)
                except Exception as exc:  # a lost heartbeat only risks a re-handshake later
                    logger.warning("glm-pd decode: heartbeat from lane %d failed: %r", lane, exc)
                continue
            if job is None:
                return
            try:
                self._results.put(self._load(job))
            except Exception as exc:  # a bug must fail one request, never wedge the engine
                logger.exception("glm-pd decode: load of %s crashed", job.request_id)
                self._results.put(LoadResult(job.request_id, False, f"internal error: {exc!r}"))

    def _load(self, job: LoadJob) -> LoadResult:
        handoff = Handoff(job.request_id)
        result = LoadResult(job.request_id, ok=False)
        remote = job.remote
        group = release_group(self.local.shape.tp_rank, remote.tp_size, self.local.shape.tp_size)
        mark = _Phases(result.phases, job.submitted_at)
        mark("queued")
        try:
            if job.read:
                src_rank = source_rank(self.local.shape.tp_rank, remote.tp_size, self.local.shape.tp_size)
                peer = self._peer(remote, src_rank)
                mark("handshake")
                handoff.advance(HandoffState.WAITING_FOR_INPUT)
                plan = self._plan(job, peer.view, result)
                _stall(job, "stall_before_claim")
                claim = self._ask(
                    peer,
                    protocol.TransferRequest(
                        v=PROTOCOL_VERSION,
                        request_id=job.lease_id,
                        num_tokens=job.num_tokens,
                        prefix_tokens=job.prefix_tokens,
                        src_pages=plan.src_pages.tolist(),
                        dst_pages=plan.dst_pages.tolist(),
                        verify=self.verify_digests,
                    ),
                    job.lease_id,
                    (protocol.Claimed,),
                )
                mark("claim")
                handoff.advance(HandoffState.TRANSFERRING)
                self._pull(peer, plan, result, job)
                if job.test_fault == "corrupt":
                    flip_byte(moved_byte(plan))
                if claim.digests is not None:
                    self._verify(peer, plan, claim.digests, job.lease_id)
                _stall(job, "stall_before_release")
                mark("pull")
            self._release(remote, group, job.lease_id, job.test_fault)
            mark("release")
            if job.read:
                handoff.advance(HandoffState.SUCCESS)
            result.ok = True
        except Exception as exc:  # a peer's error, or a bug: either way prefill is told to free its pages
            reason = str(exc) if isinstance(exc, GlmPdError) else f"internal error: {exc!r}"
            if not isinstance(exc, GlmPdError):
                logger.exception("glm-pd decode: load of %s crashed", job.request_id)
            handoff.fail(reason)
            result.reason = reason
            self._abort(remote, group, job.lease_id, reason)
            self._forget(remote)  # the next request re-handshakes: the peer may have restarted or changed
        result.states = handoff.states
        logger.info(
            "glm-pd decode: %s %s: %s; %s",
            job.request_id,
            "loaded" if result.ok else "failed",
            ", ".join(f"{kind} {n} B" for kind, n in result.bytes_by_kind.items()) or "0 B",
            ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result.phases.items()),
        )
        return result

    def _plan(self, job: LoadJob, view: PeerView, result: LoadResult) -> TransferPlan:
        d_pt = self.local.shape.page_tokens
        src = suffix_pages(
            job.remote_pages, job.num_tokens, job.prefix_tokens, view.shape.page_tokens, align_tokens=d_pt
        )
        dst = suffix_pages(job.local_pages, job.num_tokens, job.prefix_tokens, d_pt, align_tokens=d_pt)
        t0 = time.perf_counter()
        plan = build_plan(
            view.regions, self.local.regions, src, dst, num_tokens=job.num_tokens, prefix_tokens=job.prefix_tokens
        )
        result.plan_ms = (time.perf_counter() - t0) * 1e3
        result.pages = {"prefill": int(src.size), "decode": int(dst.size)}
        return plan

    def _pull(self, peer: _Peer, plan: TransferPlan, result: LoadResult, job: LoadJob) -> None:
        """Post every layer's runs (layer 0 first, each indexer with its layer), then wait for all."""
        t0 = time.perf_counter()
        posted: list[Transfer] = []
        try:
            for _, entries in plan.layers():
                if len(posted) == 1:
                    _stall(job, "stall_mid")
                posted.append(self.local.transport.post_plan(peer.agent, plan, "READ", entries=entries))
                if len(posted) == 1 and job.test_fault.startswith("transport_"):
                    posted[0].test_fault = job.test_fault.removeprefix("transport_")
            for xfer in posted:
                self.local.transport.wait(xfer, self.timeout_s)
        finally:
            for xfer in posted:
                self.local.transport.release(xfer)
        result.seconds = time.perf_counter() - t0
        # What moved is what the transport reported finished, not what the plan says it would move.
        moved = {"main": 0, "indexer": 0}
        for xfer in posted:
            for kind, n in xfer.completed_bytes_by_kind.items():
                moved[kind] = moved.get(kind, 0) + n
        result.bytes_by_kind = moved
        result.runs, result.runs_by_kind, result.batches = plan.num_runs, plan.runs_by_kind(), len(posted)

    def _verify(self, peer: _Peer, plan: TransferPlan, digests: list[int], request_id: str) -> None:
        def page_digests_of(regions: list[int]) -> dict[int, list[int]]:
            query = protocol.DigestQuery(v=PROTOCOL_VERSION, request_id=request_id, region_indices=regions)
            return self._ask(peer, query, request_id, (protocol.PageDigests,)).pages

        check_landed(plan, digests, page_digests_of)

    def _release(self, remote: RemotePrefill, group: list[int], request_id: str, fault: str = "") -> None:
        """Confirm to every prefill rank holding this request; the source rank's answer decides."""
        source = group[0]
        done = protocol.Done(v=PROTOCOL_VERSION, request_id=request_id)
        for rank in group:
            try:
                peer = self._peer(remote, rank)
                self._ask(peer, done, request_id, (protocol.Released,), send=fault != "lose_release")
                if fault == "duplicate_release":
                    peer.client.send(done)
            except GlmPdError:
                if rank == source:
                    raise
                logger.warning("glm-pd decode: prefill rank %d did not confirm release of %s", rank, request_id)

    def _abort(self, remote: RemotePrefill, group: list[int], request_id: str, reason: str) -> None:
        for rank in group:
            peer = self._peers.get((remote.engine_id, rank))
            if peer is not None:
                peer.client.send(protocol.Abort(v=PROTOCOL_VERSION, request_id=request_id, reason=reason[:500]))

    def _heartbeat(self, lane: int) -> None:
        """Tell this lane's prefill peers we are alive (an idle connection looks like a gone one)."""
        for (engine, _), peer in list(self._peers.items()):
            if self._lane_of.get(engine, _hash_lane(engine, len(self._lanes))) == lane:
                self._beats += 1
                peer.client.send(
                    protocol.Heartbeat(v=PROTOCOL_VERSION, engine_id=self.local.engine_id, seq=self._beats)
                )

    def _forget(self, remote: RemotePrefill) -> None:
        for key in [k for k in list(self._peers) if k[0] == remote.engine_id]:  # other lanes add theirs
            peer = self._peers.pop(key)
            peer.client.close()
            self.local.transport.remove_peer(peer.agent)

    def _peer(self, remote: RemotePrefill, rank: int) -> _Peer:
        key = (remote.engine_id, rank)
        if key in self._peers:
            return self._peers[key]
        client = SideChannelClient(remote.host, remote.base_port + rank)
        try:
            client.send(self.local.hello(self.local.transport.metadata()))
            reply = client.recv(self.timeout_s, progress=self.local.transport.notifs)
            if isinstance(reply, protocol.Failed):
                raise GlmPdError(f"prefill {remote.engine_id} rank {rank} refused the handshake: {reply.reason}")
            if not isinstance(reply, protocol.Hello):
                raise ProtocolError(f"prefill {remote.engine_id} rank {rank} answered {type(reply).__name__}")
            view = accept_hello(
                self.local.spec, reply, backend=self.local.transport.backend, role="prefill", local_role="decode"
            )
            if view.engine_id != remote.engine_id or view.shape.tp_rank != rank:
                raise ProtocolError(
                    f"{remote.host}:{remote.base_port + rank} is {view.engine_id} rank "
                    f"{view.shape.tp_rank}, not {remote.engine_id} rank {rank}"
                )
            agent = self.local.transport.add_peer(view.agent_metadata, view.spans)
        except Exception:
            client.close()
            raise
        self._peers[key] = _Peer(client, view, agent)
        return self._peers[key]

    def _ask(self, peer: _Peer, msg: protocol.Message, request_id: str, want: tuple[type, ...], *, send: bool = True):
        """Send and wait for this request's answer (a late answer to an earlier request is skipped)."""
        if send:
            peer.client.send(msg)
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = peer.client.recv(max(deadline - time.monotonic(), 0.001), progress=self.local.transport.notifs)
            if getattr(reply, "request_id", None) != request_id:
                continue
            if isinstance(reply, protocol.Failed):
                raise GlmPdError(f"prefill {peer.view.engine_id} refused {type(msg).__name__}: {reply.reason}")
            if isinstance(reply, want):
                return reply
            raise ProtocolError(f"prefill answered {type(reply).__name__} to {type(msg).__name__}")


class _Phases:
    """Seconds spent in each phase of one load, from the moment the engine submitted it."""

    def __init__(self, into: dict[str, float], since: float) -> None:
        self.into, self.last = into, since

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.into[phase], self.last = now - self.last, now


def _hash_lane(engine: str, lanes: int) -> int:
    return xxhash.xxh3_64_intdigest(engine.encode()) % lanes


def _stall(job: LoadJob, kind: str) -> None:
    name, _, seconds = job.test_fault.partition(":")
    if name == kind:
        logger.warning("glm-pd test hook: %s stalls %s s (%s)", job.request_id, seconds, kind)
        time.sleep(float(seconds))

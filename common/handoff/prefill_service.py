"""The prefill side of a handoff, engine-free: leases, the side channel, claims, releases, expiry.

One thread owns the side channel socket, the transport's notifications and the lease table, so none of
them is touched concurrently. The engine adapter talks to it through two thread-safe calls: ``grant``
(a finished request's pages, to hold for decode) and ``finished`` (requests whose pages may now be freed:
released by every decode rank that reads them, aborted, or expired).
A decode peer is kept while it is heard from (decode sends heartbeats while idle): a new hello from the
same agent (a restart, or a re-handshake after a failed load) replaces it, and a peer silent for
``peer_idle_s`` that holds no claim on a live lease is forgotten; either way its agent leaves the transport.
``leftovers`` counts what is held, so a harness can check that nothing leaks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from glm_pd_common.errors import GlmPdError, ProtocolError
from glm_pd_common.handoff import protocol
from glm_pd_common.handoff.lease import LeaseTable
from glm_pd_common.handoff.peer import Endpoint, PeerView, accept_hello
from glm_pd_common.handoff.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.queues import drain
from glm_pd_common.handoff.sidechannel import SideChannelServer
from glm_pd_common.layout.checksum import MAX_PAGE_QUERIES, page_digests, plan_digests
from glm_pd_common.layout.pages import suffix_pages
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.layout.tp import expected_releases

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    """A request whose prefill pages may be freed, and why."""

    request_id: str
    outcome: str  # released | aborted | expired
    detail: str = ""


@dataclass
class _Decode:
    identity: bytes
    peer: PeerView
    agent: str  # its agent in our transport
    last_seen: float = 0.0


class PrefillService:
    def __init__(
        self,
        local: Endpoint,
        *,
        host: str,
        port: int,
        lease_s: float,
        timeout_s: float,
        peer_idle_s: float | None = None,
    ) -> None:
        self.local = local
        self.timeout_s = timeout_s
        # Past this silence a decode is gone: a live one heartbeats while idle and claims within a lease. Three
        # missed heartbeats at least, so a busy host's late beat never costs a live decode its next request.
        if peer_idle_s is None:
            peer_idle_s = max(lease_s + timeout_s, 3 * protocol.HEARTBEAT_S)
        self.peer_idle_s = peer_idle_s
        self._next_idle_check = 0.0
        self.server = SideChannelServer(host, port)
        self._leases = LeaseTable(ttl_s=lease_s, transfer_ttl_s=timeout_s)
        self._grants: queue.SimpleQueue[tuple[str, np.ndarray]] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self._decodes: dict[bytes, _Decode] = {}
        self._early_claims: dict[tuple[str, bytes], tuple[protocol.TransferRequest, float]] = {}
        self._plans: dict[tuple[bytes, str], TransferPlan] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # recently ended leases, so late claims fail fast
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"glm-pd-prefill-{local.engine_id}", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.server.port

    # -- engine-facing, thread-safe ---------------------------------------------------------------
    def grant(self, request_id: str, pages: np.ndarray) -> None:
        """Hold a finished request's full page table for decode (its lease starts now)."""
        self._grants.put((request_id, np.asarray(pages, dtype=np.int64)))

    def finished(self) -> list[Finished]:
        return drain(self._finished)

    def leftovers(self) -> dict[str, int]:
        """What this service holds now. Once every request has ended: ``leases``, ``early_claims`` and
        ``plans`` are 0, ``decode_peers`` is at most the decode ranks still connected, ``transport_peers``
        equals ``decode_peers`` (one transport agent per decode peer).
        The ids of recently ended leases are kept apart, bounded (so a late claim fails fast)."""
        return {
            "leases": len(self._leases),
            "early_claims": len(self._early_claims),
            "plans": len(self._plans),
            "decode_peers": len(self._decodes),
            "transport_peers": len(self.local.transport.remote_peers()),
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.server.close()

    # -- the service thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # the service must outlive any one bad peer or message
                logger.exception("glm-pd prefill service step failed")

    def _step(self) -> None:
        for request_id, pages in drain(self._grants):
            if request_id in self._leases:
                # Two live requests under one id cannot both be served safely: neither is.
                self._leases.drop(request_id)
                self._end(Finished(request_id, "aborted", "a second request arrived under the same id"))
                continue
            self._leases.grant(request_id, pages, releases=1)
            self._gone.pop(request_id, None)  # an id used again after its earlier lease ended
            for key in [k for k in self._early_claims if k[0] == request_id]:
                self._on_claim(key[1], self._early_claims.pop(key)[0])
        for lease in self._leases.expire():
            self._end(Finished(lease.request_id, "expired", "lease expired before decode confirmed"))
        now = time.monotonic()
        for (request_id, ident), (_, deadline) in list(self._early_claims.items()):
            if deadline < now:
                del self._early_claims[request_id, ident]
                self._fail(ident, request_id, "prefill holds no lease for this request")
        if now >= self._next_idle_check:
            self._forget_silent(now)
        self.local.transport.notifs()  # drives the transport's progress (UCX needs the passive side to poll)
        try:
            ident, msg = self.server.recv(timeout_s=0.002)
        except GlmPdError as exc:
            if "no message" not in str(exc):
                logger.warning("glm-pd prefill: refused a side-channel message: %s", exc)
            return
        if ident in self._decodes:
            self._decodes[ident].last_seen = time.monotonic()
        self._dispatch(ident, msg)

    def _dispatch(self, ident: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Query):
            self.server.send(ident, self.local.hello(b""))
        elif isinstance(msg, protocol.Hello):
            self._on_hello(ident, msg)
        elif isinstance(msg, protocol.Heartbeat):
            pass  # its arrival is the news (a forgotten peer learns at its next claim, and says hello again)
        elif ident not in self._decodes:
            self._fail(ident, getattr(msg, "request_id", ""), "no handshake from this peer yet")
        elif isinstance(msg, protocol.TransferRequest):
            self._on_claim(ident, msg)
        elif isinstance(msg, protocol.Done):
            self._on_done(ident, msg)
        elif isinstance(msg, protocol.Abort):
            self._on_abort(msg)
        elif isinstance(msg, protocol.DigestQuery):
            plan = self._plans.get((ident, msg.request_id))
            known = len(plan.entries) if plan is not None else 0
            wanted = [i for i in msg.region_indices if 0 <= i < known][:MAX_PAGE_QUERIES]
            pages = {i: page_digests(plan, i, "src") for i in wanted} if plan is not None else {}
            self.server.send(ident, protocol.PageDigests(v=PROTOCOL_VERSION, request_id=msg.request_id, pages=pages))

    def _on_hello(self, ident: bytes, msg: protocol.Hello) -> None:
        t0 = time.monotonic()
        self._forget(ident, "it said hello again")
        try:
            peer = accept_hello(
                self.local.spec, msg, backend=self.local.transport.backend, role="decode", local_role="prefill"
            )
            for other in [d.identity for d in self._decodes.values() if d.agent == peer.agent_name]:
                self._forget(other, "its agent said hello on a new connection (a restart or a re-handshake)")
            agent = self.local.transport.add_peer(peer.agent_metadata, peer.spans)
            if agent != peer.agent_name:
                self.local.transport.remove_peer(agent)
                raise ProtocolError(f"decode {msg.engine_id} says agent {peer.agent_name!r}, its metadata {agent!r}")
        except GlmPdError as exc:
            logger.warning("glm-pd prefill: refused decode %s: %s", msg.engine_id, exc)
            self._fail(ident, "", str(exc))
            return
        self._decodes[ident] = _Decode(ident, peer, agent, time.monotonic())
        self.server.send(ident, self.local.hello(self.local.transport.metadata()))
        logger.info("glm-pd prefill: decode %s accepted in %.1f ms", msg.engine_id, (time.monotonic() - t0) * 1e3)

    def _on_claim(self, ident: bytes, msg: protocol.TransferRequest) -> None:
        if msg.request_id in self._gone:
            self._fail(
                ident, msg.request_id, f"prefill's lease on this request already ended: {self._gone[msg.request_id]}"
            )
            return
        if msg.request_id not in self._leases:
            # decode can ask before the engine hands the finished request over: hold the claim a while
            self._early_claims.setdefault((msg.request_id, ident), (msg, time.monotonic() + self.timeout_s))
            return
        decode = self._decodes[ident]
        try:
            self._leases.expect(msg.request_id, self._releases_from(decode))
            lease = self._leases.claim(msg.request_id, by=ident)
            own = suffix_pages(
                lease.pages,
                msg.num_tokens,
                msg.prefix_tokens,
                self.local.shape.page_tokens,
                align_tokens=decode.peer.shape.page_tokens,
            )
            if not np.array_equal(own, np.asarray(msg.src_pages, dtype=np.int64)):
                raise GlmPdError(f"request {msg.request_id}: decode's source pages are not the pages it holds")
            plan = build_plan(
                self.local.regions,
                decode.peer.regions,
                own,
                np.asarray(msg.dst_pages, dtype=np.int64),
                num_tokens=msg.num_tokens,
                prefix_tokens=msg.prefix_tokens,
            )
        except GlmPdError as exc:
            self._fail(ident, msg.request_id, str(exc))
            return
        if msg.verify:
            self._plans[ident, msg.request_id] = plan
        digests = plan_digests(plan, "src") if msg.verify else None
        self.server.send(
            ident,
            protocol.Claimed(v=PROTOCOL_VERSION, request_id=msg.request_id, digests=digests),
        )

    def _on_done(self, ident: bytes, msg: protocol.Done) -> None:
        # A dummy rank's first word may be a release: decode read another rank's copy of the same blocks.
        self._leases.expect(msg.request_id, self._releases_from(self._decodes[ident]))
        try:
            pages = self._leases.release(msg.request_id)
        except GlmPdError as exc:
            self._fail(ident, msg.request_id, str(exc))
            return
        self.server.send(ident, protocol.Released(v=PROTOCOL_VERSION, request_id=msg.request_id))
        if pages is not None:
            self._end(Finished(msg.request_id, "released"))

    def _on_abort(self, msg: protocol.Abort) -> None:
        if self._leases.drop(msg.request_id) is not None:
            self._end(Finished(msg.request_id, "aborted", msg.reason))
        for key in [k for k in self._early_claims if k[0] == msg.request_id]:
            del self._early_claims[key]
        self._drop_plans(msg.request_id)

    def _forget_silent(self, now: float) -> None:
        self._next_idle_check = now + min(1.0, self.peer_idle_s / 4)
        reading = self._leases.claimants()
        for d in [d for d in self._decodes.values() if now - d.last_seen > self.peer_idle_s]:
            if d.identity not in reading:
                self._forget(d.identity, f"silent for {now - d.last_seen:.1f} s, holding no claim on a live lease")

    def _forget(self, ident: bytes, why: str) -> None:
        """Drop a decode peer and what was kept for it (its agent, plans, early claims); leases stay."""
        decode = self._decodes.pop(ident, None)
        for key in [k for k in self._early_claims if k[1] == ident]:
            del self._early_claims[key]
        for plan_key in [k for k in self._plans if k[0] == ident]:
            del self._plans[plan_key]
        if decode is not None:
            self.local.transport.remove_peer(decode.agent)
            logger.info("glm-pd prefill: forgot decode %s: %s", decode.peer.engine_id, why)

    def _releases_from(self, decode: _Decode) -> int:
        return expected_releases(self.local.shape.tp_rank, self.local.shape.tp_size, decode.peer.shape.tp_size)

    def _fail(self, ident: bytes, request_id: str, reason: str) -> None:
        self.server.send(ident, protocol.Failed(v=PROTOCOL_VERSION, request_id=request_id, reason=reason))

    def _end(self, done: Finished) -> None:
        self._finished.put(done)
        self._gone[done.request_id] = done.outcome
        while len(self._gone) > 4096:
            self._gone.popitem(last=False)
        self._drop_plans(done.request_id)

    def _drop_plans(self, request_id: str) -> None:
        for key in [k for k in self._plans if k[1] == request_id]:
            del self._plans[key]

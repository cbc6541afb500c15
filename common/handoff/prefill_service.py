"""The prefill side of a handoff, engine-free: leases, the side channel, claims, releases, expiry.

One thread owns the side channel socket, the transport's notifications and the lease table, so none of
them is touched concurrently. The engine adapter talks to it through two thread-safe calls: ``grant``
(a finished request's pages, to hold for decode) and ``finished`` (requests whose pages may now be freed:
released by every decode rank that reads them, aborted, or expired).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from glm_pd_common.errors import GlmPdError
from glm_pd_common.handoff import protocol
from glm_pd_common.handoff.lease import LeaseTable
from glm_pd_common.handoff.peer import Endpoint, PeerView, accept_hello
from glm_pd_common.handoff.queues import drain
from glm_pd_common.handoff.sidechannel import SideChannelServer
from glm_pd_common.layout.checksum import page_digests, plan_digests
from glm_pd_common.layout.fingerprint import PROTOCOL_VERSION
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


class PrefillService:
    def __init__(
        self,
        local: Endpoint,
        *,
        host: str,
        port: int,
        lease_s: float,
        timeout_s: float,
    ) -> None:
        self.local = local
        self.timeout_s = timeout_s
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
        self.local.transport.notifs()  # drives the transport's progress (UCX needs the passive side to poll)
        try:
            ident, msg = self.server.recv(timeout_s=0.002)
        except GlmPdError as exc:
            if "no message" not in str(exc):
                logger.warning("glm-pd prefill: refused a side-channel message: %s", exc)
            return
        self._dispatch(ident, msg)

    def _dispatch(self, ident: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Query):
            self.server.send(ident, self.local.hello(b""))
        elif isinstance(msg, protocol.Hello):
            self._on_hello(ident, msg)
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
            wanted = [i for i in msg.region_indices if plan is not None and 0 <= i < len(plan.entries)][:8]
            pages = {i: page_digests(plan, i, "src") for i in wanted} if plan is not None else {}
            self.server.send(ident, protocol.PageDigests(v=PROTOCOL_VERSION, request_id=msg.request_id, pages=pages))

    def _on_hello(self, ident: bytes, msg: protocol.Hello) -> None:
        t0 = time.monotonic()
        try:
            peer = accept_hello(
                self.local.spec, msg, backend=self.local.transport.backend, role="decode", local_role="prefill"
            )
            self.local.transport.add_peer(peer.agent_metadata, peer.spans)
        except GlmPdError as exc:
            logger.warning("glm-pd prefill: refused decode %s: %s", msg.engine_id, exc)
            self._fail(ident, "", str(exc))
            return
        self._decodes[ident] = _Decode(ident, peer)
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
            lease = self._leases.claim(msg.request_id)
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
            protocol.Claimed(
                v=PROTOCOL_VERSION,
                request_id=msg.request_id,
                lease_s=self.timeout_s,
                num_bytes=plan.num_bytes,
                digests=digests,
            ),
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

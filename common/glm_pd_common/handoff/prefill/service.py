"""The prefill side of a handoff, engine-free: leases, the side channel, claims, releases, expiry.

One thread owns the side channel socket, the transport's notifications and the lease table, so none of
them is touched concurrently. The engine adapter talks to it through two thread-safe calls: ``grant``
(a finished request's pages, to hold for decode) and ``finished`` (requests whose pages may now be freed:
released by every decode rank that reads them, aborted, or expired). Every engine call wakes the thread, so it
is acted on at once, not when the thread's wait for decode's messages (a few ms) runs out.
GPU ordering: a grant may come with a ``ReadyEvent`` recorded after the GPU work that writes its pages. Until
the event completes no claim is answered (``Claimed`` is what lets decode read): a claim that arrives first
waits beside the grant, and the service thread polls the event once per loop turn (every few ms) rather
than blocking on it, so other requests are served meanwhile and every piece of state stays on this one
thread. The lease clock starts when the event completes, so a slow GPU never uses up decode's time; a grant
whose event has not completed within a lease ends as expired (a hung GPU must not hold pages forever).
Leases measure decode's time: every deadline here reads the service clock (``clock``), which stands still while this
thread is away (held up between two waits or inside one, as when the process is stopped), so every lease, pending
claim, unready grant, waiting subscription and decode's silence is held over by as long, and what queued meanwhile
is answered before leases expire.
A claim is answered at once; the digests a verifying claim asks for are computed on a digest thread (a long
request's runs are gigabytes) while decode reads, and sent when done, as is the answer to a decode's page-digest
query after a mismatch, so the service thread serves every other request meanwhile.
Decode renews the leases of requests still waiting for its blocks (``Renew``, ``renewing``).
A decode peer is kept while it is heard from (decode sends heartbeats while idle): a new hello from the
same agent (a restart, or a re-handshake after a failed load) replaces it, and a peer silent for
``peer_idle_s`` that holds no claim (on a live lease, or waiting for one) is forgotten; either way its agent
leaves the transport.
Streamed transfers (``streamed``): the engine announces a request that carries a transfer id (``open_stream``),
reports what each step wrote (``advance_stream``, with the step's ready event: a step's tokens are announced only
once the GPU work writing them has completed, in step order), and grants its lease as in pull, naming the
transfer. Subscribed decode ranks are sent each advance (``Progress``) and, once the lease is held, its id and
the whole page table; they read while prefill still runs and claim the lease for the rest (``streams``).
A staged read (``staged``) is opened by a claim that asks for slots, or by a subscriber's ``StreamRead`` over
tokens already announced; it ends with decode's ``Done`` or ``ReadDone``, or with its lease or transfer.
``leftovers`` counts what is held, so a harness can check that nothing leaks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from functools import partial

import numpy as np

from glm_pd_common.counted_log import CountedLog
from glm_pd_common.errors import GlmPdError, LeaseExpired
from glm_pd_common.handoff.at_exit import close_at_exit
from glm_pd_common.handoff.prefill.caps import DEFAULT_CAPS, PeerCaps
from glm_pd_common.handoff.prefill.clock import ServiceClock
from glm_pd_common.handoff.prefill.digesting import ClaimDigests, Digested, PagesDigested
from glm_pd_common.handoff.prefill.lease import Finished, Grant, Lease, LeaseState, LeaseTable
from glm_pd_common.handoff.prefill.pairing import claim_plan, expected_releases_from
from glm_pd_common.handoff.prefill.peers import DecodePeers, admit
from glm_pd_common.handoff.prefill.ready import ReadyEvent
from glm_pd_common.handoff.prefill.renewing import renew
from glm_pd_common.handoff.prefill.staged import GatherDone, StagedReads
from glm_pd_common.handoff.prefill.streams import Advance, Outgoing, StreamCall, StreamTable
from glm_pd_common.handoff.queues import drain
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import Endpoint
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION, FailureCode
from glm_pd_common.handoff.wire.sidechannel import SideChannelServer, SideChannelTimeout

logger = logging.getLogger(__name__)

_QUEUED_PER_TURN = 256  # messages answered before expiry each turn; more wait a turn (grants are not starved)


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
        streamed: bool = False,
        caps: PeerCaps = DEFAULT_CAPS,
    ) -> None:
        self.local = local
        self.caps = caps
        self.streamed = streamed
        self.timeout_s = timeout_s
        # Past this silence a decode is gone: a live one heartbeats while idle and claims within a lease. Three
        # missed heartbeats at least, so a busy host's late beat never costs a live decode its next request.
        if peer_idle_s is None:
            peer_idle_s = max(lease_s + timeout_s, 3 * protocol.HEARTBEAT_S)
        self.peer_idle_s = peer_idle_s
        self._next_idle_check = 0.0
        self._refusals = CountedLog(logger, "glm-pd prefill: refused %d side-channel message(s), the latest: %s")
        self._clock = ServiceClock()
        self.server = SideChannelServer(host, port, local.trust, caps.connections)
        self._leases = LeaseTable(ttl_s=lease_s, transfer_ttl_s=timeout_s, clock=self._clock.now)  # one per lease
        self._decodes = DecodePeers(caps.peers, peer_idle_s)
        # engine calls in order, and claims' digests back from their threads
        self._inbox: queue.SimpleQueue[Grant | StreamCall | Advance | Digested | PagesDigested | GatherDone] = (
            queue.SimpleQueue()
        )
        self._finished: queue.SimpleQueue[Finished] = queue.SimpleQueue()  # what the engine may free
        self._stop = threading.Event()
        # a claim's digests (seconds for a GPU region's copies) are computed here, never on the service thread
        self._digests = ClaimDigests(local.memory, local.engine_id, local.on_thread, self._deliver)
        self._staged = StagedReads(local.staging, local.engine_id, local.on_thread, self._deliver)  # staged reads
        # streamed transfers and their subscribers (a transfer's staged reads end with it)
        self._streams = StreamTable(timeout_s, self._clock.now, on_end=self._staged.close)
        self._thread = threading.Thread(target=self._run, name=f"glm-pd-prefill-{local.engine_id}", daemon=True)
        self._thread.start()
        self._withdraw_exit = close_at_exit(self.close)

    @property
    def port(self) -> int:
        return self.server.port

    # -- engine-facing, thread-safe ---------------------------------------------------------------
    def grant(self, request_id: str, pages: np.ndarray, ready: ReadyEvent | None = None) -> None:
        """Hold a finished request's full page table for decode. Its lease starts now, or with ``ready``
        once that event completes: no claim is answered before (the GPU may still be writing the pages)."""
        self._inbox.put(Grant(request_id, np.asarray(pages, dtype=np.int64), ready, None))
        self.server.wake()

    def open_stream(self, transfer_id: str, num_tokens: int) -> None:
        """A request carrying ``transfer_id`` arrived: decode ranks that subscribe wait for it while it runs."""
        self._inbox.put(StreamCall(transfer_id, num_tokens=num_tokens))
        self.server.wake()

    def advance_stream(
        self, transfer_id: str, new_pages: np.ndarray, ready_tokens: int, ready: ReadyEvent | None = None
    ) -> None:
        """A step wrote the transfer's first ``ready_tokens`` tokens, into its page table extended by
        ``new_pages``; announced to subscribers once ``ready`` completes."""
        self._inbox.put(Advance(transfer_id, np.asarray(new_pages, dtype=np.int64), ready_tokens, ready))
        self.server.wake()

    def end_stream(self, transfer_id: str, why: str) -> None:
        """The request will not finish as streamed (aborted, or preempted: its pages were freed)."""
        self._inbox.put(StreamCall(transfer_id, why=why))
        self.server.wake()

    def grant_stream(
        self, lease_id: str, transfer_id: str, pages: np.ndarray, num_tokens: int, ready: ReadyEvent | None = None
    ) -> None:
        """``grant`` for a streamed request of ``num_tokens``: subscribers are told the lease once it is held."""
        self._inbox.put(Grant(lease_id, np.asarray(pages, dtype=np.int64), ready, (transfer_id, num_tokens)))
        self.server.wake()

    def finished(self) -> list[Finished]:
        return drain(self._finished)

    def leftovers(self) -> dict[str, int]:
        """What this service holds now. Once every request has ended: ``leases``, ``unready`` (grants whose
        pages are not ready yet), ``early_claims`` and ``plans`` are 0, ``decode_peers`` is at most the
        decode ranks still connected, ``transport_peers`` equals ``decode_peers`` (one transport agent per
        decode peer), ``staging_pairs`` is 0. The ids of recently ended leases are kept apart, bounded (so a late
        claim fails fast)."""
        return {
            **self._leases.leftovers(),
            "staging_pairs": self._staged.held(),
            "streams": len(self._streams),
            "decode_peers": len(self._decodes),
            "transport_peers": len(self.local.transport.remote_peers()),
        }

    def close(self) -> None:
        self._withdraw_exit()
        self._stop.set()
        self.server.wake()
        self._thread.join(timeout=10)
        self._digests.close()
        self._staged.shutdown()
        self.server.close()

    # -- the service thread -----------------------------------------------------------------------
    def _run(self) -> None:
        self.local.on_thread()
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # the service must outlive any one bad peer or message
                logger.exception("glm-pd prefill service step failed")

    def _step(self) -> None:
        for call in drain(self._inbox):
            if isinstance(call, Grant):
                self._on_grant(call)
            elif isinstance(call, Digested):
                self._on_digested(call)
            elif isinstance(call, PagesDigested):
                self._digests.answered(call)
                self.server.send(call.ident, call.answer)
            elif isinstance(call, GatherDone):
                answer = self._staged.done(call)
                if answer is not None:
                    self.server.send(call.ident, answer)
            else:
                self._send_all(self._streams.take(call))
        self._poll_unready()
        self._send_all(self._streams.announce_ready())
        # What queued up while this thread was away is answered before leases expire.
        for _ in range(_QUEUED_PER_TURN):
            if not self._serve(timeout_s=0.0):
                break
        for lease in self._leases.expire():
            self._ended(lease, "expired", "lease expired before decode confirmed")
        for request_id, ident in self._leases.expire_waiting():  # an unready grant's claims wait for it
            self._fail(ident, request_id, "prefill holds no lease for this request", "lease_expired")
        now = self._clock.now()
        if now >= self._next_idle_check:
            self._forget_silent(now)
        self._send_all(self._streams.tick())
        self.local.transport.notifs()  # drives the transport's progress (UCX needs the passive side to poll)
        self._serve(timeout_s=0.002)

    def _serve(self, *, timeout_s: float) -> bool:
        """Answer one side-channel message, waiting at most ``timeout_s``; False when none came."""
        self._clock.checkpoint(then_wait_s=timeout_s)  # the wait is not time away; running past its end is
        try:
            ident, msg = self.server.recv(timeout_s=timeout_s)
        except SideChannelTimeout:
            return False
        except GlmPdError as exc:
            self._refusals.note(exc)  # a flood of undecodable frames is one log line a second
            return True
        finally:
            self._clock.checkpoint()
        self._decodes.seen(ident, self._clock.now())
        self._dispatch(ident, msg)
        return True

    def _dispatch(self, ident: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Query):
            self.server.send(ident, self.local.hello(b""))
        elif isinstance(msg, protocol.Hello):
            self._on_hello(ident, msg)
        elif isinstance(msg, protocol.Heartbeat):
            pass  # its arrival is the news (a forgotten peer learns at its next claim, and says hello again)
        elif isinstance(msg, protocol.Renew):
            self._on_renew(ident, msg)
        elif ident not in self._decodes:
            self._fail(ident, getattr(msg, "request_id", ""), "no handshake from this peer yet", "refused_peer")
        elif isinstance(msg, protocol.TransferRequest):
            self._on_claim(ident, msg)
        elif isinstance(msg, protocol.Subscribe):
            self._on_subscribe(ident, msg)
        elif isinstance(msg, protocol.Done):
            self._on_done(ident, msg)
        elif isinstance(msg, protocol.Abort):
            self._on_abort(ident, msg)
        elif isinstance(msg, protocol.Gather):
            self._on_gather(ident, msg)
        elif isinstance(msg, protocol.StreamRead):
            self._on_stream_read(ident, msg)
        elif isinstance(msg, protocol.ReadDone):
            self._staged.close(msg.request_id, ident)
        elif isinstance(msg, protocol.DigestQuery):
            self._on_digest_query(ident, msg)

    def _on_digest_query(self, ident: bytes, msg: protocol.DigestQuery) -> None:
        """Per-page digests of the plan this decode claimed, answered from a digest thread."""
        if not self._digests.query(ident, msg, self._leases.plan(msg.request_id, ident)):
            why = "this decode's page-digest query of that request is still being answered"
            self._fail(ident, msg.request_id, why, "invalid_params")

    def _on_subscribe(self, ident: bytes, msg: protocol.Subscribe) -> None:
        full = self._streams.subscriptions() >= self.caps.subscriptions
        if not self.streamed:
            self._fail(ident, msg.request_id, "this prefill runs without streamed transfers", "refused_peer")
        elif full and not self._streams.subscribed(ident, msg.request_id):
            why = f"prefill serves at most {self.caps.subscriptions} streamed subscriptions at once"
            self._fail(ident, msg.request_id, why, "refused_peer")
        else:
            self._send_all(self._streams.subscribe(ident, msg, self._decodes.engine(ident)))

    def _on_hello(self, ident: bytes, msg: protocol.Hello) -> None:
        t0 = time.monotonic()
        if why := admit(self._decodes, self.local, ident, msg, self._clock.now(), self._forget):
            logger.warning("glm-pd prefill: refused decode %s: %s", protocol.clip(msg.engine_id, 80), why)
            self._fail(ident, "", why, "refused_peer")
            return
        self.server.send(ident, self.local.hello(self.local.transport.metadata()))
        logger.info("glm-pd prefill: decode %s accepted in %.1f ms", msg.engine_id, (time.monotonic() - t0) * 1e3)

    def _on_grant(self, grant: Grant) -> None:
        lease = self._leases.get(grant.lease_id)
        if lease is not None and lease.state is not LeaseState.AWAITED:
            # Two live requests under one id cannot both be served safely: neither is.
            self._end(grant.lease_id, "aborted", "a second request arrived under the same id", tell_waiting="aborted")
            return
        lease = self._leases.grant(grant.lease_id, grant.pages, ready=grant.ready, stream=grant.stream)
        if lease.state is LeaseState.HELD:
            self._held(lease)

    def _poll_unready(self) -> None:
        """Start the lease of every grant whose pages the GPU has finished writing; end the failed and hung ones."""
        ready, ended = self._leases.poll_ready()
        for lease in ready:
            self._leases.hold(lease)
            self._held(lease)
        for lease, outcome, why in ended:
            code: FailureCode = "aborted" if outcome == "aborted" else "lease_expired"
            self._end(lease.request_id, outcome, why, tell_waiting=code)

    def _held(self, lease: Lease) -> None:
        """The pages are final and leased (the clock started): a streamed request's subscribers learn the lease now
        (one decode gave up on ends here), and the claims that came first are answered."""
        if lease.stream is not None:
            live, out = self._streams.finish(lease.stream[0], lease.request_id, lease.pages, lease.stream[1])
            if not live:
                why = f"decode gave up on streamed transfer {lease.stream}"
                self._end(lease.request_id, "aborted", why, tell_waiting="aborted")
                return
            self._send_all(out)
        for ident, early in self._leases.take_waiting(lease):
            if isinstance(early, protocol.Done):
                self._on_done(ident, early)
            else:
                self._on_claim(ident, early)

    def _send_all(self, out: Outgoing) -> None:
        for ident, msg in out:
            self.server.send(ident, msg)

    def _on_renew(self, ident: bytes, msg: protocol.Renew) -> None:
        """Extend the unclaimed leases decode still waits on; anything else is ignored (renewal is unanswered)."""
        if ident not in self._decodes:
            logger.debug("glm-pd prefill: ignored a renewal of %d lease(s) from an unknown peer", len(msg.request_ids))
            return
        renew(self._leases, self._streams, self._decodes.engine(ident), msg.request_ids)

    def _on_claim(self, ident: bytes, msg: protocol.TransferRequest) -> None:
        if msg.request_id in self._leases.ended:
            self._gone(ident, msg.request_id, "prefill's lease on this request already ended")
            return
        held = self._leases.held(msg.request_id)
        if held is None:
            # decode can ask before the engine hands the finished request over (or before the GPU finished
            # writing its pages): the claim waits a while
            self._wait(ident, msg, len(msg.src_pages) + len(msg.dst_pages))
            return
        decode = self._decodes[ident]
        if not self._leases.may_act(msg.request_id, self._decodes.engine(ident)):
            self._not_theirs(ident, msg.request_id)
            return
        staged = self._staged.refusal(ident, msg.request_id, msg.slot_bytes) if msg.slot_bytes else ""
        if staged:
            self._fail(ident, msg.request_id, staged, "invalid_params")
            return
        try:
            plan = claim_plan(self.local, decode.peer, held.pages, msg)
            # Only a claim for the pages the lease holds moves it: a wrong one is refused and changes nothing.
            self._leases.expect(msg.request_id, expected_releases_from(self.local, decode.peer))
            self._leases.claim(msg.request_id, by=ident, owner=decode.peer.engine_id)
        except GlmPdError as exc:
            code: FailureCode = "lease_expired" if isinstance(exc, LeaseExpired) else "invalid_params"  # pages, plan
            self._fail(ident, msg.request_id, str(exc), code)
            return
        if msg.slot_bytes:
            self._staged.open(ident, msg.request_id, plan, msg.slot_bytes)
        self.server.send(ident, protocol.Claimed(v=PROTOCOL_VERSION, request_id=msg.request_id))
        if msg.verify:  # digested while decode reads (the pages are held and no longer written)
            self._leases.keep_plan(msg.request_id, ident, plan)
            self._digests.submit(ident, msg.request_id, plan)  # sent when they are back (``_on_digested``)

    def _on_stream_read(self, ident: bytes, msg: protocol.StreamRead) -> None:
        """A subscriber reads tokens already announced of its streamed transfer in slots: the claim's rule over
        the pages announced so far, none past the tokens written."""
        seen = self._streams.readable(ident, msg.request_id)
        plan_of = partial(claim_plan, self.local, self._decodes[ident].peer)
        if seen is None:
            self._fail(ident, msg.request_id, "this decode holds no subscription to that transfer", "refused_peer")
        elif why := self._staged.open_stream(ident, msg, *seen, plan_of):
            self._fail(ident, msg.request_id, why, "invalid_params")

    def _on_gather(self, ident: bytes, msg: protocol.Gather) -> None:
        """Decode asks for a slot of its staged read: only the claimant of a live claimed lease, or a subscriber
        of the streamed transfer, is served."""
        if not self._leases.claimed_by(msg.request_id, ident) and self._streams.readable(ident, msg.request_id) is None:
            self._gone(ident, msg.request_id, "no claimed lease or subscription of this decode")
        elif why := self._staged.ask(ident, msg):
            self._fail(ident, msg.request_id, why, "invalid_params")

    def _deliver(self, done: Digested | PagesDigested | GatherDone) -> None:
        """On a digest or gather thread: the answer goes out from the service thread."""
        self._inbox.put(done)
        self.server.wake()

    def _on_digested(self, done: Digested) -> None:
        """Send a claim's digests, if its lease is still claimed by that decode rank (one that ended meanwhile is
        failed as it ended: the claimant waits for the digests)."""
        if self._leases.claimed_by(done.answer.request_id, done.ident):
            self.server.send(done.ident, done.answer)
        else:
            self._gone(done.ident, done.answer.request_id, "prefill's lease on this request already ended")

    def _wait(self, ident: bytes, msg: protocol.TransferRequest | protocol.Done, pages: int) -> None:
        """Keep a message that came before its grant, within the caps (refused by name past them, kept never)."""
        mine, held = self._leases.waiting_load(ident)
        if mine >= self.caps.early_claims or held + pages > self.caps.early_pages:
            why = (
                f"prefill keeps at most {self.caps.early_claims} claims per decode, and {self.caps.early_pages} "
                f"page ids in all, waiting for their grants (this decode has {mine}, all hold {held})"
            )
            self._fail(ident, msg.request_id, why, "refused_peer")
            return
        self._leases.wait(msg.request_id, ident, msg, self.timeout_s)

    def _on_done(self, ident: bytes, msg: protocol.Done) -> None:
        if msg.request_id not in self._leases.ended and self._leases.held(msg.request_id) is None:
            # a decode that needs no bytes (its whole prompt hit, or vLLM skipped the read) confirms at once,
            # possibly before the engine hands the finished request over: it waits as a claim does
            self._wait(ident, msg, 0)
            return
        if not self._leases.may_act(msg.request_id, self._decodes.engine(ident)):
            self._not_theirs(ident, msg.request_id)
            return
        # A dummy rank's first word may be a release: decode read another rank's copy of the same blocks.
        self._leases.expect(msg.request_id, expected_releases_from(self.local, self._decodes[ident].peer))
        self._staged.close(msg.request_id, ident)  # its read is over: the slot pair goes back
        try:
            released = self._leases.release(msg.request_id)
        except LeaseExpired as exc:
            self._fail(ident, msg.request_id, str(exc), "lease_expired")
            return
        self.server.send(ident, protocol.Released(v=PROTOCOL_VERSION, request_id=msg.request_id))
        if released is not None:
            self._ended(released, "released")

    def _on_abort(self, ident: bytes, msg: protocol.Abort) -> None:
        """A decode gives up on a lease or a streamed transfer of its own; one not granted yet loses only this
        decode's waiting message, and another decode's is refused (nothing changes)."""
        engine = self._decodes.engine(ident)
        lease = self._leases.get(msg.request_id)
        if not self._leases.may_act(msg.request_id, engine) or not self._streams.owned(msg.request_id, engine):
            self._not_theirs(ident, msg.request_id)
            return
        if lease is not None and lease.state is LeaseState.AWAITED and msg.request_id not in self._streams:
            self._leases.withdraw(msg.request_id, ident)
            return
        if self.streamed and (lease is None or lease.state is LeaseState.AWAITED):
            # a transfer id decode gave up on: its subscribers are told; a lease granted for it ends below, one
            # still to come ends when it is held
            lease_id = self._streams.lease_of(msg.request_id)
            self._send_all(self._streams.end(msg.request_id, f"decode aborted it: {msg.reason}"))
            if lease_id:
                msg = protocol.Abort(v=msg.v, request_id=lease_id, reason=msg.reason)
        self._end(msg.request_id, "aborted", msg.reason)  # claims that waited for it are dropped

    def _forget_silent(self, now: float) -> None:
        self._next_idle_check = now + min(1.0, self.peer_idle_s / 4)
        reading = self._leases.awaiting_answer()
        for d in self._decodes.silent(now):
            if d.identity not in reading:
                self._forget(d.identity, f"silent for {now - d.last_seen:.1f} s, holding no claim")

    def _forget(self, ident: bytes, why: str) -> None:
        """Drop a decode peer and what was kept for it (its agent, plans, waiting claims); leases stay."""
        decode = self._decodes.pop(ident)
        self._streams.drop_subscriber(ident)
        self._staged.drop_peer(ident)
        self._leases.forget_peer(ident)
        if decode is not None:
            self.local.transport.remove_peer(decode.agent)
            logger.info("glm-pd prefill: forgot decode %s: %s", decode.peer.engine_id, why)

    def _not_theirs(self, ident: bytes, request_id: str) -> None:
        why = f"request {protocol.clip(request_id, 80)} was granted to another decode; this one may not act on it"
        self._fail(ident, request_id, why, "refused_peer")

    def _gone(self, ident: bytes, request_id: str, what: str) -> None:
        """Fail a message about a lease this decode no longer holds claimed, saying how the lease ended."""
        ended = self._leases.ended.get(request_id)
        code: FailureCode = "aborted" if ended == "aborted" else "lease_expired"
        self._fail(ident, request_id, f"{what}: {ended or 'it is not claimed by this decode'}", code)

    def _fail(self, ident: bytes, request_id: str, reason: str, code: FailureCode) -> None:
        failed = protocol.Failed(v=PROTOCOL_VERSION, request_id=request_id, reason=protocol.clip(reason), code=code)
        self.server.send(ident, failed)

    def _end(self, request_id: str, outcome: str, why: str, *, tell_waiting: FailureCode | None = None) -> None:
        """End a lease whatever its state (an id never granted: only what waited for it goes). ``tell_waiting``:
        the claims that waited for it are failed with that code, not dropped."""
        lease = self._leases.get(request_id)
        if lease is None:
            return
        granted = lease.state is not LeaseState.AWAITED
        self._leases.end(request_id, outcome)
        if tell_waiting is not None:
            for ident in lease.waiting:
                self._fail(ident, request_id, f"prefill's lease on this request ended: {why}", tell_waiting)
        if granted:
            self._ended(lease, outcome, why)

    def _ended(self, lease: Lease, outcome: str, why: str = "") -> None:
        """An ended lease's pages may be freed: the engine is told, and so are its stream's subscribers."""
        self._finished.put(Finished(lease.request_id, outcome, why))
        self._staged.close(lease.request_id)
        if lease.stream is not None:
            self._streams.lease_ended(lease.request_id)

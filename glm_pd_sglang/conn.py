"""The ``glm-pd`` transfer backend's manager on SGLang's ``CommonKVManager`` (sender etc.: endpoints.py).

SGLang's common classes keep what SGLang users rely on: the bootstrap server and its routes, rooms and
``KVPoll``, the rank mapping (one MLA source rank per decode rank, dummies for the rest), heartbeats,
timeouts, abort notices and their drain ACKs. glm-pd adds what a GLM-5.x handoff needs:
- registration carries glm-pd's hello, so a decode rank whose layout differs (row bytes, scale format,
  layer set, MTP) is refused at once, naming every field and both values;
- the main MLA KV and the DSA indexer move through the core plan (coalesced runs, layer order), pushed by
  prefill (WRITE) over Mooncake or NIXL; decode's page ids are bounds-checked before any byte moves;
- the aux metadata row lands before Success is reported, and optional digests are checked before decode
  sees Success.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification, CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from glm_pd_common.errors import ConfigError, GlmPdError, PlanError, ProtocolError
from glm_pd_common.handoff import protocol
from glm_pd_common.handoff.peer import Endpoint, PeerView, accept_hello
from glm_pd_common.layout import checksum
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.memory import reader_for
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.transport.base import Span, TransportConfig, create_transport
from glm_pd_sglang import wire
from glm_pd_sglang.config import GlmPdSglangConfig
from glm_pd_sglang.kvargs import rank_caches
from glm_pd_sglang.model import model_geometry, scale_format
from glm_pd_sglang.rooms import Target, aux_runs, check_aux, check_suffix, int_pages

logger = logging.getLogger(__name__)

_POLL_MS = 100
_MAX_DECODE_RANKS = 256  # decode attention-TP ranks one prefill rank may serve for a room


@dataclass
class _DecodePeer:
    view: PeerView
    aux: list[Span]


@dataclass
class _Chunk:
    room: int
    pages: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None
    state_pages: np.ndarray | None


class GlmPdKVManager(CommonKVManager):
    """One rank's glm-pd agent: prefill pushes planned runs; decode announces its caches and verifies."""

    kv_status_msg_tag = wire.TAG_STATUS
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        if not is_mla_backend:
            raise ConfigError("the glm-pd backend moves MLA (DSA) caches; this model's KV pool is not MLA")
        self.glm_config = GlmPdSglangConfig.from_env()
        device = str(getattr(server_args, "device", "cuda") or "cuda")
        self.caches = rank_caches(
            args,
            model_geometry(server_args, self.glm_config.model_revision),
            scale_format=scale_format(self.glm_config, device),
            mem_kind="DRAM" if device == "cpu" else "VRAM",
            device_id=int(getattr(args, "gpu_id", 0) or 0),
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._peers: dict[str, _DecodePeer] = {}
        self._refused: dict[tuple[str, int], str] = {}
        self._pending_failures: dict[int, str] = {}
        self._expected_pages: dict[int, int] = {}
        self._sent_pages: dict[int, list[np.ndarray]] = {}
        self._digests: dict[int, wire.Digests] = {}
        self.refusals: dict[int, str] = {}
        self.stats: dict[str, float] = {}
        # Test hook: a room whose last indexer page gets one byte flipped after it lands, before
        # verification (what a faulty link or a stray writer would leave behind).
        self.corrupt_next_room: int | None = None
        # Test hook: room -> "error" | "hang", applied to that room's first posted batch (common/transport).
        self.test_transfer_faults: dict[int, str] = {}
        # Rooms prefill aborted whose decode ranks are told once no write of theirs is outstanding.
        self._prefill_aborts: dict[int, list[tuple[str, int]]] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.defer_decode_allocation:
            raise ConfigError("glm-pd does not implement --disaggregation-decode-allocation-policy prefill_complete")
        mode = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        name = f"glmpd-{mode}-{self.local_ip}-{self.rank_port}"
        transport = create_transport(
            name,
            TransportConfig(
                backend=self.glm_config.transport,
                host=self.local_ip,
                allow_tcp=self.glm_config.allow_tcp,
                timeout_s=self.glm_config.timeout_s,
                devices=str(getattr(args, "ib_device", "") or ""),
            ),
        )
        transport.register([*self.caches.regions, *self.caches.aux])
        self.endpoint = Endpoint(
            name,
            self.caches.spec,
            self.caches.regions,
            transport,
            PeerShape(self.caches.page_tokens, self.attn_tp_size, self.attn_tp_rank),
            reader_for((r.mem_kind for r in self.caches.regions), torch),
        )
        self.transport = transport
        logger.info("glm-pd %s rank %s: %s", mode, self.attn_tp_rank, transport.info().data_path)
        if mode == "prefill":
            self._queue: queue.Queue[_Chunk] = queue.Queue()
            self._threads = [
                threading.Thread(target=self._prefill_loop, name="glm-pd-bootstrap", daemon=True),
                threading.Thread(target=self._transfer_loop, name="glm-pd-transfer", daemon=True),
            ]
        else:
            self._threads = [threading.Thread(target=self._decode_loop, name="glm-pd-listener", daemon=True)]
            self._threads.append(self._start_heartbeat_checker_thread())
        for t in self._threads:
            if not t.is_alive():
                t.start()

    # -- both sides --------------------------------------------------------------------------------
    def leftovers(self) -> dict[str, int]:
        """Per-room state still held (every map must be empty once every room is cleared)."""
        names = ["request_status", "_expected_pages", "_sent_pages", "_digests", "_pending_failures", "_prefill_aborts"]
        names += ["transfer_infos", "req_to_decode_prefix_len"] if hasattr(self, "transfer_infos") else []
        held = {n: len(getattr(self, n)) for n in names}
        held["_staging_outstanding"] = sum(1 for v in self._staging_outstanding.values() if v)
        return held

    def close(self) -> None:
        """Stop the threads and free the transport (tests and shutdown; SGLang has no manager close)."""
        self._stop.set()
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._heartbeat_shutdown.set()
        for t in self._threads:
            t.join(timeout=5)
        self.transport.close()
        self.server_socket.close(linger=0)

    def _add_stat(self, key: str, value: float) -> None:
        with self._lock:
            self.stats[key] = self.stats.get(key, 0) + value

    def _recv_loop(self, handle: Any, *, poll_ms: int, progress: bool) -> None:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if progress:
                self.transport.notifs()  # NIXL without a progress thread: peers' WRITEs need ours
            if not poller.poll(poll_ms):
                continue
            msg = self.server_socket.recv_multipart()
            try:
                handle(msg)
            except GlmPdError as exc:
                logger.error("glm-pd: refused a message (first frame %r): %s", msg[0][:32] if msg else b"", exc)
            except Exception:
                logger.exception("glm-pd: failed to handle a message (first frame %r)", msg[0][:32] if msg else b"")

    # -- decode: registration, room messages, listener, verification ---------------------------------
    def build_receiver_registration_message(self) -> list[bytes]:
        hello = self.endpoint.hello(self.transport.metadata())
        aux = [
            wire.AuxBuffer(s.base_addr, s.size_bytes, n)
            for s, n in zip(self.caches.aux, self.caches.aux_item_lens, strict=True)
        ]
        reg = wire.Registration(
            protocol.encode(hello), self.local_ip, self.rank_port, int(self.kv_args.engine_rank), aux
        )
        return wire.frames(wire.TAG_REGISTER, reg)

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: np.ndarray,
        aux_index: int | None,
        state_indices: list | None,
        decode_prefix_len: int | None,
        is_dummy: bool,
        device_kv_indices: np.ndarray | None = None,
    ) -> list[bytes]:
        state = None if state_indices is None else state_indices[self.caches.dsa_component]
        room = wire.Room(
            room=int(bootstrap_room),
            agent_name=self.transport.agent_name,
            decode_ip=self.local_ip,
            decode_port=self.rank_port,
            dst_pages=[] if is_dummy else np.asarray(kv_indices, dtype=np.int64).tolist(),
            dst_state_pages=None if is_dummy or state is None else np.asarray(state, dtype=np.int64).tolist(),
            aux_index=None if aux_index is None else int(aux_index),
            decode_prefix_len=int(decode_prefix_len or 0),
            required_dst_info_num=int(required_dst_info_num),
            is_dummy=bool(is_dummy),
        )
        return wire.frames(wire.TAG_ROOM, room)

    def _decode_loop(self) -> None:
        self._recv_loop(
            self._on_decode_message, poll_ms=1 if self.transport.backend == "nixl" else _POLL_MS, progress=True
        )

    def _on_decode_message(self, msg: list[bytes]) -> None:
        if self.handle_abort_ack_message(msg):
            return
        tag = msg[0] if msg else b""
        if tag == wire.TAG_REFUSED:
            refused = wire.parse(msg, wire.Refused)
            logger.error("glm-pd: %s", refused.reason)
            self.refusals[refused.prefill_rank] = refused.reason
            return
        if tag == wire.TAG_DIGESTS:
            digests = wire.parse(msg, wire.Digests)
            if digests.room in self.request_status:
                self._digests[digests.room] = digests
            return
        parsed = self.parse_kv_status_message(msg)
        if parsed is not None:
            room, status, rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason)

    def verify_room(self, room: int, pages: np.ndarray) -> str | None:
        """Compare what landed with prefill's digests; returns the problem, or None when every region matches."""
        sent = self._digests.pop(room, None)
        if self.corrupt_next_room == room and pages.size:
            self.corrupt_next_room = None
            region = self.caches.regions[-1]
            checksum.flip_byte(region, int(pages[-1]) * region.page_stride, self.endpoint.memory)
        if sent is None:
            return "glm-pd checksum verification is on, but prefill sent no digests (is it verifying too?)"
        mine = self._region_digests(pages)
        if sent.regions != [name for name, _ in mine]:
            return f"digest regions differ: prefill {len(sent.regions)}, decode {len(mine)}"
        for (name, got), want in zip(mine, sent.digests, strict=True):
            if got != want:
                return f"checksum mismatch in {name} region: decode {got:#018x}, prefill {want:#018x}"
        return None

    def _region_digests(self, pages: np.ndarray) -> list[tuple[str, int]]:
        return [(r.name, checksum.region_pages_digest(r, pages, self.endpoint.memory)) for r in self.caches.regions]

    # -- prefill: registration, rooms, aborts --------------------------------------------------------
    def _prefill_loop(self) -> None:
        self._recv_loop(self._on_prefill_message, poll_ms=_POLL_MS, progress=False)

    def _on_prefill_message(self, msg: list[bytes]) -> None:
        tag = msg[0] if msg else b""
        if tag == ABORT_TAG:
            self._on_abort(msg)
        elif tag == wire.TAG_REGISTER:
            self._on_register(wire.parse(msg, wire.Registration))
        elif tag == wire.TAG_ROOM:
            self._on_room(wire.parse(msg, wire.Room))
        else:
            logger.warning("glm-pd prefill: dropping a message with unknown first frame %r", tag[:32])

    def _on_register(self, reg: wire.Registration) -> None:
        key = (reg.decode_ip, reg.decode_port)
        peer = f"{reg.decode_ip}:{reg.decode_port}"
        try:
            hello = protocol.decode(reg.hello)
            if not isinstance(hello, protocol.Hello):
                raise ProtocolError(f"registration carries a {type(hello).__name__}, not a hello")
            view = accept_hello(
                self.endpoint.spec, hello, backend=self.transport.backend, role="decode", local_role="prefill"
            )
            if view.shape.page_tokens != self.caches.page_tokens:
                raise ConfigError(
                    f"page size differs: prefill {self.caches.page_tokens}, decode {view.shape.page_tokens} tokens "
                    "(SGLang pairs pages one to one; set the same --page-size on both)"
                )
            aux = check_aux(self.caches.aux_item_lens, [(a.ptr, a.data_len, a.item_len) for a in reg.aux], peer=peer)
            if hello.agent_name in self._peers:
                self.transport.remove_peer(hello.agent_name)
            self.transport.add_peer(hello.agent_metadata, [*view.spans, *aux])
        except GlmPdError as exc:
            reason = f"glm-pd prefill rank {self._prefill_unique_rank()} refused decode {peer} at registration: {exc}"
            logger.error(reason)
            self._refused[key] = reason
            self._send_multipart_locked(
                NetworkAddress(reg.decode_ip, reg.decode_port).to_tcp(),
                wire.frames(wire.TAG_REFUSED, wire.Refused(self._prefill_unique_rank(), reason)),
            )
            return
        self._peers[hello.agent_name] = _DecodePeer(view, aux)
        self._refused.pop(key, None)
        logger.info("glm-pd prefill: decode %s registered (tp %s/%s)", peer, view.shape.tp_rank, view.shape.tp_size)

    def _on_room(self, m: wire.Room) -> None:
        key = (m.decode_ip, m.decode_port)
        if key in self._refused:
            self._fail_room(m.room, self._refused[key], key)
            return
        if m.agent_name not in self._peers:
            self._fail_room(m.room, f"decode {m.agent_name} sent room {m.room} before registering", key)
            return
        try:
            pages = int_pages(m.dst_pages, what="decode page ids")
            if not 1 <= m.required_dst_info_num <= _MAX_DECODE_RANKS:
                raise ProtocolError(f"room {m.room} expects {m.required_dst_info_num} decode ranks")
        except GlmPdError as exc:
            self._fail_room(m.room, f"glm-pd refused room {m.room}: {exc}", key)
            return
        if not m.is_dummy:
            try:
                check_suffix(
                    m.decode_prefix_len,
                    pages,
                    int_pages(m.dst_state_pages, what="decode DSA state page ids"),
                    self.caches.page_tokens,
                    side=f"decode {m.decode_ip}:{m.decode_port}",
                )
            except GlmPdError as exc:
                self._fail_room(m.room, f"glm-pd refused room {m.room}: {exc}", key)
                return
        target = Target(
            m.agent_name,
            m.decode_ip,
            m.decode_port,
            m.is_dummy,
            m.required_dst_info_num,
            pages,
            m.aux_index,
            m.decode_prefix_len,
        )
        infos = self.transfer_infos.setdefault(m.room, {})
        infos[m.agent_name] = target
        if len(infos) == m.required_dst_info_num:
            self.req_to_decode_prefix_len[m.room] = m.decode_prefix_len
            self.resolve_kv_replica_factor(infos)
            self.update_status(m.room, KVPoll.WaitingForInput)

    def _fail_room(self, room: int, reason: str, target: tuple[str, int]) -> None:
        """Fail a room on both sides, whether or not prefill's scheduler has created its sender yet."""
        logger.error("glm-pd: %s", reason)
        self.record_failure(room, reason)
        if room in self.request_status:
            self.update_status(room, KVPoll.Failed)
        else:
            self._pending_failures[room] = reason
        self.send_kv_status_message(targets=[target], bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)

    def _on_abort(self, msg: list[bytes]) -> None:
        notice = AbortNotification.from_zmq(msg)
        if notice is None:
            return
        room = notice.room
        if room in self.request_status and self.request_status[room] != KVPoll.Success:
            with self.failure_lock:
                self.failure_records.setdefault(room, "Aborted by decode")
            self.update_status(room, KVPoll.Failed)
        ack = notice.deferred_ack_target
        if ack is not None:
            self.register_deferred_ack_target(room, ack)
            self._maybe_ack_drained_abort(room)

    def prefill_aborted(self, room: int) -> None:
        """Prefill aborted a room: its decode ranks must fail it now, not at their waiting timeout, but only
        once no write into their pages is still in flight (they free those pages on Failed)."""
        infos = self.transfer_infos.get(room) or {}
        with self._lock:
            self._prefill_aborts[room] = [(t.endpoint, t.dst_port) for t in infos.values()]
        self._maybe_tell_decode_of_abort(room)

    def _maybe_tell_decode_of_abort(self, room: int) -> None:
        with self._lock:
            if self._staging_outstanding.get(room, 0) > 0 or room not in self._prefill_aborts:
                return
            targets = self._prefill_aborts.pop(room)
        self.send_kv_status_message(
            targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason="prefill aborted the request"
        )

    # -- prefill: transfers --------------------------------------------------------------------------
    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: np.ndarray,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        **_unused: Any,
    ) -> None:
        """Queue one chunk for the transfer thread (the scheduler never waits on the wire)."""
        if bootstrap_room not in self.transfer_infos:
            return
        state = None if state_indices is None else int_pages(state_indices[self.caches.dsa_component], what="DSA pages")
        pages = int_pages(kv_indices, what="prefill page ids")
        with self._lock:
            self._staging_outstanding[bootstrap_room] += 1  # holds Success and any drain ACK until written
        self._queue.put(_Chunk(bootstrap_room, pages.copy(), index_slice, is_last_chunk, aux_index, state))

    def _transfer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                chunk = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            try:
                self._run_chunk(chunk)
            finally:
                with self._lock:
                    left = self._staging_outstanding.get(chunk.room, 0) - 1
                    if left > 0:
                        self._staging_outstanding[chunk.room] = left
                    else:
                        self._staging_outstanding.pop(chunk.room, None)
                self._maybe_ack_drained_abort(chunk.room)
                self._maybe_tell_decode_of_abort(chunk.room)

    def _run_chunk(self, c: _Chunk) -> None:
        infos = self.transfer_infos.get(c.room)
        if not infos or self.request_status.get(c.room) in (None, KVPoll.Failed):
            return
        self.update_status(c.room, KVPoll.Transferring)
        started = time.perf_counter()
        try:
            sent = self._sent_pages.setdefault(c.room, [])
            sent.append(c.pages)
            whole = np.concatenate(sent) if c.is_last else c.pages  # the whole suffix matters only at the end
            for target in list(infos.values()):
                if not target.is_dummy:
                    self._write_chunk(target, c, whole)
            if c.is_last:
                self._sent_pages.pop(c.room, None)
                self._add_stat("seconds", time.perf_counter() - started)
                self.conclude_transfer(bootstrap_room=c.room, status=KVPoll.Success)
        except Exception as exc:
            self._sent_pages.pop(c.room, None)
            self._add_stat("failures", 1)
            reason = f"glm-pd prefill rank {self._prefill_unique_rank()}: {type(exc).__name__}: {exc}"
            logger.error(reason)
            self.conclude_failure(bootstrap_room=c.room, failure_reason=reason)

    def _write_chunk(self, t: Target, c: _Chunk, sent: np.ndarray) -> None:
        """Push one chunk's main KV (and, on the last chunk, the indexer and metadata row) to one decode rank."""
        peer = self._peers.get(t.agent_name)
        if peer is None:
            raise ProtocolError(f"decode {t.agent_name} is no longer registered")
        expected = self._expected_pages.get(c.room)
        if expected is not None and expected != t.dst_pages.size:
            raise PlanError(
                f"suffix mismatch: decode's prefix of {t.decode_prefix_len} tokens leaves {t.dst_pages.size} pages "
                f"to fill, but prefill's suffix from the same prefix has {expected} pages"
            )
        page = self.caches.page_tokens
        start, stop = c.index_slice.start, c.index_slice.start + c.pages.size
        if stop > t.dst_pages.size:
            raise PlanError(f"prefill sends pages {start}..{stop} of a suffix decode sized {t.dst_pages.size}")
        whole = c.is_last and start == 0
        if c.pages.size:
            kinds = ("main", "indexer") if whole else ("main",)
            self._post_plan(
                c.room, t, peer, kinds, c.pages, t.dst_pages[start:stop], t.decode_prefix_len + start * page
            )
        if c.is_last:
            if c.state_pages is None or not np.array_equal(c.state_pages, sent):
                raise PlanError(
                    "prefill's DSA state pages are not its main KV suffix pages; the indexer would be misplaced"
                )
            if not whole and sent.size:
                self._post_plan(c.room, t, peer, ("indexer",), sent, t.dst_pages, t.decode_prefix_len)
            self._post_aux(t, peer, c.aux_index)
            if self.glm_config.verify_checksums:
                names, digests = zip(*self._region_digests(sent), strict=True) if sent.size else ((), ())
                self._send_multipart_locked(
                    NetworkAddress(t.endpoint, t.dst_port).to_tcp(),
                    wire.frames(wire.TAG_DIGESTS, wire.Digests(c.room, list(names), list(digests))),
                )

    def _post_plan(
        self,
        room: int,
        t: Target,
        peer: _DecodePeer,
        kinds: tuple[str, ...],
        src: np.ndarray,
        dst: np.ndarray,
        first_token: int,
    ) -> None:
        mine = [r for r in self.caches.regions if r.kind in kinds]
        theirs = [r for r in peer.view.regions if r.kind in kinds]
        page = self.caches.page_tokens
        plan = build_plan(mine, theirs, src, dst, num_tokens=first_token + src.size * page, prefix_tokens=first_token)
        xfer = self.transport.post_plan(t.agent_name, plan, "WRITE")
        xfer.test_fault = self.test_transfer_faults.pop(room, "")
        self._wait(xfer)
        self._count(plan)

    def _post_aux(self, t: Target, peer: _DecodePeer, aux_index: int | None) -> None:
        if aux_index is None or t.aux_index is None:
            raise PlanError("the last chunk carries no metadata slot; decode could not tell the request landed")
        src, dst, lengths = aux_runs(self.caches.aux, peer.aux, self.caches.aux_item_lens, aux_index, t.aux_index)
        self._wait(self.transport.post(t.agent_name, "WRITE", src, dst, lengths, what="metadata row"))
        self._add_stat("aux_bytes", float(lengths.sum()))

    def _wait(self, xfer: Any) -> None:
        try:
            self.transport.wait(xfer, self.glm_config.timeout_s)
        finally:
            self.transport.release(xfer)

    def _count(self, plan: TransferPlan) -> None:
        for kind, n in plan.bytes_by_kind().items():
            self._add_stat(f"{kind}_bytes", n)
        for kind, n in plan.runs_by_kind().items():
            self._add_stat(f"{kind}_runs", n)

"""The ``glm-pd`` transfer backend's manager on SGLang's ``CommonKVManager`` (sender etc.: endpoints.py).

SGLang's common classes keep what SGLang users rely on: the bootstrap server and its routes, rooms and
``KVPoll``, the rank mapping (one MLA source rank per decode rank, dummies for the rest), heartbeats,
timeouts, abort notices and their drain ACKs. glm-pd adds what a GLM-5.x handoff needs:
- registration carries glm-pd's hello, so a decode rank whose layout differs (row bytes, scale format,
  layer set, MTP) is refused at once, naming every field and both values;
- the main MLA KV and the DSA indexer move through the core plan (coalesced runs, layer order), pushed by
  prefill (WRITE) over Mooncake or NIXL on one lane per decode peer, each chunk only after SGLang's events
  for it completed (transfer.py); decode's page ids are bounds-checked before any byte moves;
- the aux metadata row lands before Success is reported, and optional digests are checked before decode
  sees Success;
- SGLang's memory release / resume drops and rebuilds the registrations, and peers learn the new ones;
- prefill context parallelism (parallel.py): under DSA CP layer split a rank describes and sends only its
  layers, and decode checks that SGLang reads each layer from the rank glm-pd's pairing picks.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import requests
import torch
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification, CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.common import get_device_capability
from sglang.srt.utils.network import get_zmq_socket_on_host

from glm_pd_common.errors import ConfigError, GlmPdError
from glm_pd_common.handoff.at_exit import close_at_exit
from glm_pd_common.handoff.faults import HandoffFaults
from glm_pd_common.handoff.lanes import LanePool
from glm_pd_common.handoff.recent import RecentIds
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import Endpoint, hello_proof
from glm_pd_common.handoff.wire.trust import KEEP_ALIVE, Gate, Trust
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.shards import owned_layers
from glm_pd_common.transport.base import TransportConfig
from glm_pd_common.transport.devices import thread_device
from glm_pd_common.transport.factory import create_transport
from glm_pd_common.transport.staging import torch_staging
from glm_pd_common.transport.torch_memory import reader_for
from glm_pd_sglang import wire
from glm_pd_sglang.admission import PrefillAdmission
from glm_pd_sglang.bootstrap_auth import authorization
from glm_pd_sglang.config import GlmPdSglangConfig
from glm_pd_sglang.devices import rank_ib_devices
from glm_pd_sglang.kvargs import rank_caches
from glm_pd_sglang.model import model_geometry, scale_format
from glm_pd_sglang.parallel import AttentionRanks, check_routing, refuse_unsupported
from glm_pd_sglang.registrations import Registrations, agent_name
from glm_pd_sglang.staged import Lending, Mailbox, StagedLanding, StagedPush
from glm_pd_sglang.transfer import DecodePeer, PrefillTransfers
from glm_pd_sglang.verify import RoomVerification

logger = logging.getLogger(__name__)

_POLL_MS = 100
TRANSFER_LANES = 8  # transfer threads per prefill rank; more decode peers than this share lanes
REGISTER_TRIES = 5  # a prefill rank's registration: the bootstrap server may still be starting


class GlmPdKVManager(PrefillAdmission, PrefillTransfers, StagedPush, StagedLanding, RoomVerification, CommonKVManager):
    """One rank's glm-pd agent: prefill pushes planned runs; decode announces its caches and verifies."""

    endpoint: Endpoint
    server_socket: zmq.Socket  # SGLang's receiving socket (made again, authenticated, with a credential)
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
        self.trust = Trust.from_settings(self.glm_config.credential, self.glm_config.insecure)
        self._gate: Gate | None = None  # the authenticator and connection count of this rank's authenticated socket
        refuse_unsupported(get_parallel(), envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get())
        self._server_args = server_args
        self.geometry = model_geometry(server_args, self.glm_config.model_revision)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._peers: dict[str, DecodePeer] = {}
        self._refused = RecentIds()  # prefill: decode agents whose registration was refused -> why
        self._pending_failures: dict[int, str] = {}
        self._expected_pages: dict[int, int] = {}
        self._sent_pages: dict[int, list[np.ndarray]] = {}
        self._digests: dict[int, list[wire.Digests]] = {}
        self.refusals: dict[int, str] = {}
        self.stats: dict[str, float] = {}
        # A test's fault injector (SGLang builds the manager, so the test hands it over here); None in production.
        self.faults: HandoffFaults | None = None
        # Rooms prefill aborted whose decode ranks are told once no write of theirs is outstanding.
        self._prefill_aborts: dict[int, list[tuple[str, int]]] = {}
        self._registrations = Registrations(self.glm_config.decode_peers)  # prefill: accepted decode ranks
        self._session = secrets.token_bytes(32)  # decode: this process's key for its registrations' proofs
        self._transport_lock = threading.RLock()  # the transport is swapped on memory release / resume
        self._slot_mail = Mailbox()  # prefill: decode's answers to its staged pushes
        self._room_pages: dict[int, np.ndarray] = {}  # decode: each room's pages, where staged slots may land
        self._lent: dict[tuple[int, int], Lending] = {}  # decode: staging pairs lent per (room, prefill rank)
        self._resting: list[tuple[float, int]] = []  # decode: pairs of rooms cleared mid-push, and until when
        self._released = False
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.defer_decode_allocation:
            raise ConfigError("glm-pd does not implement --disaggregation-decode-allocation-policy prefill_complete")
        mode = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        self._authenticate_sockets()  # prefill's was, before it registered with the bootstrap server
        self._agent_name = agent_name(mode, self.local_ip, self.rank_port)  # kept across memory release / resume
        self._open_transport(args)
        if mode == "prefill":
            self._lanes = LanePool(
                f"glm-pd-transfer-{self.attn_tp_rank}",
                self._lane_job,
                count=TRANSFER_LANES,
                start=self.endpoint.on_thread,
            )
            self._threads = [threading.Thread(target=self._prefill_loop, name="glm-pd-bootstrap", daemon=True)]
        else:
            self._threads = [threading.Thread(target=self._decode_loop, name="glm-pd-listener", daemon=True)]
            # digests of what landed are computed here, never on SGLang's scheduler thread (receivers' poll)
            self._verifier = ThreadPoolExecutor(
                1, thread_name_prefix=f"glm-pd-verify-{self.attn_tp_rank}", initializer=self.endpoint.on_thread
            )
            self._threads.append(self._start_heartbeat_checker_thread())
        for t in self._threads:
            if not t.is_alive():
                t.start()
        self._withdraw_exit = close_at_exit(self.close)

    def register_to_bootstrap(self) -> None:
        """SGLang's registration of this prefill rank, its address being that of the authenticated socket."""
        self._authenticate_sockets()
        super().register_to_bootstrap()

    def _register_topology_row(self, url: str, payload: dict) -> None:
        """SGLang's PUT of this prefill rank's registration, presenting the deployment's token (the bootstrap
        server takes registrations from holders only); without a credential, SGLang's own. A refusal is not
        retried: this rank and the server hold different credentials, and decodes could never find the rank."""
        if not self.trust.authenticated:
            super()._register_topology_row(url, payload)
            return
        problem = ""
        for attempt in range(REGISTER_TRIES):
            if attempt:
                time.sleep(min(2.0**attempt, 8.0))
            try:
                response = requests.put(url, json=payload, headers=authorization(self.trust), timeout=5)
            except requests.RequestException as exc:
                problem = str(exc)
                continue
            if response.status_code == 200:
                return
            if response.status_code == 401:
                raise ConfigError(
                    f"the bootstrap server {url} refused prefill rank {self._prefill_unique_rank()}'s registration "
                    f"({response.text[:200]}): give it and every rank of this instance the same "
                    "SGLANG_GLM_PD_CREDENTIAL"
                )
            problem = f"HTTP {response.status_code} {response.text[:200]}"
        logger.error(
            "glm-pd prefill rank %s could not register with the bootstrap server %s (%d tries): %s",
            self._prefill_unique_rank(),
            url,
            REGISTER_TRIES,
            problem,
        )

    def _authenticate_sockets(self) -> None:
        """With the deployment's credential, this rank's messages (registrations, rooms, statuses, aborts) travel
        only between its holders: SGLang's own receiving socket is made again, by SGLang's own function, as a CURVE
        server admitting the deployment's key, and every socket this manager's context opens afterwards (SGLang's
        sends to its peers) is a client of such servers. Without one, an address off loopback is refused unless
        ``SGLANG_GLM_PD_INSECURE``."""
        self.trust.check_host(self.local_ip, "SGLang's disaggregation address (local_ip)")
        if not self.trust.authenticated or self._gate is not None:
            return
        ctx = self._zmq_ctx
        server: dict[int, int | bytes] = {**self.trust.server_options(), **KEEP_ALIVE}  # strangers go within 5 s
        for option, value in server.items():
            ctx.setsockopt(option, value)
        try:
            port, sock = get_zmq_socket_on_host(ctx, zmq.PULL, host=self.local_ip)
        finally:
            for option in server:
                ctx.sockopts.pop(option, None)
        # guarded before any peer learns the address (SGLang registers it with the bootstrap server afterwards)
        self._gate = self.trust.guard(ctx, sock, self.glm_config.connections, f"sglang-{port}")
        self.server_socket.close(linger=0)
        self.server_socket, self.rank_port = sock, port
        for option, value in self.trust.client_options().items():
            ctx.setsockopt(option, value)

    def _open_transport(self, args: Any) -> None:
        """Describe this rank's caches from ``args`` (SGLang's KVArgs) and register them with a new transport."""
        device = str(getattr(self._server_args, "device", "cuda") or "cuda")
        prefill = self.disaggregation_mode == DisaggregationMode.PREFILL
        # Decode runs without CP (SGLang asserts it); a prefill rank under layer split holds its layer shard only.
        self.ranks = AttentionRanks(
            self.attn_tp_size, self.attn_cp_size, prefill and bool(get_parallel().enable_dsa_cache_layer_split)
        )
        rank = self.ranks.rank(self.attn_cp_rank, self.attn_tp_rank)
        sharding, g = self.ranks.sharding, self.geometry
        gpu_id = int(getattr(args, "gpu_id", 0) or 0)
        held = None
        if self.ranks.splits_layers:
            # Only the last shard lists the draft's caches, so the others learn whether there is an MTP cache
            # (it is part of the fingerprint) from the drafter's flag, not from KVArgs.
            if not getattr(self._server_args, "speculative_algorithm", None):
                g = replace(g, num_mtp_layers=0)
            held = owned_layers(g.num_layers, g.num_mtp_layers, sharding, rank, self.ranks.num_ranks)
        self.caches = rank_caches(
            args,
            g,
            scale_format=scale_format(
                self.glm_config, device, get_device_capability(gpu_id) if device == "cuda" else (None, None)
            ),
            mem_kind="DRAM" if device == "cpu" else "VRAM",
            device_id=gpu_id,
            held=held,
        )
        mode = "prefill" if prefill else "decode"
        name = self._agent_name
        transport = create_transport(
            name,
            TransportConfig(
                backend=self.glm_config.transport,
                host=self.local_ip,
                allow_tcp=self.glm_config.allow_tcp,
                timeout_s=self.glm_config.timeout_s,
                devices=rank_ib_devices(getattr(args, "ib_device", None), gpu_id),
                posts="WRITE" if prefill else None,  # prefill pushes; decode's pages are only written
            ),
        )
        transport.register([*self.caches.regions, *self.caches.aux])
        staging = torch_staging(
            torch,
            transport,
            self.caches.regions,
            size_bytes=self.glm_config.staging_mib << 20,
            slot_bytes=self.glm_config.staging_slot_kib << 10,
            mode=self.glm_config.staging,
        )
        with self._lock:  # pairs lent from the buffer this replaces are gone with it
            self._lent.clear()
            self._resting.clear()
        shape = PeerShape(self.caches.page_tokens, self.ranks.num_ranks, rank, sharding=sharding)
        memory = reader_for(self.caches.regions, torch)
        on_device = thread_device(self.caches.regions, torch)
        self.endpoint = Endpoint(
            name, self.caches.spec, self.caches.regions, transport, shape, memory, on_device, self.trust, staging
        )
        self.transport = transport
        logger.info("glm-pd %s rank %s: %s", mode, self.attn_tp_rank, transport.info().data_path)

    # -- memory release / resume (SGLang's release_memory_occupation / resume_memory_occupation) -----
    def deregister_buffer_to_engine(self) -> None:
        """SGLang releases the KV memory: drop every registration of it, and the peers loaded against them.
        A room still moving bytes fails; rooms that arrive before the resume are refused."""
        with self._transport_lock:
            if self._released:
                return
            self._released = True
            self.transport.close()
            self._peers.clear()
        logger.info("glm-pd rank %s: KV memory released, transport registrations dropped", self.attn_tp_rank)

    def register_buffer_to_engine(self) -> None:
        """SGLang resumed the KV memory: register it again from ``kv_args`` (its addresses may have moved),
        then peers learn them: prefill reloads every decode rank registered so far; decode registers anew
        with each prefill ahead of its next room (on the socket that room's message then takes)."""
        with self._transport_lock:  # held while decode ranks are reloaded: a registration arriving now waits
            if not self._released:
                self.transport.close()
            self._open_transport(self.kv_args)
            self._released = False
            if self.disaggregation_mode == DisaggregationMode.PREFILL:
                for reg in self._registrations.all():
                    self._on_register(reg)
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self.connection_pool.clear()  # the next receiver of each prefill fetches it and registers again

    # -- both sides --------------------------------------------------------------------------------
    def leftovers(self) -> dict[str, int]:
        """Per-room state still held (every map must be empty once every room is cleared)."""
        names = ["request_status", "_expected_pages", "_sent_pages", "_digests", "_pending_failures", "_prefill_aborts"]
        names += ["_room_pages", "_lent", "_slot_mail"]
        names += ["transfer_infos", "req_to_decode_prefix_len"] if hasattr(self, "transfer_infos") else []
        held = {n: len(getattr(self, n)) for n in names}
        held["_staging_outstanding"] = sum(1 for v in self._staging_outstanding.values() if v)
        return held

    def close(self) -> None:
        """Stop the threads and free the transport (tests, and this process's exit: SGLang has no manager
        close)."""
        self._withdraw_exit()
        self._stop.set()
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._heartbeat_shutdown.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self._lanes.close(timeout_s=5)
        else:
            self._verifier.shutdown(wait=True, cancel_futures=True)
        with self._transport_lock:
            if not self._released:
                self.transport.close()
        self.server_socket.close(linger=0)
        if self._gate is not None:
            self._gate.close()

    def _add_stat(self, key: str, value: float) -> None:
        with self._lock:
            self.stats[key] = self.stats.get(key, 0) + value

    def _recv_loop(self, handle: Any, *, poll_ms: int, progress: bool) -> None:
        self.endpoint.on_thread()
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if progress:
                with self._transport_lock:
                    if not self._released:
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
    def build_receiver_registration_message(self, prefill: tuple[str, int] | None = None) -> list[bytes]:
        """This rank's registration with the prefill rank at ``prefill`` (host, port), proving this process to it
        (``hello_proof``): only this process can register again under this rank's agent name there."""
        proof = b"" if prefill is None else hello_proof(self._session, f"{prefill[0]}:{prefill[1]}")
        hello = self.endpoint.hello(self.transport.metadata(), proof)
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
        if tag == wire.TAG_SLOT_ASK:
            self._on_slot_ask(wire.parse(msg, wire.SlotAsk))
            return
        if tag == wire.TAG_SLOT_LANDED:
            self._on_slot_landed(wire.parse(msg, wire.SlotLanded))
            return
        if tag == wire.TAG_DIGESTS:  # one per prefill rank this rank reads (several under layer split)
            digests = wire.parse(msg, wire.Digests)
            with self._lock:  # against the receiver's clear: a room's digests never outlive it
                if digests.room in self.request_status:
                    self._digests.setdefault(digests.room, []).append(digests)
            return
        parsed = self.parse_kv_status_message(msg)
        if parsed is not None:
            room, status, rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason)

    def _resolve_rank_mapping(self, info: Any) -> None:
        """SGLang's mapping, checked against glm-pd's pairing (a mismatch is refused as SGLang refuses a page size
        mismatch here: the rank could never load a whole cache)."""
        super()._resolve_rank_mapping(info)
        check_routing(info, self.attn_tp_rank, self.attn_tp_size, self.geometry)

    # -- prefill: registration, rooms, aborts --------------------------------------------------------
    def _prefill_loop(self) -> None:
        self._recv_loop(self._on_prefill_message, poll_ms=_POLL_MS, progress=False)

    def _on_prefill_message(self, msg: list[bytes]) -> None:
        tag = msg[0] if msg else b""
        if tag == ABORT_TAG:
            self._on_abort(msg)
        elif tag == wire.TAG_REGISTER:
            with self._transport_lock:
                self._on_register(wire.parse(msg, wire.Registration))
        elif tag == wire.TAG_ROOM:
            self._on_room(wire.parse(msg, wire.Room))
        elif tag == wire.TAG_SLOT_LENT:
            self._slot_mail.put(wire.parse(msg, wire.SlotLent))
        elif tag == wire.TAG_SLOT_FREE:
            self._slot_mail.put(wire.parse(msg, wire.SlotFree))
        else:
            logger.warning("glm-pd prefill: dropping a message with unknown first frame %r", tag[:32])

    def _on_abort(self, msg: list[bytes]) -> None:
        notice = AbortNotification.from_zmq(msg)
        if notice is None:
            return
        room = notice.room
        if room in self.request_status and self.request_status[room] != KVPoll.Success:
            with self.failure_lock:
                self.failure_records.setdefault(room, "Aborted by decode")
            self.update_status(room, KVPoll.Failed)
        ack = notice.deferred_ack_target()
        if ack is not None:
            self.register_deferred_ack_target(room, ack)
            self._maybe_ack_drained_abort(room)

"""Prefill's transfer path: SGLang's chunks -> per-peer lanes -> planned WRITEs into decode's pages.

SGLang hands ``add_transfer_request`` a chunk whose bytes (and, when the sender takes host-tensor page ids,
the page ids themselves) may still be being written on the GPU: with overlap scheduling the early send of a
cached prefix carries a ``wait_event`` behind the previous forward, and host page ids an ``indices_event``
behind their device-to-host copy. The scheduler must not block on them, so the chunk is queued as given and
its lane synchronizes both events before any byte or page id of the chunk is read, digested or posted.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.utils.network import NetworkAddress

from glm_pd_common.errors import PlanError, ProtocolError, TransferFailed
from glm_pd_common.handoff.faults import HandoffFaults
from glm_pd_common.handoff.lanes import LanePool
from glm_pd_common.handoff.wire.handshake import PeerView
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.layout.tp import SideLayout, source_for
from glm_pd_common.transport.base import Span, Transfer
from glm_pd_sglang import wire
from glm_pd_sglang.rooms import Target, aux_runs, int_pages

logger = logging.getLogger(__name__)


@dataclass
class DecodePeer:
    """A registered decode rank as prefill knows it: its regions and its metadata buffers."""

    view: PeerView
    aux: list[Span]


@dataclass
class Chunk:
    """One ``add_transfer_request`` call as SGLang made it; nothing in it is read before its events complete."""

    room: int
    kv_indices: Any  # page ids: a numpy array, or a host tensor filled once ``indices_event`` completes
    index_slice: slice
    is_last: bool
    aux_index: int | None
    state_indices: list | None
    wait_event: Any = None  # the KV bytes of these pages are written once it completes
    indices_event: Any = None  # ``kv_indices`` holds the page ids once it completes


def lane_key(targets: dict[str, Target]) -> str:
    """A room's destination: the decode ranks it writes to (all of them share its lane)."""
    return ",".join(sorted(name for name, t in targets.items() if not t.is_dummy))


class PrefillTransfers:
    """The prefill half of ``GlmPdKVManager`` (mixed in ahead of SGLang's ``CommonKVManager``)."""

    # Set by the manager / CommonKVManager.
    caches: Any
    geometry: Any
    ranks: Any
    attn_cp_rank: int
    attn_tp_rank: int
    glm_config: Any
    transport: Any
    transfer_infos: dict[int, dict[str, Target]]
    request_status: Any
    _staging_outstanding: dict[int, int]
    _peers: dict[str, DecodePeer]
    _lock: threading.Lock
    _expected_pages: dict[int, int]
    _sent_pages: dict[int, list[np.ndarray]]
    _prefill_aborts: dict[int, list[tuple[str, int]]]
    faults: HandoffFaults | None
    _lanes: LanePool[Chunk]
    _released: bool

    if TYPE_CHECKING:  # CommonKVManager's and the manager's (a stub here would shadow them in the MRO)

        def update_status(self, bootstrap_room: int, status: KVPoll) -> None: ...
        def conclude_transfer(self, *, bootstrap_room: int, status: KVPoll) -> None: ...
        def conclude_failure(self, *, bootstrap_room: int, failure_reason: str) -> None: ...
        def send_kv_status_message(self, **kwargs: Any) -> None: ...
        def _send_multipart_locked(self, endpoint: str, message: list[bytes]) -> None: ...
        def _maybe_ack_drained_abort(self, room: int) -> None: ...
        def _prefill_unique_rank(self) -> int: ...
        def _add_stat(self, key: str, value: float) -> None: ...
        def _region_digests(self, pages: np.ndarray) -> list[tuple[str, int]]: ...
        def _push_staged(self, room: int, t: Target, theirs: Any, plan: TransferPlan) -> bool: ...

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        *,
        wait_event: Any = None,
        indices_event: Any = None,
        **_unused: Any,  # trace_ctx
    ) -> None:
        """Queue one chunk on its destination's lane; the scheduler never waits on an event or the wire."""
        infos = self.transfer_infos.get(bootstrap_room)
        if not infos:
            return  # a dummy rank for this room (already Success), or a room that never bootstrapped
        with self._lock:
            self._staging_outstanding[bootstrap_room] += 1  # holds Success and any drain ACK until written
        chunk = Chunk(bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index, state_indices)
        chunk.wait_event, chunk.indices_event = wait_event, indices_event
        self._lanes.submit(lane_key(infos), chunk)

    def _lane_job(self, chunk: Chunk) -> None:
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

    def _live(self, room: int) -> bool:
        return bool(self.transfer_infos.get(room)) and self.request_status.get(room) not in (None, KVPoll.Failed)

    def _run_chunk(self, c: Chunk) -> None:
        try:
            # Before any byte or page id is read: the forward writing these pages (a failed room skips the
            # wait, as nothing of it will be read), then the copy filling the page ids.
            if c.wait_event is not None and self._live(c.room):
                c.wait_event.synchronize()
            if c.indices_event is not None:
                c.indices_event.synchronize()
            if not self._live(c.room):
                return
            if self._released:
                raise TransferFailed("the KV memory was released (SGLang release_memory_occupation)")
            self.update_status(c.room, KVPoll.Transferring)
            started = time.perf_counter()
            pages = int_pages(np.asarray(c.kv_indices), what="prefill page ids").copy()
            state = None
            if c.state_indices is not None:
                state = int_pages(np.asarray(c.state_indices[self.caches.dsa_component]), what="DSA state pages")
            sent = self._sent_pages.setdefault(c.room, [])
            sent.append(pages)
            whole = np.concatenate(sent) if c.is_last else pages  # checked and digested at the end
            for target in list(self.transfer_infos[c.room].values()):
                if not target.is_dummy:
                    self._write_chunk(target, c, pages, state, whole)
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

    def _write_chunk(self, t: Target, c: Chunk, pages: np.ndarray, state: np.ndarray | None, sent: np.ndarray) -> None:
        """Push one chunk's main KV and indexer (and, on the last chunk, the metadata row) to one decode rank.

        SGLang hands the DSA state pages only with the last chunk (``_send_kv_chunk``), as the main KV suffix
        pages of the same row (``suffix_page_indices``): each chunk's indexer therefore moves with its own main
        pages, so a finished chunk lands whole on decode, and the last chunk's state pages must equal every page
        sent (``sent``), or the indexer went to the wrong pages.
        """
        peer = self._peers.get(t.agent_name)
        if peer is None:
            raise ProtocolError(f"decode {t.agent_name} is no longer registered")
        expected = self._expected_pages.get(c.room)
        if expected is not None and expected != t.dst_pages.size:
            raise PlanError(
                f"suffix mismatch: decode's prefix of {t.decode_prefix_len} tokens leaves {t.dst_pages.size} pages "
                f"to fill, but prefill's suffix from the same prefix has {expected} pages"
            )
        layers = self._layers_for(peer)
        page = self.caches.page_tokens
        start, stop = c.index_slice.start, c.index_slice.start + pages.size
        if stop > t.dst_pages.size:
            raise PlanError(f"prefill sends pages {start}..{stop} of a suffix decode sized {t.dst_pages.size}")
        if c.is_last and (state is None or not np.array_equal(state, sent)):
            raise PlanError(
                "prefill's DSA state pages are not its main KV suffix pages; the indexer would be misplaced"
            )
        if pages.size:
            first_token = t.decode_prefix_len + start * page
            self._post_plan(c.room, t, peer, ("main", "indexer"), layers, pages, t.dst_pages[start:stop], first_token)
        if c.is_last:
            self._post_aux(t, peer, c.aux_index)
            if self.glm_config.verify_checksums:
                names, digests = zip(*self._region_digests(sent), strict=True) if sent.size else ((), ())
                self._send_multipart_locked(
                    NetworkAddress(t.endpoint, t.dst_port).to_tcp(),
                    wire.frames(wire.TAG_DIGESTS, wire.Digests(c.room, list(names), list(digests))),
                )

    def _layers_for(self, peer: DecodePeer) -> tuple[int, ...]:
        """The layers this rank writes to a decode rank SGLang paired it with: the core's pairing, which must
        pick this rank (SGLang's decode checked its side of the same pairing before it sent the room)."""
        shape = peer.view.shape
        decode = SideLayout.of_shape(shape, self.geometry)
        prefill = self.ranks.layout(self.geometry)
        rank = self.ranks.pairing_rank(self.attn_cp_rank, self.attn_tp_rank)
        source = None if rank is None else source_for(rank, shape.tp_rank, prefill, decode)
        if source is None:
            raise PlanError(
                f"SGLang paired decode rank {shape.tp_rank}/{shape.tp_size} with prefill CP rank "
                f"{self.attn_cp_rank} TP rank {self.attn_tp_rank}, which glm-pd's pairing does not read from"
            )
        return source.layers

    def _post_plan(
        self,
        room: int,
        t: Target,
        peer: DecodePeer,
        kinds: tuple[str, ...],
        layers: tuple[int, ...],
        src: np.ndarray,
        dst: np.ndarray,
        first_token: int,
    ) -> None:
        mine = [r for r in self.caches.regions if r.kind in kinds]
        theirs = [r for r in peer.view.regions if r.kind in kinds]
        if not any(r.layer_id in layers for r in mine + theirs):
            return  # e.g. the indexer of a layer shard without full layers
        page = self.caches.page_tokens
        plan = build_plan(
            mine, theirs, src, dst, num_tokens=first_token + src.size * page, prefix_tokens=first_token, layers=layers
        )
        if self.faults is not None:
            self.faults.at(str(room), "posting")
        if self._push_staged(room, t, peer.view.staging, plan):
            return
        xfer = self.transport.post_plan(t.agent_name, plan, "WRITE")
        self._wait(xfer)
        self._count(plan, xfer)

    def _post_aux(self, t: Target, peer: DecodePeer, aux_index: int | None) -> None:
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

    def _count(self, plan: TransferPlan, xfer: Transfer) -> None:
        """Bytes as the transport reported them moved (a batch that failed moved none); runs as planned."""
        moved = xfer.completed_bytes_by_kind
        for kind in plan.bytes_by_kind():
            self._add_stat(f"{kind}_bytes", moved.get(kind, 0))
        for kind, n in plan.runs_by_kind().items():
            self._add_stat(f"{kind}_runs", n)

    # -- aborts ---------------------------------------------------------------------------------------
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

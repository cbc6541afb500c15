"""Scheduler side of ``GlmPdConnector``: kv_transfer_params out on prefill, loads in on decode.

Prefill: a finished ``do_remote_decode`` request keeps its blocks (delay free) and hands the router the
params; the worker is told to lease those blocks. Decode: validated params plus the local prefix hit
become a load of the suffix only; the scheduler parks the request until the worker reports it.

Streamed (``streamed``): prefill's leg carries a transfer id, and decode's leg arrives at the same time with the
same id. Prefill tells its workers, each step, which blocks the step writes and how many prompt tokens will then
be computed (vLLM's own ``SchedulerOutput``: new and cached requests' block ids, tokens scheduled); the workers
announce them once the step's writes are done. A streamed request that is preempted or aborted on prefill ends
its transfer (its blocks were freed). Decode admits a streamed request as any other and reads while prefill runs;
an aborted one's load is cancelled.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import RequestStatus

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.decode.loads import RemotePrefill
from glm_pd_common.handoff.wire.protocol import renew_interval
from glm_pd_vllm.addresses import RankAddress, rank_hosts
from glm_pd_vllm.config import GlmPdVllmConfig
from glm_pd_vllm.model import context_parallel
from glm_pd_vllm.params import KvTransferParams, StreamParams, decode_params, transfer_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def engine_port(vllm_config: VllmConfig, base: int) -> int:
    """This engine's first side-channel port; TP rank r listens on it + r. Sibling data-parallel engines on one
    node get the same base from one config, so each takes the next ``tp_size`` ports (vLLM has already made their
    engine ids distinct, ``<id>_dp<rank>``)."""
    parallel = vllm_config.parallel_config
    return base + parallel.data_parallel_index * parallel.tensor_parallel_size


@dataclass
class LoadSpec:
    """One decode load, as the worker needs it (plain values: metadata crosses process boundaries)."""

    request_id: str  # a load with ``read`` is reported to vLLM when it ends; a release-only one never is
    remote: RemotePrefill | None  # None: the params were refused (``error`` says why)
    local_block_ids: list[int]
    num_tokens: int
    prefix_tokens: int
    read: bool = True
    error: str = ""
    remote_request_id: str = ""  # prefill's id for the request (streamed: the transfer id)
    remote_block_ids: list[int] = field(default_factory=list)  # streamed: none yet, prefill sends them as it runs
    stream_id: str = ""  # a streamed request's transfer id: prefill's shape is learnt from its rank 0
    queued_at: float = field(default_factory=time.monotonic)  # one clock for scheduler and workers (one host)


@dataclass
class Renewal:
    """Decode asks one prefill engine to keep the leases of requests still waiting in vLLM's queue."""

    remote: RemotePrefill
    remote_request_ids: list[str]


@dataclass
class Grant:
    """Prefill: a finished request's blocks to lease (and, streamed, the transfer its decode reads)."""

    request_id: str  # vLLM's
    blocks: list[int]
    transfer_id: str = ""
    num_tokens: int = 0


@dataclass
class _Streaming:
    """Prefill: a streamed request vLLM runs, and how much of it the workers were told of."""

    transfer_id: str
    num_tokens: int  # its prompt
    blocks_told: int = 0
    broken: str = ""  # why the transfer ended early (its blocks were freed)


@dataclass
class GlmPdMetadata(KVConnectorMetadata):
    grants: dict[str, Grant] = field(default_factory=dict)  # prefill: lease id -> what to lease
    # prefill, streamed: transfers opened (id -> prompt tokens), this step's (new blocks, tokens written once the
    # step is done), transfers ended early (id -> why)
    opened: dict[str, int] = field(default_factory=dict)
    progress: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)
    loads: list[LoadSpec] = field(default_factory=list)  # decode: loads to start
    renewals: list[Renewal] = field(default_factory=list)  # decode: leases to keep while requests wait
    cancels: list[str] = field(default_factory=list)  # decode: streamed loads whose requests vLLM aborted
    idle: bool = False  # the step schedules no tokens: the worker may wait for a load to end (``idle_wait_s``)


class GlmPdScheduler:
    def __init__(self, vllm_config: VllmConfig, config: GlmPdVllmConfig, engine_id: str) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size  # tokens of one block on one rank
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.sharding = context_parallel(vllm_config)
        # tokens one block id spans: vLLM's scheduler deals each block's tokens out over the DCP ranks
        self.block_tokens = self.block_size * self.sharding.token_shards
        self.port = engine_port(vllm_config, config.side_channel_port)
        kv = vllm_config.kv_transfer_config
        self.is_producer, self.is_consumer = kv.is_kv_producer, kv.is_kv_consumer
        self._meta = GlmPdMetadata()
        self._rank_hosts: tuple[str, ...] = ()  # each prefill rank's host, once the workers published them
        # id -> (remote, prefix, error)
        self._pending: dict[str, tuple[KvTransferParams | StreamParams | None, int, str]] = {}
        # decode: requests vLLM holds whose load has not started; prefill's leases are renewed for them
        self._waiting: dict[str, KvTransferParams | StreamParams] = {}
        self._streaming: dict[str, _Streaming] = {}  # prefill: vLLM's request id -> its streamed transfer
        self._renew_every = renew_interval(config.lease_s)  # prefill's lease_s: both sides share the config
        self._next_renewal = time.monotonic() + self._renew_every

    def set_rank_addresses(self, metadata: dict[int, Any]) -> None:
        """Prefill: every rank's side-channel host, from the workers' handshake metadata (one per TP rank), for
        decode to dial each rank where it is. Streamed params name one host: a streamed instance whose ranks
        span hosts is refused here, at start-up."""
        if not self.is_producer:
            return
        addresses = {rank: m for rank, m in metadata.items() if isinstance(m, RankAddress)}
        hosts = rank_hosts(addresses, self.tp_size, self.port)
        if self.config.streamed and len(set(hosts)) > 1:
            raise ConfigError(
                f"streamed mode needs every prefill rank on one host (decode learns the ranks from rank 0's side "
                f"channel), but they publish {sorted(set(hosts))}; run this instance in pull mode"
            )
        self._rank_hosts = hosts

    # -- decode ---------------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """From arrival on, a request that waits in vLLM's queue (no free blocks yet) keeps prefill's lease; on
        prefill, a streamed request's transfer opens (decode's subscription waits for it)."""
        params = request.kv_transfer_params
        if self.is_producer and isinstance(params, dict) and params.get("do_remote_decode"):
            self._open_stream(request, params)
        if not self.is_consumer or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        try:
            self._waiting[request.request_id] = decode_params(params)
        except ConfigError:
            return  # get_num_new_matched_tokens fails the request with the reason

    def _renewals(self) -> list[Renewal]:
        now = time.monotonic()
        if not self._waiting or now < self._next_renewal:
            return []
        self._next_renewal = now + self._renew_every
        by_engine: dict[RemotePrefill, list[str]] = {}
        for params in self._waiting.values():
            lease = params.glm_pd_transfer_id if isinstance(params, StreamParams) else params.remote_request_id
            by_engine.setdefault(params.remote, []).append(lease)
        return [Renewal(remote, ids) for remote, ids in by_engine.items()]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self.is_consumer or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        num_prompt = len(request.prompt_token_ids or [])
        remote: KvTransferParams | StreamParams | None
        try:
            remote = decode_params(params)
            if isinstance(remote, StreamParams) and not self.config.streamed:
                raise ConfigError("a streamed request (glm_pd_transfer_id), but this decode runs with streamed off")
            if isinstance(remote, KvTransferParams) and remote.remote_num_tokens != num_prompt:
                raise ConfigError(f"prefill computed {remote.remote_num_tokens} tokens; this prompt has {num_prompt}")
            if num_computed_tokens % self.block_tokens:
                raise ConfigError(f"local prefix hit {num_computed_tokens} is not block-aligned ({self.block_tokens})")
            error = ""
        except ConfigError as exc:
            remote, error = None, f"invalid kv_transfer_params: {exc}"
            logger.warning("GlmPdConnector: request %s: %s", request.request_id, error)
        self._pending[request.request_id] = (remote, num_computed_tokens, error)
        count = num_prompt - num_computed_tokens
        if count <= 0:  # everything hit locally: nothing to read; update_state_after_alloc releases prefill
            return 0, False
        return count, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if request.request_id not in self._pending:
            return
        if num_external_tokens == 0:  # a full local hit, or vLLM skipped the read (skip_reading_prefix_cache)
            self._queue(request, [], read=False)
            return
        self._queue(request, list(blocks.get_block_ids()[0]), read=True)
        # A preempted request comes back with num_computed_tokens=0: it must not load a second time.
        request.kv_transfer_params["do_remote_prefill"] = False

    def _queue(self, request: Request, local_blocks: list[int], *, read: bool) -> None:
        self._waiting.pop(request.request_id, None)
        remote, prefix, error = self._pending.pop(request.request_id)
        if remote is None:  # bad params: a read fails at once (the failure policy applies), nothing to free
            if read:
                self._meta.loads.append(LoadSpec(request.request_id, None, local_blocks, 0, 0, error=error))
            return
        num_tokens = len(request.prompt_token_ids or [])
        load = LoadSpec(request.request_id, remote.remote, local_blocks, num_tokens, prefix, read)
        if isinstance(remote, StreamParams):  # prefill's engine id, shape and blocks: from prefill, as it runs
            transfer = remote.glm_pd_transfer_id
            load = replace(load, remote_request_id=transfer, stream_id=transfer)
        else:
            load = replace(load, remote_request_id=remote.remote_request_id, remote_block_ids=remote.remote_block_ids)
        self._meta.loads.append(load)

    # -- prefill --------------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        if self._refused_stream(request):
            return False, None
        if request.request_id in self._pending:  # decode: aborted before allocation; let prefill free
            self._queue(request, [], read=False)
        elif request.request_id in self._waiting:  # aborted before vLLM ever asked the connector
            remote = self._waiting.pop(request.request_id)
            self._pending[request.request_id] = (remote, 0, "")
            self._queue(request, [], read=False)
        params = request.kv_transfer_params
        if self.is_consumer and params and params.get("glm_pd_transfer_id") and _aborted(request):
            self._meta.cancels.append(request.request_id)  # its streamed load may still wait on prefill
        if not self.is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        stream = self._streaming.pop(request.request_id, None)
        params_out = self._lease(request, block_ids, stream)
        if params_out is None:
            if stream is not None and not stream.broken:  # decode's subscription must not wait for a lease
                self._meta.ended[stream.transfer_id] = f"prefill leased no blocks ({request.status.name})"
            return False, None
        return True, params_out

    def _refused_stream(self, request: Request) -> bool:
        """A streamed request this decode's API server refused (admission control: vLLM then submits a pre-aborted
        stand-in so the connector frees what the request pinned). Its transfer is left alone: the router sends the
        leg to another decode, which reads it, or ends prefill's leg, which ends the transfer. Freeing here would end
        the transfer under the decode that takes it. A refused pull-mode request frees prefill's lease as vLLM
        intends (its router re-runs prefill)."""
        if not request.abort_immediately:
            return False
        remote = self._waiting.get(request.request_id)
        if not isinstance(remote, StreamParams):
            return False
        del self._waiting[request.request_id]
        logger.info(
            "GlmPdConnector: request %s refused before admission; streamed transfer %s is left to the router",
            request.request_id,
            remote.glm_pd_transfer_id,
        )
        return True

    def _lease(
        self, request: Request, block_ids: tuple[list[int], ...], stream: _Streaming | None
    ) -> dict[str, Any] | None:
        """Lease a finished request's blocks for decode; its kv_transfer_params, or None: free them now."""
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return None  # aborted or errored: nothing for decode
        if stream is not None and stream.broken:
            return None  # its transfer already ended: decode reads none of these blocks
        blocks = list(block_ids[0]) if block_ids else []
        if not blocks:
            return None
        # The lease is named per grant, and unguessably: only the decode the router hands these params to can
        # claim it (prefill then binds it to that decode), and an id the front end reuses (a router redoing prefill
        # after a failed load) is a new lease, never the ended one a late claim must be refused.
        lease_id = f"{request.request_id}#{secrets.token_urlsafe(18)}"
        try:  # the checks decode will apply: params it would refuse are not published, the blocks are freed now
            out = KvTransferParams(
                remote_engine_id=self.engine_id,
                remote_request_id=lease_id,
                remote_host=self._rank_hosts[0] if self._rank_hosts else self.config.side_channel_host,
                remote_port=self.port,
                remote_hosts=list(self._rank_hosts),
                tp_size=self.tp_size,
                remote_block_ids=blocks,
                remote_num_tokens=request.num_computed_tokens,
                remote_page_tokens=self.block_size,
                remote_token_shards=self.sharding.token_shards,
                remote_interleave=self.sharding.interleave,
            )
        except ConfigError as exc:
            logger.error("GlmPdConnector: request %s: no kv_transfer_params for decode: %s", request.request_id, exc)
            return None
        grant = Grant(request.request_id, blocks)
        if stream is not None:
            grant = Grant(request.request_id, blocks, stream.transfer_id, stream.num_tokens)
        self._meta.grants[lease_id] = grant
        return out.encode()

    def _open_stream(self, request: Request, params: dict) -> None:
        if "glm_pd_transfer_id" not in params:
            return
        try:
            if not self.config.streamed:
                raise ConfigError("a streamed request (glm_pd_transfer_id), but this prefill runs with streamed off")
            stream = _Streaming(transfer_id(params), len(request.prompt_token_ids or []))
        except ConfigError as exc:  # decode's subscription is refused or times out, naming no request of ours
            logger.warning("GlmPdConnector: request %s is not streamed: %s", request.request_id, exc)
            return
        self._streaming[request.request_id] = stream
        self._meta.opened[stream.transfer_id] = stream.num_tokens

    def _stream_progress(self, out: SchedulerOutput) -> None:
        """What this step writes of each streamed request: the blocks vLLM gave it since the workers were last
        told, and the prompt tokens computed once the step is done. A preempted request's blocks were freed:
        its transfer ends (decode fails its load; prefill recomputes and frees at the end)."""
        for request_id in out.preempted_req_ids or ():
            stream = self._streaming.get(request_id)
            if stream is not None and not stream.broken:
                stream.broken = "prefill preempted the request (its blocks were freed)"
                self._meta.ended[stream.transfer_id] = stream.broken
        steps = [(r.req_id, list(r.block_ids[0]), r.num_computed_tokens, True) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            resumed = request_id in cached.resumed_req_ids
            steps.append((request_id, list(new[0]) if new else [], cached.num_computed_tokens[i], resumed))
        for request_id, blocks, computed, whole in steps:
            stream = self._streaming.get(request_id)
            if stream is None or stream.broken:
                continue
            if whole and stream.blocks_told:  # a resumed request's table is new: its transfer cannot go on
                stream.broken = "prefill resumed the request in other blocks"
                self._meta.ended[stream.transfer_id] = stream.broken
                continue
            stream.blocks_told += len(blocks)
            written = min(computed + out.num_scheduled_tokens.get(request_id, 0), stream.num_tokens)
            self._meta.progress[stream.transfer_id] = (blocks, written)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> GlmPdMetadata:
        if self._streaming:
            self._stream_progress(scheduler_output)
        meta, self._meta = self._meta, GlmPdMetadata()
        meta.renewals = self._renewals()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta


def _aborted(request: Request) -> bool:
    return request.status == RequestStatus.FINISHED_ABORTED

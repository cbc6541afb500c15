"""Worker side of ``GlmPdConnector``: caches -> regions, transport, and the core's prefill/decode services.

Loads run on the decode service's thread between engine steps (the GLM-5 CUDA attention path never calls
``wait_for_layer_load``), so a request is scheduled only after its whole suffix has landed and prefill
has confirmed its blocks were held throughout.
Streamed prefill: ``wait_for_save`` (vLLM calls it once the step's forward, and the drafter's, are queued)
announces what the step wrote, behind a CUDA event recorded there: decode reads none of it before the GPU
has finished writing it.
Idle steps: vLLM steps without pause while any request exists, parked ones included, and its processes spin
between steps (shared-memory readers yield in a loop for 1 s after each message). A decode whose only requests
wait for loads (for a whole prefill, when streamed) would burn up to two cores; instead a step that schedules
no tokens waits in ``transfer_results`` for the next load to end, up to ``idle_wait_s``.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.decode.service import DecodeService, LoadJob
from glm_pd_common.handoff.prefill.service import PrefillService
from glm_pd_common.handoff.wire.handshake import Endpoint
from glm_pd_common.handoff.wire.protocol import renew_interval
from glm_pd_common.handoff.wire.trust import Trust
from glm_pd_common.layout.fingerprint import PeerShape, check_shape
from glm_pd_common.layout.pages import block_pages
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.transport.base import Transport, TransportConfig
from glm_pd_common.transport.devices import thread_device
from glm_pd_common.transport.factory import create_transport
from glm_pd_common.transport.staging import torch_staging
from glm_pd_common.transport.torch_memory import reader_for
from glm_pd_vllm.addresses import RankAddress, check_bindable
from glm_pd_vllm.caches import pages_per_block, regions_from_kv_caches
from glm_pd_vllm.config import GlmPdVllmConfig
from glm_pd_vllm.model import context_parallel
from glm_pd_vllm.scheduler import GlmPdMetadata, LoadSpec, engine_port
from glm_pd_vllm.stats import GlmPdStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def tp_rank_and_size(vllm_config: VllmConfig) -> tuple[int, int]:
    from vllm.distributed import parallel_state

    size = vllm_config.parallel_config.tensor_parallel_size
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank(), size
    return vllm_config.parallel_config.rank % size, size


class GlmPdWorker:
    def __init__(self, vllm_config: VllmConfig, config: GlmPdVllmConfig, spec: CacheSpec, engine_id: str) -> None:
        self.config = config
        self.spec = spec
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size  # tokens of one block on one rank
        self.tp_rank, self.tp_size = tp_rank_and_size(vllm_config)
        self.sharding = context_parallel(vllm_config)  # vLLM's DCP rank is tp_rank % dcp, as the core's shard
        self.block_tokens = self.block_size * self.sharding.token_shards  # tokens one block id spans
        self.port = engine_port(vllm_config, config.side_channel_port)
        kv = vllm_config.kv_transfer_config
        self.is_producer, self.is_consumer = kv.is_kv_producer, kv.is_kv_consumer
        if self.is_producer:  # decode dials each rank at the host it publishes
            check_bindable(config.side_channel_host, getattr(vllm_config.parallel_config, "nnodes_within_dp", 1))
        self.transport: Transport | None = None
        self.prefill: PrefillService | None = None
        self.decode: DecodeService | None = None
        self._load_errors: set[int] = set()
        self._inflight: dict[str, list[int]] = {}  # request id -> local blocks being loaded
        self._lease_requests: dict[str, str] = {}  # prefill: lease id -> vLLM's request id, until it is freed
        self._failed_now: list[tuple[LoadSpec, str]] = []
        # an idle step's wait: renewals, which the scheduler sends with the steps, must not fall behind it
        self._idle_wait_s = min(config.idle_wait_s, renew_interval(config.lease_s) / 2)
        self._idle = False  # this step schedules no tokens
        self._reported_load = False  # the last step reported a load's end: vLLM may have queued its next step
        self._path = "unknown"  # the data path loads move on (``TransportInfo.path``), once caches are registered
        self.stats = GlmPdStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        regions = regions_from_kv_caches(kv_caches, self.spec, self.block_size)
        self.pages_per_block = pages_per_block(regions, self.block_size)  # vLLM's kernel blocks per block
        shape = PeerShape(
            regions[0].page_tokens,
            self.tp_size,
            self.tp_rank,
            pages_per_block=self.pages_per_block,
            sharding=self.sharding,
        )
        try:
            check_shape(shape, side="this rank")
        except ConfigError as exc:  # e.g. an interleave of 128 over --block-size 128 held as 64-token kernel blocks
            raise ConfigError(
                f"GlmPdConnector cannot address this rank's caches: {exc} (decode_context_parallel_size "
                f"{self.sharding.token_shards}, cp_kv_cache_interleave_size {self.sharding.interleave}, --block-size "
                f"{self.block_size} registered as kernel blocks of {regions[0].page_tokens} tokens: glm-pd reads "
                "each kernel block as one page, so the interleave must divide it)"
            ) from exc
        self.device = next(iter(kv_caches.values())).device
        # a random part per process: no peer can load (and, with a damaged blob, leave unusable) this rank's agent
        # name in a prefill's NIXL before this rank does; engine ids are often set by operators, and public
        name = f"{self.engine_id}-tp{self.tp_rank}-{secrets.token_hex(8)}"
        self.transport = create_transport(
            name,
            TransportConfig(
                backend=self.config.transport,
                host=self.config.side_channel_host,
                allow_tcp=self.config.allow_tcp,
                timeout_s=self.config.timeout_s,
                posts="READ" if self.is_consumer else None,  # decode pulls; prefill's pages are only read
            ),
        )
        self.transport.register(regions)
        staging = torch_staging(
            torch,
            self.transport,
            regions,
            size_bytes=self.config.staging_mib << 20,
            slot_bytes=self.config.staging_slot_kib << 10,
            mode=self.config.staging,
        )
        local = Endpoint(
            self.engine_id,
            self.spec,
            regions,
            self.transport,
            shape,
            reader_for(regions, torch),
            thread_device(regions, torch),
            Trust.from_settings(self.config.credential, self.config.insecure),
            staging,
        )
        if self.is_producer:
            self.prefill = PrefillService(
                local,
                host=self.config.side_channel_host,
                port=self.port + self.tp_rank,
                lease_s=self.config.lease_s,
                timeout_s=self.config.timeout_s,
                streamed=self.config.streamed,
                caps=self.config.caps,
            )
        if self.is_consumer:
            self.decode = DecodeService(
                local,
                timeout_s=self.config.timeout_s,
                verify_digests=self.config.verify_checksums,
            )
        info = self.transport.info()
        self._path = info.path  # each load's metrics label
        logger.info(
            "GlmPdConnector worker %s: %d regions of %d-token pages, fingerprint %s, transport %s",
            name,
            len(regions),
            regions[0].page_tokens,
            self.spec.fingerprint().digest(),
            info.data_path,
        )

    def address(self) -> RankAddress | None:
        """Where this prefill rank's side channel listens (decode dials it there); None on decode."""
        if self.prefill is None:
            return None
        return RankAddress(self.tp_rank, self.config.side_channel_host, self.prefill.port)

    def bind(self, meta: GlmPdMetadata) -> None:
        """Before the step's forward: open and end streamed transfers, grant finished requests, cancel loads.
        None of it waits on GPU work, and vLLM calls ``start_load_kv`` only once the forward is launched (on CPU:
        once it has run), so a decode that subscribed or claimed would otherwise wait a whole step for it."""
        if self.prefill is not None:
            for transfer_id, num_tokens in meta.opened.items():
                self.prefill.open_stream(transfer_id, num_tokens)
            for transfer_id, why in meta.ended.items():
                self.prefill.end_stream(transfer_id, why)
            self._grant(meta)
        if self.decode is not None:
            for request_id in meta.cancels:
                self.decode.cancel(request_id)
        self._idle = meta.idle

    def _grant(self, meta: GlmPdMetadata) -> None:
        """Hold each finished request's blocks for its decode, behind an event recorded now: the steps that
        wrote them (the forward that finished the request, and its MTP drafter's) were queued on this stream
        before, and this step's forward, not yet queued, writes none of them."""
        if self.prefill is None or not meta.grants:
            return
        ready = self._ready_event()
        for lease_id, grant in meta.grants.items():
            self._lease_requests[lease_id] = grant.request_id
            pages = block_pages(grant.blocks, self.pages_per_block)
            if grant.transfer_id:
                self.prefill.grant_stream(lease_id, grant.transfer_id, pages, grant.num_tokens, ready=ready)
            else:
                self.prefill.grant(lease_id, pages, ready=ready)

    def start_load_kv(self, meta: GlmPdMetadata) -> None:
        for renewal in meta.renewals:
            if self.decode is not None:
                self.decode.renew(renewal.remote, renewal.remote_request_ids)
        for load in meta.loads:
            if load.remote is None or self.decode is None:
                self._failed_now.append((load, load.error or "this instance is not a kv_consumer"))
                continue
            if load.read:  # vLLM parks only a request whose load it was told of; a release-only job stays ours
                self._inflight[load.request_id] = self._written_blocks(load)
            self.decode.submit(
                LoadJob(
                    request_id=load.request_id,
                    remote=load.remote,
                    remote_pages=np.asarray(load.remote_block_ids, dtype=np.int64),
                    local_pages=block_pages(load.local_block_ids, self.pages_per_block),
                    num_tokens=load.num_tokens,
                    prefix_tokens=load.prefix_tokens,
                    read=load.read,
                    remote_request_id=load.remote_request_id,
                    stream_id=load.stream_id,
                    submitted_at=load.queued_at,
                )
            )

    def wait_for_save(self, meta: GlmPdMetadata) -> None:
        """Announce what this step wrote of each streamed request, once the GPU has written it."""
        if self.prefill is None or not meta.progress:
            return
        ready = self._ready_event()
        for transfer_id, (blocks, written) in meta.progress.items():
            self.prefill.advance_stream(transfer_id, block_pages(blocks, self.pages_per_block), written, ready=ready)

    def _ready_event(self) -> torch.cuda.Event | None:
        """Marks the GPU work queued so far on this device's stream; prefill answers a claim on a grant, and
        decode reads a streamed step, only once it has completed. CPU caches are written synchronously: nothing
        to wait for."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def transfer_results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.prefill is not None:
            for done in self.prefill.finished():
                request_id = self._lease_requests.pop(done.request_id, done.request_id)
                out.finished_sending.add(request_id)
                self.stats.prefill_outcome(done.outcome)
                if done.outcome != "released":
                    logger.warning(
                        "GlmPdConnector: freed blocks of %s (lease %s): %s %s",
                        request_id,
                        done.request_id,
                        done.outcome,
                        done.detail,
                    )
        failures = list(self._failed_now)
        self._failed_now.clear()
        for load, reason in failures:
            logger.error("GlmPdConnector: load of %s failed: %s", load.request_id, reason)
            if not load.read:
                continue
            out.finished_recving.add(load.request_id)
            out.failed_recving.add(load.request_id)
            self._load_errors.update(self._written_blocks(load))
            self.stats.failed("invalid_params" if load.error else "internal")
        if self.decode is not None:
            wait_s, self._idle = self._wait_s(out), False
            for result in self.decode.results(wait_s):
                if result.request_id not in self._inflight:  # a release-only job: vLLM never waited for it
                    if not result.ok:
                        logger.warning("GlmPdConnector: release of %s failed: %s", result.request_id, result.reason)
                    continue
                out.finished_recving.add(result.request_id)
                blocks = self._inflight.pop(result.request_id)
                if result.ok:
                    self.stats.loaded(
                        result.seconds, result.bytes_by_kind, result.runs, self._path, result.staged_bytes
                    )
                else:
                    out.failed_recving.add(result.request_id)
                    self._load_errors.update(blocks)
                    self.stats.failed(result.code or "internal")
                    logger.error("GlmPdConnector: load of %s failed: %s", result.request_id, result.reason)
        self._reported_load = bool(out.finished_recving)
        return out

    def _wait_s(self, out: KVConnectorTransferResults) -> float:
        """How long this step waits for a load to end: only a step that computes nothing, on a decode whose
        requests wait for loads, with nothing else to report. Not right after a step that reported a load: with
        async scheduling vLLM queued this step before it saw that, and the loaded request's first step waits
        behind this one."""
        quiet = not (out.finished_recving or self._reported_load)
        return self._idle_wait_s if self._idle and self._inflight and quiet else 0.0

    def _written_blocks(self, load: LoadSpec) -> list[int]:
        """The blocks a load writes: past decode's own prefix hit, which running requests may share. A failed
        load reports only these, or vLLM would truncate (and by default fail) every request holding the hit."""
        return load.local_block_ids[load.prefix_tokens // self.block_tokens :]

    def block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> GlmPdStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, GlmPdStats()
        return stats

    def shutdown(self) -> None:
        for service in (self.decode, self.prefill):
            if service is not None:
                service.close()
        if self.transport is not None:
            self.transport.close()
        self.decode = self.prefill = self.transport = None

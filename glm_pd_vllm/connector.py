"""``GlmPdConnector``: vLLM's KV connector for GLM-5.x PD handoff (MLA main KV + DSA indexer).

Enable with ``--kv-transfer-config '{"kv_connector": "GlmPdConnector", "kv_connector_module_path":
"glm_pd_vllm.connector", "kv_role": "kv_producer" | "kv_consumer", "kv_connector_extra_config": {...}}'``.
vLLM imports this module in its API-server process to validate the config, so the top level imports only
vLLM's base classes; the core, torch-side code and transports load when a role is built.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CacheHitSource,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def _log_through_vllm() -> None:
    """vLLM configures only its own logger tree; without this, glm-pd's lines (handshakes, refusals, each
    failed load's reason) would reach a server's log unformatted, and only from WARNING up."""
    vllm_logger = logging.getLogger("vllm")
    for name in ("glm_pd_common", "glm_pd_vllm"):
        ours = logging.getLogger(name)
        if not ours.handlers and vllm_logger.handlers:
            for handler in vllm_logger.handlers:
                ours.addHandler(handler)
            ours.setLevel(vllm_logger.getEffectiveLevel())


class GlmPdConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        from glm_pd_common.errors import ConfigError
        from glm_pd_vllm.config import GlmPdVllmConfig
        from glm_pd_vllm.model import cache_spec

        if self._kv_transfer_config.kv_role not in ("kv_producer", "kv_consumer"):
            # one rank would run both services on one transport agent, which is not thread-safe
            raise ConfigError(
                f"GlmPdConnector is a PD connector: kv_role must be kv_producer (prefill) or kv_consumer "
                f"(decode), got {self._kv_transfer_config.kv_role!r}"
            )
        config = GlmPdVllmConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        spec = cache_spec(vllm_config, config)  # on both roles: a model or cache dtype glm-pd cannot move fails here
        engine_id = str(self._kv_transfer_config.engine_id)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from glm_pd_vllm.scheduler import GlmPdScheduler

            self._scheduler = GlmPdScheduler(vllm_config, config, engine_id)
        else:
            from glm_pd_vllm.worker import GlmPdWorker

            self._worker = GlmPdWorker(vllm_config, config, spec, engine_id)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # registered addresses must not move under a transfer

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        from glm_pd_vllm.stats import GlmPdStats

        return GlmPdStats(data=data) if data is not None else GlmPdStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from glm_pd_vllm.metrics import GlmPdPromMetrics

        return GlmPdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every prefill rank's side-channel address, collected by EngineCore from the workers at start-up."""
        assert self._scheduler is not None
        self._scheduler.set_rank_addresses(metadata)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """The address this rank's side channel listens at, for the scheduler to relay to decode."""
        assert self._worker is not None
        return self._worker.address()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            from glm_pd_vllm.scheduler import GlmPdMetadata

            assert isinstance(connector_metadata, GlmPdMetadata)
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request is scheduled only after its whole load completed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing to save: decode pulls from prefill's blocks, which are leased after the request ends."""

    def wait_for_save(self) -> None:
        """Nothing is saved: a streamed prefill announces what this step wrote (decode reads it)."""
        if self._worker is not None:
            self._worker.wait_for_save(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

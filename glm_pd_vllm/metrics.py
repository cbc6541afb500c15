"""``GlmPdPromMetrics``: GlmPdConnector's Prometheus series, registered and fed through vLLM's own hooks.

vLLM's Prometheus logger builds this once per process through ``GlmPdConnector.build_prom_metrics`` with its
metric classes (prometheus_client's, or Ray's wrappers) and its label names and per-engine label values, then
calls ``observe`` with each aggregated ``GlmPdStats`` payload. Every name starts with ``vllm:``, so vLLM's
``unregister_vllm_metrics`` clears them when a new logger starts, as it does its own. Children for every
known label value are made up front: a reason that never happened reads 0 instead of being absent.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
from vllm.v1.metrics.utils import create_metric_per_engine

from glm_pd_common.transport.datapath import PATHS
from glm_pd_vllm.stats import FAILURE_CODES, KINDS, PREFILL_OUTCOMES, GlmPdStats

# A small request moves a few MB in milliseconds; GLM-5.3 at 1M tokens moves ~57 GB: ~0.15 s over RDMA,
# about a minute where UCX fell back to TCP.
TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GlmPdPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        seconds = self._histogram_cls(
            name="vllm:glm_pd_transfer_seconds",
            documentation="Seconds from posting the first READ to the last one completing, per successful load.",
            buckets=list(TRANSFER_BUCKETS_S),
            labelnames=labelnames,
        )
        self.transfer_seconds = create_metric_per_engine(seconds, per_engine_labelvalues)
        runs = self._counter_cls(
            name="vllm:glm_pd_descriptors",
            documentation="Transfer runs (coalesced) of successful GlmPdConnector loads: the descriptors a direct "
            "load posts.",
            labelnames=labelnames,
        )
        self.descriptors = create_metric_per_engine(runs, per_engine_labelvalues)
        moved = self._counter_cls(
            name="vllm:glm_pd_transferred_bytes",
            documentation="Bytes moved by successful GlmPdConnector loads, by cache kind (main MLA KV, indexer).",
            labelnames=[*labelnames, "kind"],
        )
        self.bytes_by_kind = {kind: self._children(moved, kind) for kind in KINDS}
        staged = self._counter_cls(
            name="vllm:glm_pd_staged_bytes",
            documentation="Of the bytes moved, those that went through staging slots (one descriptor per slot "
            "in place of one per run; the descriptors count counts the runs either way).",
            labelnames=labelnames,
        )
        self.staged_bytes = create_metric_per_engine(staged, per_engine_labelvalues)
        loads = self._counter_cls(
            name="vllm:glm_pd_loads",
            documentation="GlmPdConnector loads by outcome (ok, failed) and reason (ok, or why it failed).",
            labelnames=[*labelnames, "outcome", "reason"],
        )
        self.loads_ok = self._children(loads, "ok", "ok")
        self.loads_failed = {code: self._children(loads, "failed", code) for code in FAILURE_CODES}
        paths = self._counter_cls(
            name="vllm:glm_pd_loads_by_path",
            documentation="Successful GlmPdConnector loads by the data path they moved on (for GPU memory what UCX "
            "chose, observed at start-up; else rdma or tcp by the transport's devices).",
            labelnames=[*labelnames, "path"],
        )
        self.loads_by_path = {path: self._children(paths, path) for path in PATHS}
        leases = self._counter_cls(
            name="vllm:glm_pd_prefill_leases",
            documentation="Prefill leases ended, by outcome: released by decode, aborted, or expired unread.",
            labelnames=[*labelnames, "outcome"],
        )
        self.prefill_leases = {outcome: self._children(leases, outcome) for outcome in PREFILL_OUTCOMES}

    def _children(self, metric: PromMetric, *extra: str) -> dict[int, PromMetric]:
        """One child per engine with the extra label values appended, as vLLM labels its own series."""
        values = {idx: [*labels, *extra] for idx, labels in self.per_engine_labelvalues.items()}
        return create_metric_per_engine(metric, values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = GlmPdStats(data=transfer_stats_data)
        data = stats.data
        for seconds in data["transfer_s"]:
            self.transfer_seconds[engine_idx].observe(seconds)
        self.descriptors[engine_idx].inc(sum(data["runs"]))
        for kind in KINDS:
            self.bytes_by_kind[kind][engine_idx].inc(data[f"bytes_{kind}"])
        self.staged_bytes[engine_idx].inc(data["bytes_staged"])
        self.loads_ok[engine_idx].inc(stats.loads_ok)
        for code, n in stats.loads_failed().items():
            self.loads_failed[code][engine_idx].inc(n)
        for outcome in PREFILL_OUTCOMES:
            self.prefill_leases[outcome][engine_idx].inc(data[f"prefill_{outcome}"])
        for path in PATHS:
            self.loads_by_path[path][engine_idx].inc(data[f"path_{path}"])

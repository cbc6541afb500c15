"""GlmPdConnector's stats and Prometheus series through vLLM's own path, on both vLLM versions.

Two workers' ``GlmPdStats`` are merged by vLLM's ``KVOutputAggregator`` (as the TP ranks' outputs are), the
payload takes the scheduler's ``to_dict()`` and vLLM's msgpack round trip (``SchedulerStats``), then goes to
vLLM's ``KVConnectorProm`` (which resolves the connector class and calls ``build_prom_metrics`` with
prometheus_client's metric types) and to ``KVConnectorLogging`` (the log line). Values are read back from
prometheus_client's registry and compared with sums computed here from the recorded inputs.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from prometheus_client import REGISTRY, generate_latest
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
    KVConnectorStats,
)
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from glm_pd_common.transport.datapath import PATHS
from glm_pd_vllm.connector import GlmPdConnector
from glm_pd_vllm.metrics import GlmPdPromMetrics
from glm_pd_vllm.stats import FAILURE_CODES, GlmPdStats

LABELNAMES = ["model_name", "engine"]  # what vLLM's PrometheusStatLogger passes
ENGINES = {0: ["glm-5.3", "0"], 1: ["glm-5.3", "1"]}

# (seconds, bytes by kind, runs) per load, and failures / prefill outcomes, per worker (TP rank)
LOADS = [
    [(0.004, {"main": 41_984 * 3, "indexer": 8_448 * 3}, 2), (0.75, {"main": 41_984 * 900, "indexer": 0}, 40)],
    [(0.02, {"main": 1_000_000, "indexer": 200_000}, 7)],
]
FAILURES = [["digest", "lease_expired"], ["lease_expired", "transport", "timeout"]]
PATHS_OF = ["rdma", "cuda_ipc"]  # each worker's data path (rank 1's GPU reads within a node)
PREFILL = [["released", "expired"], ["released"]]


@pytest.fixture
def vllm_config() -> VllmConfig:
    kv = KVTransferConfig(
        kv_connector="GlmPdConnector", kv_connector_module_path="glm_pd_vllm.connector", kv_role="kv_consumer"
    )
    return VllmConfig(device_config=DeviceConfig(device="cpu"), kv_transfer_config=kv)


@pytest.fixture(autouse=True)
def clean_registry():
    unregister_vllm_metrics()  # what vLLM's PrometheusStatLogger does first
    yield
    unregister_vllm_metrics()


def worker_stats(rank: int) -> GlmPdStats:
    stats = GlmPdStats()
    for seconds, by_kind, runs in LOADS[rank]:
        stats.loaded(seconds, by_kind, runs, PATHS_OF[rank])
    for code in FAILURES[rank]:
        stats.failed(code)
    for outcome in PREFILL[rank]:
        stats.prefill_outcome(outcome)
    return stats


def payload_from_workers() -> dict:
    """Both ranks' stats as the scheduler hands them to the front end."""
    outputs = []
    for rank in (0, 1):
        out = ModelRunnerOutput([], {})
        out.kv_connector_output = KVConnectorOutput(kv_connector_stats=worker_stats(rank))
        outputs.append(pickle.loads(pickle.dumps(out)))  # workers' outputs cross a process boundary
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
    stats = merged.kv_connector_output.kv_connector_stats
    assert isinstance(stats, GlmPdStats)
    wire = MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=stats.to_dict()))
    return MsgpackDecoder(SchedulerStats).decode(wire).kv_connector_stats


def sample(name: str, engine: str = "0", **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": "glm-5.3", "engine": engine, **labels})


def test_prometheus_series_from_two_workers(vllm_config):
    prom = KVConnectorProm(vllm_config, LABELNAMES, ENGINES)
    assert isinstance(prom.prom_metrics, GlmPdPromMetrics)
    prom.observe(payload_from_workers(), engine_idx=0)

    loads = [load for rank in LOADS for load in rank]
    seconds = [s for s, _, _ in loads]
    assert sample("vllm:glm_pd_transfer_seconds_count") == len(loads)
    assert sample("vllm:glm_pd_transfer_seconds_sum") == pytest.approx(sum(seconds))
    text = generate_latest(REGISTRY).decode()
    bounds = [
        line.split('le="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith('vllm:glm_pd_transfer_seconds_bucket{engine="0"')
    ]
    assert len(bounds) > 3 and bounds[-1] == "+Inf"
    for le in bounds:
        want = sum(s <= float(le) for s in seconds)
        assert sample("vllm:glm_pd_transfer_seconds_bucket", le=le) == want, le
    for kind in ("main", "indexer"):
        want = sum(by_kind[kind] for _, by_kind, _ in loads)
        assert sample("vllm:glm_pd_transferred_bytes_total", kind=kind) == want
    assert sample("vllm:glm_pd_descriptors_total") == sum(runs for _, _, runs in loads)
    assert sample("vllm:glm_pd_loads_total", outcome="ok", reason="ok") == len(loads)
    failures = [code for rank in FAILURES for code in rank]
    for code in FAILURE_CODES:  # every reason is a series, the ones that never happened read 0
        assert sample("vllm:glm_pd_loads_total", outcome="failed", reason=code) == failures.count(code), code
    outcomes = [o for rank in PREFILL for o in rank]
    for outcome in ("released", "aborted", "expired"):
        assert sample("vllm:glm_pd_prefill_leases_total", outcome=outcome) == outcomes.count(outcome)
    for path in PATHS:  # every path is a series; loads count on their rank's
        want = sum(len(rank) for rank, p in zip(LOADS, PATHS_OF, strict=True) if p == path)
        assert sample("vllm:glm_pd_loads_by_path_total", path=path) == want, path
    # the other engine's series exist and are untouched
    assert sample("vllm:glm_pd_transfer_seconds_count", engine="1") == 0
    assert sample("vllm:glm_pd_loads_total", engine="1", outcome="failed", reason="lease_expired") == 0
    assert 'vllm:glm_pd_transferred_bytes_total{engine="1",kind="main",model_name="glm-5.3"} 0.0' in text


def test_counters_accumulate_over_intervals(vllm_config):
    prom = KVConnectorProm(vllm_config, LABELNAMES, ENGINES)
    first, second = payload_from_workers(), payload_from_workers()
    prom.observe(first, engine_idx=1)
    prom.observe(second, engine_idx=1)
    loads = [load for rank in LOADS for load in rank]
    assert sample("vllm:glm_pd_transfer_seconds_count", engine="1") == 2 * len(loads)
    assert sample("vllm:glm_pd_loads_total", engine="1", outcome="failed", reason="lease_expired") == 2 * 2
    assert sample("vllm:glm_pd_transfer_seconds_count", engine="0") == 0


def test_series_are_in_vllms_registry(vllm_config):
    """A second logger without vLLM's unregister collides; after it, the series register again."""
    KVConnectorProm(vllm_config, LABELNAMES, ENGINES)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        KVConnectorProm(vllm_config, LABELNAMES, ENGINES)
    unregister_vllm_metrics()
    KVConnectorProm(vllm_config, LABELNAMES, ENGINES)
    assert sample("vllm:glm_pd_loads_total", outcome="ok", reason="ok") == 0


def test_log_line_through_vllms_logging(vllm_config):
    first, second = payload_from_workers(), payload_from_workers()
    kept = copy.deepcopy(first)
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    assert logging.connector_cls is GlmPdConnector
    logging.observe(first)
    logging.observe(second)
    assert first == kept, "aggregating must not change a payload the Prometheus logger also reads"
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    fields = dict(item.split("=") for item in line.removeprefix("KV Transfer metrics: ").split(", "))

    loads = [load for rank in LOADS for load in rank] * 2
    seconds = np.array([s for s, _, _ in loads])
    moved = sum(sum(by_kind.values()) for _, by_kind, _ in loads)
    assert int(fields["Loads ok"]) == len(loads)
    assert int(fields["Loads failed"]) == 2 * sum(len(f) for f in FAILURES)
    assert int(fields["Failed lease_expired"]) == 4 and "Failed internal" not in fields
    assert float(fields["Avg transfer (ms)"]) == pytest.approx(seconds.mean() * 1e3, abs=1e-3)
    assert float(fields["P90 transfer (ms)"]) == pytest.approx(np.percentile(seconds, 90) * 1e3, abs=1e-3)
    assert float(fields["Throughput (GB/s)"]) == pytest.approx(moved / seconds.sum() / 1e9, abs=1e-3)
    main = sum(by_kind["main"] for _, by_kind, _ in loads)
    assert float(fields["MiB main"]) == pytest.approx(main / 2**20, abs=1e-3)
    assert int(fields["Prefill released"]) == 4 and "Prefill aborted" not in fields
    assert int(fields["Loads over rdma"]) == 2 * len(LOADS[0]) and "Loads over tcp" not in fields
    assert logging.transfer_stats_accumulator is None  # vLLM reset it for the next interval


def test_failures_alone_are_not_empty_and_reset_empties():
    stats = GlmPdConnector.build_kv_connector_stats()
    assert isinstance(stats, GlmPdStats) and stats.is_empty()
    stats.failed("refused_peer")
    assert not stats.is_empty()
    summary = stats.reduce()
    assert summary["Loads ok"] == 0 and summary["Failed refused_peer"] == 1 and "Avg transfer (ms)" not in summary
    stats.reset()
    assert stats.is_empty()
    stats.prefill_outcome("aborted")
    assert not stats.is_empty()
    empty = GlmPdStats()
    assert empty.aggregate(GlmPdStats()).is_empty()


def test_aggregate_sums_counts_and_concatenates_loads():
    a, b = worker_stats(0), worker_stats(1)
    merged = GlmPdConnector.build_kv_connector_stats(a.to_dict())
    merged.aggregate(GlmPdConnector.build_kv_connector_stats(b.to_dict()))
    assert merged.data["transfer_s"] == [s for rank in LOADS for s, _, _ in rank]
    assert merged.data["runs"] == [r for rank in LOADS for _, _, r in rank]
    assert merged.data["bytes_indexer"] == sum(k["indexer"] for rank in LOADS for _, k, _ in rank)
    assert merged.data["failed_lease_expired"] == 2
    assert a.data == worker_stats(0).data, "the stats built from a's payload are a copy"


def test_unknown_values_are_refused():
    stats = GlmPdStats()
    with pytest.raises(ValueError, match="failure code"):
        stats.failed("flaky")
    with pytest.raises(ValueError, match="region kind"):
        stats.loaded(0.1, {"mtp": 10}, 1, "rdma")
    with pytest.raises(ValueError, match="data path"):
        stats.loaded(0.1, {"main": 10}, 1, "carrier pigeon")
    with pytest.raises(ValueError, match="prefill outcome"):
        stats.prefill_outcome("leaked")
    with pytest.raises(ValueError, match="unknown keys"):
        GlmPdStats(data={"loads_ok": 1})
    with pytest.raises(TypeError):
        stats.aggregate(KVConnectorStats())
    assert stats.is_empty()  # nothing refused was counted

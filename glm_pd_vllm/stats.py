"""``GlmPdStats``: what a worker's loads and prefill leases did in one interval, in vLLM's stats container.

vLLM moves these stats from each worker to the scheduler (its output aggregator merges the TP ranks with
``aggregate``), then as ``to_dict()`` payloads to the front end, where the log line takes ``reduce()`` and
the Prometheus logger feeds the same payload to ``GlmPdPromMetrics.observe``. So ``data`` holds only plain
lists and ints (it is pickled and msgpack-encoded on the way), transfer seconds stay one entry per load
(the histogram needs every observation), and everything else is a count that sums across workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from glm_pd_common.handoff.wire.protocol import FAILURE_CODES
from glm_pd_common.transport.datapath import PATHS

KINDS = ("main", "indexer")  # region kinds a plan moves (common.layout.regions.RegionKind)
PREFILL_OUTCOMES = ("released", "aborted", "expired")  # common.handoff.prefill_service.Finished.outcome

_LISTS = ("transfer_s", "runs")  # one entry per successful load, aligned


def _counts() -> dict[str, int]:
    names = [f"bytes_{k}" for k in KINDS] + ["bytes_staged"] + [f"failed_{c}" for c in FAILURE_CODES]
    names += [f"path_{p}" for p in PATHS]
    return dict.fromkeys(names + [f"prefill_{o}" for o in PREFILL_OUTCOMES], 0)


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"GlmPdStats: unknown {what} {value!r} (expected one of {', '.join(allowed)})")


@dataclass
class GlmPdStats(KVConnectorStats):
    """Loads (seconds, bytes by kind, runs), failed loads by reason, and prefill lease outcomes.

    Built from a payload (``build_kv_connector_stats(data)``) the lists are copied, so aggregating into it
    never changes the payload another stat logger still reads. Unknown keys are refused: a payload from a
    different schema must not be counted as zeros.
    """

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        given, self.data = self.data, {}
        self.reset()
        unknown = sorted(set(given) - set(self.data))
        if unknown:
            raise ValueError(f"GlmPdStats: unknown keys {unknown}")
        for key, value in given.items():
            self.data[key] = list(value) if key in _LISTS else int(value)
        if len(self.data["transfer_s"]) != len(self.data["runs"]):
            raise ValueError("GlmPdStats: transfer_s and runs must have one entry per load")

    # -- what the worker records ----------------------------------------------------------------
    def loaded(
        self, seconds: float, bytes_by_kind: dict[str, int], runs: int, path: str, staged_bytes: int = 0
    ) -> None:
        """One successful load: its wall time, the bytes it moved per region kind, the runs it planned, the data
        path its rank's transport moves them on (``datapath.PATHS``), and of its bytes those moved staged."""
        if seconds < 0 or runs < 0:
            raise ValueError(f"GlmPdStats: negative load seconds {seconds} or runs {runs}")
        _check(path, PATHS, "data path")
        for kind in bytes_by_kind:
            _check(kind, KINDS, "region kind")
        self.data[f"path_{path}"] += 1
        self.data["bytes_staged"] += int(staged_bytes)
        for kind, n in bytes_by_kind.items():
            self.data[f"bytes_{kind}"] += int(n)
        self.data["transfer_s"].append(float(seconds))
        self.data["runs"].append(int(runs))

    def failed(self, code: str) -> None:
        """One failed load, by reason (``LoadResult.code``: one of the core's ``FAILURE_CODES``)."""
        _check(code, FAILURE_CODES, "failure code")
        self.data[f"failed_{code}"] += 1

    def prefill_outcome(self, outcome: str) -> None:
        """How one prefill lease ended (``PREFILL_OUTCOMES``)."""
        _check(outcome, PREFILL_OUTCOMES, "prefill outcome")
        self.data[f"prefill_{outcome}"] += 1

    # -- vLLM's contract --------------------------------------------------------------------------
    def reset(self) -> None:
        self.data = {**{key: [] for key in _LISTS}, **_counts()}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, GlmPdStats):
            raise TypeError(f"GlmPdStats cannot aggregate {type(other).__name__}")
        for key, value in other.data.items():
            if key in _LISTS:
                self.data[key].extend(value)
            else:
                self.data[key] += value
        return self

    def is_empty(self) -> bool:
        counts = (v for k, v in self.data.items() if k not in _LISTS)
        return not self.data["transfer_s"] and not any(counts)

    @property
    def loads_ok(self) -> int:
        return len(self.data["transfer_s"])

    def loads_failed(self) -> dict[str, int]:
        return {code: self.data[f"failed_{code}"] for code in FAILURE_CODES}

    def reduce(self) -> dict[str, int | float]:
        """The interval in one line: loads, failures by reason (those that happened), latency, volume."""
        failed = self.loads_failed()
        out: dict[str, int | float] = {"Loads ok": self.loads_ok, "Loads failed": sum(failed.values())}
        out.update({f"Failed {code}": n for code, n in failed.items() if n})
        seconds = np.asarray(self.data["transfer_s"], dtype=np.float64)
        moved = sum(self.data[f"bytes_{k}"] for k in KINDS)
        if seconds.size:
            out["Avg transfer (ms)"] = round(float(seconds.mean()) * 1e3, 3)
            out["P90 transfer (ms)"] = round(float(np.percentile(seconds, 90)) * 1e3, 3)
            out["Avg runs per load"] = round(float(np.mean(self.data["runs"])), 1)
            total_s = float(seconds.sum())
            out["Throughput (GB/s)"] = round(moved / total_s / 1e9, 3) if total_s > 0 else 0.0
        out.update({f"MiB {k}": round(self.data[f"bytes_{k}"] / 2**20, 3) for k in KINDS})
        if self.data["bytes_staged"]:
            out["MiB staged"] = round(self.data["bytes_staged"] / 2**20, 3)
        out.update({f"Loads over {p}": self.data[f"path_{p}"] for p in PATHS if self.data[f"path_{p}"]})
        out.update({f"Prefill {o}": self.data[f"prefill_{o}"] for o in PREFILL_OUTCOMES if self.data[f"prefill_{o}"]})
        return out

"""Plan cost for a full 1M-token GLM-5.3 request per rank (101 regions, 16,384 pages of 64).

Prints a table and writes JSON (``--json`` prints the JSON list instead). ``runs_min`` is computed
independently of the planner: the number of chunk pieces that no other piece continues on both sides.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.emit import emit_rows
from glm_pd_common.layout.capacity import AccountInputs, plan_for
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.layout.spec import CacheSpec

CASES = [(64, 64), (64, 32), (32, 64), (16, 128), (128, 16)]


def runs_min(plan: TransferPlan) -> int:
    """Fewest runs any correct plan can have: pieces minus continuations (hash join, not sort-and-merge)."""
    total = 0
    for entry in plan.entries:
        s, d, n = plan.chunk_runs(entry)
        starts = (s << 31) | d
        ends = ((s + n) << 31) | (d + n)
        total += int(s.size - np.isin(starts, ends).sum())
    return total


def bench(tokens: int, repeats: int) -> list[dict[str, object]]:
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    rows = []
    for p, d in CASES:
        for allocator in ("contiguous", "shuffled"):
            inputs = AccountInputs(spec.geometry, spec.row, spec.indexer, tokens, p, d)
            times, plan = [], None
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = plan_for(inputs, allocator)
                times.append((time.perf_counter() - t0) * 1e3)
            assert plan is not None
            rows.append(
                {
                    "tokens": tokens,
                    "allocator": allocator,
                    "prefill_page_tokens": p,
                    "decode_page_tokens": d,
                    "regions": len(plan.entries),
                    "ms_median": round(statistics.median(times), 2),
                    "ms_min": round(min(times), 2),
                    "runs": plan.num_runs,
                    "runs_min": runs_min(plan),
                    "bytes": plan.num_bytes,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the JSON list instead of the table")
    parser.add_argument("--out", default="benchmarks/results/plan_bench.json")
    args = parser.parse_args()
    rows = bench(args.tokens, args.repeats)
    header = f"{'P->D':>8} {'allocator':>10} {'ms (median)':>12} {'runs':>10} {'runs_min':>10} {'GB':>7}"
    emit_rows(
        rows,
        args.out,
        as_json=args.json,
        header=header,
        line=lambda r: (
            f"{r['prefill_page_tokens']:>3}->{r['decode_page_tokens']:<4} {r['allocator']:>10} "
            f"{r['ms_median']:>12.2f} {r['runs']:>10,} {r['runs_min']:>10,} {r['bytes'] / 1e9:>7.2f}"
        ),
    )


if __name__ == "__main__":
    main()

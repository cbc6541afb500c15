"""One 1M-token GLM-5.3 request per context-parallel layout: what moves over the network, the busiest rank's
share and time on its link, and what planning a decode rank's loads costs.

Prints a table and writes JSON (``--json`` prints the JSON list instead). Bytes and runs come from real plans
(``capacity.traffic``: every decode rank against each prefill rank it reads); ``plan_ms`` is decode rank 0
planning all of its pieces, as its load does, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.emit import emit_rows
from glm_pd_common.layout.capacity import AccountInputs, plan_for, traffic
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.shards import Sharding
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.layout.tp import sources

R = Sharding()
LAYOUTS: list[tuple[str, Sharding, Sharding]] = [
    ("replicated -> replicated", R, R),
    ("DCP 8 -> DCP 8 (vLLM, interleave 1)", Sharding(8, 1), Sharding(8, 1)),
    ("DCP 8 -> DCP 8 (interleave 64)", Sharding(8, 64), Sharding(8, 64)),
    ("DCP 2 -> DCP 8", Sharding(2, 1), Sharding(8, 1)),
    ("replicated -> DCP 8", R, Sharding(8, 1)),
    ("replicated -> DCP 8 (interleave 64)", R, Sharding(8, 64)),
    ("layer split 8 -> replicated (SGLang)", Sharding(layer_shards=8), R),
    ("layer split 8 -> DCP 8", Sharding(layer_shards=8), Sharding(8, 1)),
    ("layer split 8 -> DCP 8 (interleave 64)", Sharding(layer_shards=8), Sharding(8, 64)),
]


def bench(tokens: int, repeats: int, link_gbps: float) -> list[dict[str, object]]:
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    rate = link_gbps / 8 * 1e9
    rows = []
    for name, prefill, decode in LAYOUTS:
        inputs = AccountInputs(
            spec.geometry,
            spec.row,
            spec.indexer,
            tokens,
            prefill_tp=8,
            decode_tp=8,
            link_gbps=link_gbps,
            prefill_sharding=prefill,
            decode_sharding=decode,
        )
        moves = traffic(inputs)
        received = [sum(k.values()) for k in moves.received.values()]
        p_layout, d_layout = inputs.layouts()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for source in sources(0, p_layout, d_layout):
                plan_for(inputs, "contiguous", 0, source)
            times.append((time.perf_counter() - t0) * 1e3)
        busiest = max(max(received), max(moves.sent.values()))
        rows.append(
            {
                "layout": name,
                "tokens": tokens,
                "prefill_sharding": [prefill.token_shards, prefill.interleave, prefill.layer_shards],
                "decode_sharding": [decode.token_shards, decode.interleave, decode.layer_shards],
                "bytes_over_network": sum(received),
                "bytes_busiest_rank": busiest,
                "link_seconds": busiest / rate,
                "sources_per_decode_rank": max(len(s) for s in moves.sources.values()),
                "runs_per_decode_rank": moves.runs["contiguous"],
                "plan_ms_median": round(statistics.median(times), 1),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--link-gbps", type=float, default=400.0)
    parser.add_argument("--json", action="store_true", help="print the JSON list instead of the table")
    parser.add_argument("--out", default="benchmarks/results/layout_bench.json")
    args = parser.parse_args()
    rows = bench(args.tokens, args.repeats, args.link_gbps)
    header = (
        f"{'layout (TP 8 -> TP 8)':<38} {'network GB':>10} {'busiest GB':>10} {'link s':>7} {'sources':>7} "
        f"{'runs':>10} {'plan ms':>8}"
    )
    emit_rows(
        rows,
        args.out,
        as_json=args.json,
        header=header,
        line=lambda r: (
            f"{r['layout']:<38} {r['bytes_over_network'] / 1e9:>10.2f} {r['bytes_busiest_rank'] / 1e9:>10.2f} "
            f"{r['link_seconds']:>7.3f} {r['sources_per_decode_rank']:>7} {r['runs_per_decode_rank']:>10,} "
            f"{r['plan_ms_median']:>8.1f}"
        ),
    )


if __name__ == "__main__":
    main()

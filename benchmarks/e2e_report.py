"""Issue 6's report for the tiny DSA model through the vLLM connector harness (tests/support/vllm_pd_proc.py:
vLLM's own scheduler and block pool, NIXL on loopback): per case, the bytes moved by kind, the transfer runs,
and how many prompts decode to exactly the monolithic run's tokens. The indexer-dropped case is the negative
control (tokens must differ).
Prints a table, writes JSON. Run in the vLLM venv: ``$(cat .venv-vllm-path)/bin/python -m benchmarks.e2e_report``.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
from pathlib import Path

from benchmarks.emit import emit_rows
from glm_pd_common.layout.geometry import ModelGeometry
from tests.support.tiny_dsa import TinyDsa, prompts
from tests.support.vllm_harness import Proc, make_tiny_model

STEPS, PREFILL_PAGE, DECODE_PAGE = 8, 16, 64
PROMPTS = prompts(8, [90, 150, 200, 130, 70, 180, 110, 160])


def case(model: str, logs: Path, prefix: int, drop_indexer: bool, reference: list[list[int]]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rids = [f"e2e-{i}" for i in range(len(PROMPTS))]
    e2e = {"prompts": PROMPTS, "steps": STEPS, "seed": 3}
    base = {"model": model, "tp": 1, "port": port, "lease_s": 90.0, "wait_s": 150.0, "tokens": 0,
            "requests": rids, "module_path": "glm_pd_vllm.connector"}  # fmt: skip
    prefill = Proc({**base, "role": "kv_producer", "engine_id": "P", "block_size": PREFILL_PAGE,
                    "pool_tokens": 160 * 16, "prefix_tokens": 0, "e2e": e2e}, logs)  # fmt: skip
    try:
        decode = Proc({**base, "role": "kv_consumer", "engine_id": "D", "block_size": DECODE_PAGE,
                       "pool_tokens": 48 * 64, "prefix_tokens": prefix, "e2e": {**e2e, "drop_indexer": drop_indexer}},
                      logs)  # fmt: skip
        try:
            decode.read()  # ready
            decode.send(json.dumps(prefill.read()["params"]))
            decode.read()  # what vLLM asked the connector
            report = decode.read()
        finally:
            decode.close()
    finally:
        prefill.close()
    results = [report["requests"][r] for r in rids]
    stats = report["stats"][0]
    return {
        "case": f"prefill page {PREFILL_PAGE} -> decode page {DECODE_PAGE}, decode prefix {prefix}"
        + (", indexer dropped (control)" if drop_indexer else ""),
        "prompts": len(PROMPTS),
        "loaded": sum(r["loaded"] for r in results),
        "tokens_equal": sum(r["tokens"] == ref for r, ref in zip(results, reference, strict=True)),
        "bytes_main": stats.get("bytes_main", 0),
        "bytes_indexer": stats.get("bytes_indexer", 0),
        "runs": stats.get("runs", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the JSON list instead of the table")
    parser.add_argument("--out", default="benchmarks/results/e2e_report.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="glm-pd-e2e-"))
    model = make_tiny_model(work / "model")
    g = ModelGeometry.from_config(model, include_mtp=False)
    reference = [TinyDsa(g.num_layers, list(g.full_indexer_layers), seed=3).generate(p, 16, STEPS) for p in PROMPTS]
    rows = [case(model, work, prefix, drop, reference) for prefix, drop in ((0, False), (64, False), (0, True))]
    emit_rows(
        rows,
        args.out,
        as_json=args.json,
        header=f"{'case':<72} {'loaded':>6} {'tokens =':>8} {'main B':>10} {'indexer B':>10} {'runs':>6}",
        line=lambda r: (
            f"{r['case']:<72} {r['loaded']:>4}/{r['prompts']} {r['tokens_equal']:>6}/{r['prompts']} "
            f"{r['bytes_main']:>10,} {r['bytes_indexer']:>10,} {r['runs']:>6}"
        ),
    )


if __name__ == "__main__":
    main()

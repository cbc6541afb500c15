"""The fault matrix over GlmPdConnector (tests/vllm/fault_matrix.py): a prefill and a decode instance over
NIXL on loopback, one fault per case at one handoff state. Prints a table, writes JSON.

Run in the vLLM venv: ``$(cat .venv-vllm-path)/bin/python -m benchmarks.fault_matrix``.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks.emit import emit_rows
from tests.support import vllm_fault_matrix as fault_matrix
from tests.support.vllm_harness import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--port", type=int, default=23500)
    parser.add_argument("--json", action="store_true", help="print the JSON list instead of the table")
    parser.add_argument("--out", default="benchmarks/results/fault_matrix.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="glm-pd-faults-"))
    models = [
        make_tiny_model(work / "model"),
        make_tiny_model(work / "all-full", index_topk_freq=1),
        make_tiny_model(work / "no-mtp", num_nextn_predict_layers=0),
    ]
    rows = fault_matrix.run(*models, work, args.port, only=args.only)
    out = [{**asdict(r), "problems": fault_matrix.problems(r)} for r in rows]
    header = (
        f"{'fault':<36} {'state':<18} {'outcome':<22} {'wrong':>5} {'detect s':>8} "
        f"{'P/D blocks left':>15} {'next':>5}  verdict"
    )
    emit_rows(
        out,
        args.out,
        as_json=args.json,
        header=header,
        line=lambda r: (
            f"{r['case']:<36} {r['state']:<18} {','.join(r['outcomes']):<22} {r['served_wrong']!s:>5} "
            f"{r['detect_s']:>8.2f} {r['prefill_blocks_left']:>7}/{r['decode_blocks_left']:<7} "
            f"{'ok' if r['next_ok'] else 'FAIL':>5}  {'; '.join(r['problems']) or 'handled'}"
        ),
    )
    print(f"(engine logs under {work})")


if __name__ == "__main__":
    main()

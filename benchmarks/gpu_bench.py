"""How glm-pd's handoff compares with raw NIXL and with the GPU's own copies, on one GPU (issue 28).

Two processes on one GPU, as ``tests/gpu/smoke.py`` runs them: this one is decode, a child (this module with
``--child``) is prefill. Both hold GLM-5.3 caches of ``--tokens`` (default 131,072: 7.17 GB a request) in glm-pd's
page layout, sized from ``layout.spec`` (nothing here restates a byte count the core computes), and a staging
buffer (``--staging-mib`` in ``--slot-mib`` slots). Rows, all from one run so their ratios stand side by side:

- ``raw``: one NIXL descriptor of the request's byte count between two flat buffers, WRITE and READ (the ceiling);
- ``copy`` / ``gather``: the memory's own reference: a copy of the same bytes, and an ``index_select`` of the
  same bytes as shuffled main pages (``row_bytes`` × 64 tokens each), within this process;
- ``pull``: vLLM's path, ``DecodeService`` READing from ``PrefillService`` run by run, on a contiguous and a
  shuffled page pool, digests off and on. Its seconds are the read (every batch posted and waited for);
  ``load_s`` adds the claim's round trip and, with digests, prefill's digests and decode's check, so digests cost
  ``load_s(on) - load_s(off)``;
- ``staged``: the same pull through both ranks' staging slots (mode ``always``): prefill gathers each slot, decode
  READs it as one descriptor and scatters it; its ``batch`` is the slots read;
- ``push``: SGLang's path: prefill posts the request's plan as one batch of WRITEs (``Transport.post_plan(...,
  "WRITE")``, as ``glm_pd_sglang/transfer.py`` does per chunk), on both pools, directly;
- ``staged push``: the same plan through staging slots (``handoff.staged_push``, as SGLang's manager runs it):
  decode lends a pair, prefill gathers each slot while the previous one's WRITE is in flight, decode checks and
  scatters each landed slot (the slot messages over the parent's pipe); its ``batch`` is the slots written;
- ``streamed``: prefill's writer makes 16 chunks at a steady pace (a GPU sleep each, standing in for the forward;
  on host memory a host sleep), records each chunk's CUDA event and announces it with it
  (``advance_stream(..., ready=event)``), then grants the lease; decode loads with a ``stream_id``. Its seconds are
  the exposed handoff: decode's load end minus the last chunk's event (both on the system's monotonic clock).
  The pace defaults to the shuffled pull's read over 16, so prefill writes about as fast as the link moves it;
- ``staged streamed``: the same, each announced span read through both ranks' staging slots, against ``staged``.

Each row is the median of ``--repeats`` runs (fewer where a row's runs pass ``--row-budget-s``), after warm-ups that
connect the agents and map every region. ``of ceiling`` is a row's rate over the faster raw rate, ``of raw op`` over
the raw rate of its own operation. The UCX path of each NIXL row is what ``UCX_PROTO_INFO=y`` printed for the agent
that posted it. The issue's targets are printed beside the measured ratios with PASS/FAIL, never asserted. Prints a
table and writes JSON (``--json``, default ``benchmarks/results/gpu_bench.json``; also ``$OUT/gpu_bench.json`` when
``OUT`` is set) with the environment. The modules are in ``benchmarks/gpu/``.

``--memory host`` runs every row on DRAM (small ``--tokens``): the same services, the CPU's copies. Run
``scripts/gpu_bench.sh`` on the GPU machine. Exit status: 0 ran, 77 skipped (no CUDA, torch, NIXL or a package).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu.ranks import REPO

SKIP_RC = 77


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--tokens", type=int, default=131_072, help="tokens of the request (64-token pages)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row, the median reported")
    parser.add_argument("--row-budget-s", type=float, default=20.0, help="no further run of a row past this")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="rows not started by then are skipped")
    parser.add_argument("--chunk-ms", type=float, default=0.0, help="streamed chunk pace (default: pull's / 16)")
    parser.add_argument("--slot-mib", type=int, default=64, help="staging slot size, both ranks")
    parser.add_argument("--staging-mib", type=int, default=512, help="staging buffer size, both ranks")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks/results/gpu_bench.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < 2 * args.slot_mib <= args.staging_mib:
        parser.error(f"--staging-mib {args.staging_mib} must hold a pair of --slot-mib {args.slot_mib} slots")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        from benchmarks.gpu.prefill import child_main

        return child_main(json.loads(args.child))
    os.environ.setdefault("UCX_PROTO_INFO", "y")  # before UCX loads, here and in the child
    from benchmarks.gpu.environment import unavailable

    reason = unavailable(args.memory)
    if reason is not None:
        print(f"SKIPPED: {reason}")
        return SKIP_RC
    from benchmarks.gpu.bench import Bench
    from benchmarks.gpu.decode import Decode
    from benchmarks.gpu.report import build, partial_report, print_report

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still closes the child
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as workdir:
        decode = Decode(args, Path(workdir))
        bench = Bench(decode)
        try:
            bench.run()
            report = build(bench)
        except BaseException as exc:  # a failure or a timeout's TERM: what was measured is still written
            _write(partial_report(bench, f"{type(exc).__name__}: {exc}"), args.json)
            raise
        finally:
            decode.close()
    print_report(report)
    _write(report, args.json)
    return 0


def _write(report: dict[str, object], path: Path) -> None:
    paths = [path] + ([Path(os.environ["OUT"]) / "gpu_bench.json"] if os.environ.get("OUT") else [])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))
        print(f"JSON written to {path}")


if __name__ == "__main__":
    sys.exit(main())

"""The run as JSON (rows, targets, environment, geometry, what either service left behind) and as a table."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from benchmarks.gpu.bench import Bench
from benchmarks.gpu.environment import environment
from benchmarks.gpu.paths import reported_vs_ucx
from benchmarks.gpu.ranks import PAGE_TOKENS, spec
from benchmarks.gpu.rows import MODES, ratios, raw_rates
from benchmarks.gpu.targets import targets


def notes(bench: Bench) -> list[str]:
    """What the table's rows mean beyond their columns."""
    staging = bench.d.staging
    return [
        f"staged: both ranks stage through {staging.slot_bytes >> 20} MiB slots of a "
        f"{staging.span.size_bytes >> 20} MiB buffer ({staging.pairs.count} pairs each); batch = slots read",
        "staged push: prefill gathers each slot and WRITEs it into a pair decode lent (handoff.staged_push, as "
        "SGLang's manager does), decode checks and scatters it; the slot messages go over the bench's pipe, not "
        "SGLang's wire, and the lending is not timed",
        "pull/staged seconds: the read; load_s adds the claim's round trip and, with digests, both sides' digests",
        *bench.problems,
    ]


def partial_report(bench: Bench, failure: str) -> dict[str, Any]:
    """What a run that stopped early (``failure``: why) measured: the whole report where it can still be built,
    else the rows."""
    try:
        report = build(bench)
    except Exception as exc:  # the child or a service is gone: the rows alone
        report = {"rows": [dataclasses.asdict(r) for r in bench.rows], "report_error": f"{type(exc).__name__}: {exc}"}
    return {**report, "incomplete": failure}


def build(bench: Bench) -> dict[str, Any]:
    d, s = bench.d, spec()
    main = [r for r in d.caches.regions if r.kind == "main"]
    indexer = [r for r in d.caches.regions if r.kind == "indexer"]
    raw = raw_rates(bench.rows)
    rows = []
    for row in bench.rows:
        of_ceiling, of_op = ratios(row, raw)
        rows.append({**dataclasses.asdict(row), "gbps": row.gbps, "of_ceiling": of_ceiling, "of_raw_op": of_op})
    return {
        "environment": environment(d.kind.describe()),
        "geometry": {
            "model": "glm-5.3",
            "cache_dtype": s.cache_dtype,
            "main_regions": len(main),
            "main_bytes_per_token": s.row.row_bytes,
            "indexer_regions": len(indexer),
            "indexer_bytes_per_token": s.indexer.row_bytes,
            "layers": len(s.geometry.all_layers),
            "tokens": d.args.tokens,
            "page_tokens": PAGE_TOKENS,
            "pages": d.pages,
            "pool_pages": d.pool_pages,
            "bytes_per_request": d.nbytes,
        },
        "staging": {"slot_bytes": d.staging.slot_bytes, "buffer_bytes": d.staging.span.size_bytes},
        "setup_s": round(d.setup_s, 2),
        "total_s": round(time.monotonic() - d.started, 2),
        "repeats": d.args.repeats,
        "modes": dict(MODES),
        "rows": rows,
        "targets": [dataclasses.asdict(t) for t in targets(bench.rows, reported_vs_ucx(d))],
        "notes": notes(bench),
        "data_paths": {"decode": d.transport.info().data_path, "prefill": d.child.hello["data_path"]},
        "prefill_end": d.child.ask({"op": "finished"}),
        "decode_leftovers": d.decode.leftovers(),
    }


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def print_report(report: dict[str, Any]) -> None:
    env, geo = report["environment"], report["geometry"]
    print(
        f"{env.get('gpu', env['memory'])}, driver {env.get('driver', '-')}, torch {env.get('torch', '-')}, "
        f"nixl {env['nixl']}; UCX env {env['ucx_env'] or '(none)'}"
    )
    print(
        f"{geo['model']} {geo['cache_dtype']}: {geo['main_regions']} main regions × "
        f"{geo['main_bytes_per_token']} B/token, {geo['indexer_regions']} indexer × "
        f"{geo['indexer_bytes_per_token']} B/token; {geo['tokens']:,} tokens = "
        f"{geo['bytes_per_request'] / 1e9:.2f} GB; pool {geo['pool_pages']} pages of {geo['page_tokens']}; "
        f"setup {report['setup_s']} s, total {report['total_s']} s"
    )
    print(
        f"{'row':<15} {'pool':<10} {'dig':<3} {'op':<5} {'MB':>9} {'runs':>8} {'batch':>5} {'seconds':>9} "
        f"{'GB/s':>8} {'of ceil':>8} {'of op':>7}  UCX path"
    )
    for r in report["rows"]:
        head = f"{r['case']:<15} {r['pool']:<10} {'on' if r['digests'] else 'off':<3} {r['op']:<5}"
        if r["skipped"]:
            print(f"{head} skipped: {r['skipped']}")
            continue
        gbps = "—" if r["gbps"] is None else f"{r['gbps']:.2f}"
        note = ", ".join(f"{k} {v:.4f}" for k, v in r["extra"].items())
        print(
            f"{head} {r['bytes'] / 1e6:>9.1f} {r['runs']:>8,} {r['batches']:>5} {r['seconds']:>9.4f} {gbps:>8} "
            f"{_pct(r['of_ceiling']):>8} {_pct(r['of_raw_op']):>7}  {r['path']}"
            + (f": {r['path_detail']}" if r["path_detail"] else "")
            + (f"  ({note})" if note else "")
        )
    for line in report["notes"]:
        print(f"  note: {line}")
    print(f"{'target':<38} {'measured':>9} {'limit':>7}  verdict")
    for t in report["targets"]:
        verdict = "n/a" if t["ok"] is None else ("PASS" if t["ok"] else "FAIL")
        print(
            f"{t['name']:<38} {_pct(t['measured']):>9} {t['limit']:>7}  {verdict}"
            + (f"  {t['detail']}" if t["detail"] else "")
        )

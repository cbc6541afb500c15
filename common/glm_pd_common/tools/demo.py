"""``glm-pd demo``: one complete GLM-5.3 handoff between a prefill and a decode process on 127.0.0.1.

This process plays the router: it starts prefill, hands prefill's transfer params to decode, and reports.
The bytes move only between the two peer processes, through the chosen transport.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.trust import load_credential, make_credential
from glm_pd_common.layout.formats import check_page_tokens
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.args import token_count
from glm_pd_common.tools.cuda_driver import CudaDevice
from glm_pd_common.tools.demo_peers import MARK
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.tools.report import human_bytes, human_seconds, print_table
from glm_pd_common.transport.staging import STAGE_MODES, settings_problem


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def device_index(text: str) -> int | None:
    """``--device``: None for host memory, else the GPU's index (``cuda`` is GPU 0)."""
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return None
    if kind == "cuda" and (not index or index.isdigit()):
        return int(index or 0)
    raise argparse.ArgumentTypeError(f"{text!r}: expected cpu, cuda or cuda:N")


def check_job(job: dict[str, Any]) -> None:
    """Refuse, before any process starts, what cannot run: bad sizes, more memory than the machine has, a GPU
    that is not there."""
    for side in ("prefill", "decode"):
        check_page_tokens(job[f"{side}_page_tokens"], what=f"--{side}-page-tokens")
    n, prefix, d_pt = job["tokens"], job["prefix_tokens"], job["decode_page_tokens"]
    if n <= 0:
        raise ConfigError("--tokens must be positive")
    if prefix % d_pt or not 0 <= prefix < n:
        raise ConfigError(f"--prefix-tokens {prefix} must be a multiple of the decode page size {d_pt} below --tokens")
    spec = CacheSpec.create(ModelGeometry.preset(job["preset"]), job["kv_cache_dtype"], job["scale_format"])
    need = sum(
        HostCaches.bytes_needed(spec, page_tokens=pt, num_pages=int(num_pages_for(n, pt) * 1.25) + 2)
        for pt in (job["prefill_page_tokens"], d_pt)
    )
    if job["device"] is None and job["staging"] == "always":
        need += 2 * job["staging_mib"] << 20  # both sides' staging buffers
    if problem := settings_problem(job["staging"], job["staging_mib"], job["staging_slot_kib"]):
        raise ConfigError(f"--staging, --staging-mib, --staging-slot-kib: {problem}")
    if job["device"] is not None:
        CudaDevice(job["device"])  # no driver, or no such GPU: said here, not by both processes
    have = available_memory_bytes()
    if need > 0.85 * have:
        raise ConfigError(
            f"{n:,} tokens need {human_bytes(need)} of host memory for both sides' caches; this machine has "
            f"{human_bytes(have)} available. Use fewer --tokens (1M needs ~115 GB: run it on a bigger host)."
        )


def _reports(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[len(MARK) :]) for line in lines if line.startswith(MARK)]


def _pump(stream: Any, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Start both peers, relay prefill's params to decode, collect both reports (bounded waits)."""
    cmd = [sys.executable, "-m", "glm_pd_common.tools.demo_peers"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    prefill = subprocess.Popen([*cmd, "prefill"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    decode = None
    try:
        assert prefill.stdin and prefill.stdout
        prefill.stdin.write(json.dumps(job) + "\n")
        prefill.stdin.close()
        params = _read_report(prefill, job["timeout_s"] + 120)
        if "error" in params:
            return {
                "ok": False,
                "error": f"prefill could not start: {params['error']}",
                "states": [],
                "prefill": {"outcome": "refused to start"},
            }
        prefill_lines: list[str] = []
        pump = threading.Thread(target=_pump, args=(prefill.stdout, prefill_lines), daemon=True)
        pump.start()
        decode = subprocess.Popen([*cmd, "decode"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        out, _ = decode.communicate(json.dumps(job) + "\n" + json.dumps(params) + "\n", timeout=job["timeout_s"] + 120)
        try:  # after a release or an abort prefill ends at once; a refused handshake leaves it holding a lease
            prefill.wait(timeout=5 if decode.returncode == 0 else 1)
        except subprocess.TimeoutExpired:
            prefill.terminate()
            prefill.wait(timeout=10)
        pump.join(timeout=5)
        decode_reports, prefill_reports = _reports(out.splitlines()), _reports(prefill_lines)
        result = decode_reports[-1] if decode_reports else {"ok": False, "error": "decode died without a report"}
        result["prefill"] = prefill_reports[-1] if prefill_reports else {"outcome": "died"}
        result["exit_codes"] = {"prefill": prefill.returncode, "decode": decode.returncode}
        return result
    finally:
        for proc in (prefill, decode):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _read_report(proc: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    """Prefill's first marked line (its transfer params), skipping library log lines; bounded wait."""
    box: list[dict[str, Any]] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]  # started with stdout=PIPE
            if line.startswith(MARK):
                box.append(json.loads(line[len(MARK) :]))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not box:
        state = "is still starting" if proc.poll() is None else f"exited with code {proc.returncode}"
        raise ConfigError(f"prefill gave no report within {timeout_s:.0f} s: it {state}")
    return box[0]


def summarize(job: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    out = {
        "ok": bool(r.get("ok")) and r["prefill"].get("outcome") == "released",
        "transport": job["transport"],
        "tokens": job["tokens"],
        "prefix_tokens": job["prefix_tokens"],
        "prefill_page_tokens": job["prefill_page_tokens"],
        "decode_page_tokens": job["decode_page_tokens"],
        "allocator": job["allocator"],
        "states": r.get("states", []),
        "data_path": r.get("transport", {}).get("data_path"),
        "memory": "host" if job["device"] is None else f"GPU {job['device']}",
        "prefill_outcome": r["prefill"].get("outcome"),
        "side_channel": "CURVE, authenticated with the deployment key",
    }
    for key in (
        "bytes",
        "pages",
        "runs",
        "runs_by_kind",
        "seconds",
        "gbps",
        "memcpy_gbps",
        "regions",
        "posted_batches",
        "staged_bytes",
        "staging",
        "plan_ms",
        "verified_digests",
        "prefix_bytes_kept",
        "suffix_tokens_checked",
        "error",
    ):
        if key in r:
            out[key] = r[key]
    return out


def print_report(s: dict[str, Any]) -> None:
    rows = [
        ("result", "OK: every decode byte verified" if s["ok"] else f"FAILED: {s.get('error', 'see above')}"),
        ("request states", " -> ".join(s["states"])),
        ("transport", f"{s['transport']}: {s['data_path']}"),
        ("caches in", s["memory"]),
        ("side channel", s["side_channel"]),
    ]
    if "bytes" in s:
        b = s["bytes"]
        rows += [
            ("tokens", f"{s['tokens']:,} (decode prefix hit {s['prefix_tokens']:,})"),
            (
                "pages",
                f"prefill {s['pages']['prefill']:,} x {s['prefill_page_tokens']} tokens -> "
                f"decode {s['pages']['decode']:,} x {s['decode_page_tokens']} tokens ({s['allocator']})",
            ),
            ("regions", f"{s['regions']} (main per layer, indexer per full layer, MTP last)"),
            (
                "moved",
                f"{human_bytes(b['total'])} (main {human_bytes(b['main'])}, indexer {human_bytes(b['indexer'])})",
            ),
            (
                "suffix rule kept",
                f"decode's {human_bytes(s['prefix_bytes_kept'])} prefix unchanged (its own bytes, not prefill's); "
                f"{s['suffix_tokens_checked']:,} suffix tokens equal prefill's",
            ),
            (
                "runs",
                f"{s['runs']:,} coalesced (main {s['runs_by_kind']['main']:,}, indexer "
                f"{s['runs_by_kind']['indexer']:,}), {s['posted_batches']} "
                + ("slots read" if s["staged_bytes"] else "layer batches"),
            ),
            ("staging", _staging_line(s)),
            ("plan", f"{s['plan_ms']:.2f} ms"),
            (
                "transfer",
                f"{human_seconds(s['seconds'])} = {s['gbps']:.2f} GB/s "
                f"(memcpy ceiling here {s['memcpy_gbps']:.2f} GB/s)",
            ),
            ("digests", "verified per region" if s["verified_digests"] else "skipped (--no-verify)"),
            ("prefill", f"pages {s['prefill_outcome']}"),
        ]
    print_table(rows, "glm-pd demo: one GLM-5.3 prefill -> decode handoff on 127.0.0.1")


def _staging_line(s: dict[str, Any]) -> str:
    staging = s.get("staging")
    if staging is None:
        return "none: every run posted as its own descriptor"
    slot = human_bytes(staging["slot_bytes"])
    if not s["staged_bytes"]:
        return f"{staging['mode']}, slots of {slot}: this plan's runs were long enough to post directly"
    return f"{human_bytes(s['staged_bytes'])} gathered into slots of {slot}, each read as one descriptor"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from glm_pd_common.tools.demo_peers import MISMATCHES

    p = sub.add_parser("demo", help="run one real loopback handoff between two processes")
    p.add_argument("--preset", default="glm-5.3")
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
    p.add_argument("--indexer-scale-format", default="fp32", choices=["fp32", "ue8m0x4"])
    p.add_argument("--tokens", type=token_count, default=token_count("8k"))
    p.add_argument("--prefix-tokens", type=token_count, default=token_count("2k"))
    p.add_argument("--prefill-page-tokens", type=int, default=64)
    p.add_argument("--decode-page-tokens", type=int, default=64)
    p.add_argument("--allocator", choices=["contiguous", "shuffled"], default="shuffled")
    p.add_argument("--transport", choices=["nixl", "mooncake"], default="nixl")
    p.add_argument("--allow-tcp", action="store_true", help="accept a data path without RDMA (this box has none)")
    p.add_argument(
        "--device",
        type=device_index,
        default=None,
        metavar="cpu|cuda[:N]",
        help="where both sides' caches live: host memory (default), or GPU N (a first check on a GPU node)",
    )
    p.add_argument(
        "--staging",
        choices=STAGE_MODES,
        default="auto",
        help="move runs through staging slots: always, never, or auto (GPU caches with short runs, as the engines)",
    )
    p.add_argument("--staging-mib", type=int, default=256, help="each side's staging buffer")
    p.add_argument("--staging-slot-kib", type=int, default=32768, help="one slot: what one descriptor moves")
    p.add_argument("--mismatch", choices=sorted(MISMATCHES), help="make prefill differ in one fingerprint field")
    p.add_argument("--no-verify", action="store_true", help="skip the per-region digest check")
    p.add_argument(
        "--inject-corruption",
        action="store_true",
        help="fault injection: flip one decode byte after the transfer, to see the check name the page",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="bound on every wait, seconds")
    p.add_argument(
        "--credential",
        default="",
        help="the deployment key both peers authenticate with (`glm-pd keygen`; default: a new one for this run)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    job = {
        "preset": args.preset,
        "kv_cache_dtype": args.kv_cache_dtype,
        "scale_format": args.indexer_scale_format,
        "tokens": args.tokens,
        "prefix_tokens": args.prefix_tokens,
        "prefill_page_tokens": args.prefill_page_tokens,
        "decode_page_tokens": args.decode_page_tokens,
        "allocator": args.allocator,
        "transport": args.transport,
        "allow_tcp": args.allow_tcp,
        "mismatch": args.mismatch,
        "verify": not args.no_verify,
        "timeout_s": args.timeout,
        "lease_s": args.timeout,
        "inject_corruption": args.inject_corruption,
        "credential": args.credential,
        "device": args.device,
        "staging": args.staging,
        "staging_mib": args.staging_mib,
        "staging_slot_kib": args.staging_slot_kib,
    }
    check_job(job)
    with tempfile.TemporaryDirectory(prefix="glm-pd-demo-") as keys:
        if not job["credential"]:  # the side channel authenticates as a deployment's does
            job["credential"] = str(make_credential(Path(keys), "demo"))
        load_credential(job["credential"])  # a bad --credential is named before any process starts
        summary = summarize(job, run(job))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_report(summary)
    if not summary["ok"]:
        print(f"glm-pd demo: error: {summary.get('error', 'handoff failed')}", file=sys.stderr)
        return 1
    return 0

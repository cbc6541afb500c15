"""GPU smoke (issue 14): the core's handoff between two processes on one GPU, VRAM to VRAM over NIXL.

This process is decode; ``tests.gpu.prefill_child`` is prefill. Both hold GLM-5.3 caches in VRAM in glm-pd's
real page layout (main rows 656 B, indexer pages of 128 B keys then 4 B scales per token), registered with
NIXL (UCX picks cuda_ipc between processes on one node) with the device id taken from the tensors. Per case,
prefill fills the request's pages with a stale pattern, queues a slow GPU kernel and the final pattern,
records a CUDA event and grants the pages while the event is still pending; decode's ``DecodeService``
plans the suffix, claims it and READs the plan's runs. The bytes that landed are compared on the device
with the pattern decode computes itself (``torch.equal``; nothing is copied through a host pointer, and the
core's digest check, which reads pages on the host, stays off). The gated cases must hold the final bytes;
the ungated control shows what the gating prevents and is reported, not asserted.

Run ``python -m tests.gpu.smoke [--pages N] [--json PATH]`` (or ``scripts/gpu_smoke.sh`` on the GPU machine):
prints a table and writes JSON (``--json``, else ``$OUT/gpu_smoke.json`` when ``OUT`` is set). Exit status:
0 every check passed, 1 a check failed, 77 skipped (no CUDA, or NIXL or a core dependency missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

SKIP_RC = 77
REPO = Path(__file__).resolve().parents[2]
PAGE_TOKENS = 64  # CUDA DSA pages (FACTS §2)
SLEEP_S = 1.5  # the writer's deliberate delay: a read that is not gated lands long before the final bytes


def unavailable() -> str | None:
    """Why the smoke cannot run here, or None. Imports torch; NIXL only once torch sees a GPU."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    for module in ("numpy", "msgspec", "xxhash", "zmq"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (carry its wheel; see scripts/gpu_smoke.sh)"
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        return f"NIXL is not importable ({exc}); carry the nixl and nixl-cu13 wheels (scripts/gpu_smoke.sh)"
    return None


@dataclass(frozen=True)
class Case:
    name: str
    src: list[int]  # prefill's page table for the request
    dst: list[int]  # decode's
    num_tokens: int
    prefix_tokens: int  # decode's own prefix hit: those pages keep decode's bytes
    gate: str  # "ready": the read waits for the writer's event; "none": the control
    asserted: bool


def make_cases(pages: int, cache_pages: int) -> list[Case]:
    import numpy as np

    rng = np.random.default_rng(14)
    src_perm, dst_perm = rng.permutation(cache_pages)[:pages], rng.permutation(cache_pages)[:pages]
    full = pages * PAGE_TOKENS
    return [
        Case("contiguous", list(range(8, 8 + pages)), list(range(16, 16 + pages)), full, 0, "ready", True),
        Case("scattered", src_perm.tolist(), dst_perm.tolist(), full - 23, 4 * PAGE_TOKENS, "ready", True),
        Case("ungated control", list(range(pages))[::-1], list(range(pages)), full, 0, "none", False),
    ]


class Child:
    """The prefill process, spoken to by JSON lines."""

    def __init__(self, job: dict[str, Any]) -> None:
        from tests.support.lines import LineReader

        cmd = [sys.executable, "-m", "tests.gpu.prefill_child", json.dumps(job)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.lines = LineReader(self.proc.stdout)  # type: ignore[arg-type]  # PIPE: never None
        self.hello = self.read(240)

    def read(self, timeout_s: float = 120) -> dict[str, Any]:
        line = self.lines.next_matching(lambda ln: ln.startswith("SMOKE "), timeout_s)
        if line is None:
            raise RuntimeError(f"prefill process exited (rc {self.proc.wait()})")
        return json.loads(line[6:])

    def ask(self, cmd: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.read(timeout_s)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.ask({"op": "exit"}, 60)
                self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


class Decode:
    """This process's rank: VRAM caches on its own NIXL agent, and the core's DecodeService."""

    def __init__(self, cache_pages: int) -> None:
        from glm_pd_common.handoff.decode.service import DecodeService
        from glm_pd_common.handoff.wire.handshake import Endpoint
        from glm_pd_common.layout.fingerprint import PeerShape
        from glm_pd_common.transport.base import TransportConfig
        from glm_pd_common.transport.factory import create_transport
        from tests.gpu.vram import VramCaches, cuda_device, glm53_spec

        self.device = cuda_device()
        self.cache_pages = cache_pages
        spec = glm53_spec()
        self.caches = VramCaches(spec, page_tokens=PAGE_TOKENS, num_pages=cache_pages, device=self.device)
        self.transport = create_transport("smoke-decode-tp0", TransportConfig(allow_tcp=True, timeout_s=60))
        self.transport.register(self.caches.regions)
        local = Endpoint("smoke-decode", spec, self.caches.regions, self.transport, PeerShape(PAGE_TOKENS, 1, 0))
        # The core's digest check reads pages through host pointers: off for VRAM; torch.equal checks instead.
        self.service = DecodeService(local, timeout_s=60.0, verify_digests=False)

    def load(self, request_id: str, case: Case, remote: Any) -> Any:
        import numpy as np

        from glm_pd_common.handoff.decode.loads import LoadJob

        src, dst = np.asarray(case.src, dtype=np.int64), np.asarray(case.dst, dtype=np.int64)
        self.service.submit(LoadJob(request_id, remote, src, dst, case.num_tokens, case.prefix_tokens))
        deadline = time.monotonic() + 180.0
        while time.monotonic() < deadline:
            for result in self.service.results():
                if result.request_id == request_id:
                    return result
            time.sleep(0.005)
        raise TimeoutError(f"no load result for {request_id} within 180 s")

    def bytes_not_final(self, case: Case, own_seed: int, final_seed: int) -> int:
        """Bytes of every region that differ from what the load should leave (0: ``torch.equal`` everywhere)."""
        import torch

        first, end = case.prefix_tokens // PAGE_TOKENS, -(-case.num_tokens // PAGE_TOKENS)
        src = torch.as_tensor(case.src[first:end], dtype=torch.int64, device=self.device)
        dst = torch.as_tensor(case.dst[first:end], dtype=torch.int64, device=self.device)
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        for no, region in enumerate(self.caches.regions):
            exp = self.caches.expected(no, own_seed=own_seed, src_seed=final_seed, src_pages=src, dst_pages=dst)
            got = self.caches.tensor(region)
            if not torch.equal(got, exp):
                bad += (got != exp).sum()
        return int(bad.item())

    def close(self) -> None:
        self.service.close()
        self.transport.close()


def moved_tokens(case: Case) -> int:
    """Token slots a load writes: from decode's prefix to the end of the last page (pages travel whole)."""
    return -(-case.num_tokens // PAGE_TOKENS) * PAGE_TOKENS - case.prefix_tokens


def expected_bytes(case: Case) -> dict[str, int]:
    """What a load of ``case`` moves, from FACTS' per-token sizes (not from the plan)."""
    from tests.gpu.vram import INDEXER_KEY_BYTES, INDEXER_LAYERS, INDEXER_SCALE_BYTES, MAIN_LAYERS, MAIN_ROW_BYTES

    tokens = moved_tokens(case)
    index_row = INDEXER_KEY_BYTES + INDEXER_SCALE_BYTES
    return {"main": tokens * MAIN_ROW_BYTES * MAIN_LAYERS, "indexer": tokens * index_row * INDEXER_LAYERS}


def run(pages: int) -> dict[str, Any]:
    import torch

    from glm_pd_common.handoff.decode.loads import RemotePrefill
    from tests.gpu.vram import INDEXER_LAYERS, MAIN_LAYERS

    cache_pages = pages + 64
    report: dict[str, Any] = {"cases": [], "checks": [], "request_pages": pages}

    def check(name: str, ok: bool, detail: str = "") -> None:
        report["checks"].append({"check": name, "ok": bool(ok), "detail": detail})

    t_start = time.perf_counter()
    child = Child({"page_tokens": PAGE_TOKENS, "num_pages": cache_pages})
    decode: Decode | None = None
    try:
        decode = Decode(cache_pages)
        caches, device = decode.caches, decode.device
        report.update(
            device=torch.cuda.get_device_name(device),
            torch=torch.__version__,
            nixl=_version("nixl"),
            ucx_tls=os.environ.get("UCX_TLS", "(UCX's choice)"),
            prefill=child.hello,
            cache_bytes_per_process=caches.total_bytes,
            setup_s=round(time.perf_counter() - t_start, 2),
        )
        check("regions", len(caches.regions) == MAIN_LAYERS + INDEXER_LAYERS == child.hello["regions"])
        check(
            "device ids from the tensors",
            all(r.device_id == caches.device_id == device.index for r in caches.regions)
            and child.hello["device_id"] == device.index,
            f"decode {caches.device_id}, prefill {child.hello['device_id']}, tensors on {device}",
        )
        check("regions registered as VRAM", all(r.mem_kind == "VRAM" for r in caches.regions))
        remote = RemotePrefill("smoke-prefill", "127.0.0.1", child.hello["port"], 1)
        cases = make_cases(pages, cache_pages)
        for i, case in enumerate(cases):
            own, stale, final, rid = 100 + i, 200 + i, 300 + i, f"smoke-{i}"
            caches.fill(own, torch.arange(cache_pages, device=device, dtype=torch.int64))
            torch.cuda.synchronize()
            write = {"op": "write", "request_id": rid, "pages": case.src, "stale_seed": stale, "final_seed": final}
            granted = child.ask({**write, "sleep_s": SLEEP_S, "gate": case.gate})
            t0 = time.perf_counter()
            result = decode.load(rid, case, remote)
            wall_s = time.perf_counter() - t0
            bad = decode.bytes_not_final(case, own, final)
            want = expected_bytes(case)
            row = {
                "case": case.name,
                "gating": granted["gating"],
                "pending_at_grant": granted["pending_at_grant"],
                "ok": result.ok,
                "reason": result.reason,
                "code": result.code,
                "tokens": case.num_tokens - case.prefix_tokens,
                "token_slots": moved_tokens(case),
                "bytes_by_kind": result.bytes_by_kind,
                "expected_bytes_by_kind": want,
                "runs": result.runs,
                "batches": result.batches,
                "seconds": result.seconds,
                "gbps": sum(result.bytes_by_kind.values()) / result.seconds / 1e9 if result.seconds > 0 else 0.0,
                "phases_s": result.phases,
                "wall_s": wall_s,
                "bytes_final": bad == 0,
                "bytes_not_final": bad,
            }
            report["cases"].append(row)
            if case.asserted:
                check(f"{case.name}: load ok", result.ok, result.reason)
                check(f"{case.name}: bytes moved", result.bytes_by_kind == want, f"{result.bytes_by_kind} vs {want}")
                check(f"{case.name}: final bytes on the device", bad == 0, f"{bad} bytes differ")
                check(f"{case.name}: event pending at grant", granted["pending_at_grant"], "else nothing was gated")
        ended = child.ask({"op": "finished"})
        report["prefill_end"] = ended
        for i, case in enumerate(cases):
            outcome = ended["finished"].get(f"smoke-{i}", ["missing", ""])[0]
            check(f"{case.name}: prefill lease released", outcome == "released", outcome)
        held = ended["leftovers"]
        check("prefill holds nothing", held["leases"] == held["unready"] == held["plans"] == 0, str(held))
    finally:
        if decode is not None:
            decode.close()
        child.close()
    report["total_s"] = round(time.perf_counter() - t_start, 2)
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['device']}, torch {report['torch']}, nixl {report['nixl']}, UCX_TLS {report['ucx_tls']}")
    print(f"{report['cache_bytes_per_process'] / 1e9:.2f} GB of caches per process; setup {report['setup_s']} s")
    head = f"{'case':<16} {'tokens':>8} {'MB main':>9} {'MB idx':>8} {'runs':>7} {'seconds':>8} {'GB/s':>7}  bytes"
    print(head)
    for row in report["cases"]:
        kinds = row["bytes_by_kind"]
        verdict = "final" if row["bytes_final"] else f"{row['bytes_not_final']} not final"
        print(
            f"{row['case']:<16} {row['tokens']:>8} {kinds.get('main', 0) / 1e6:>9.1f} "
            f"{kinds.get('indexer', 0) / 1e6:>8.1f} {row['runs']:>7} {row['seconds']:>8.4f} {row['gbps']:>7.1f}  "
            f"{verdict}; gated: {row['gating']}" + ("" if row["ok"] else f"; FAILED {row['code']}: {row['reason']}")
        )
    for c in report["checks"]:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}" + (f" ({c['detail']})" if c["detail"] else ""))
    print(f"{'PASSED' if report['ok'] else 'FAILED'} in {report['total_s']} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pages", type=int, default=2048, help="pages per request (64 tokens each)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the report")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"SKIPPED: {reason}")
        return SKIP_RC
    path = args.json or (Path(os.environ["OUT"]) / "gpu_smoke.json" if os.environ.get("OUT") else None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM: the report says so, children close
    try:
        report = run(args.pages)
    except BaseException as exc:  # a failure or a timeout's TERM: why, written where the report would be
        if path is not None:
            path.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}, indent=2))
        if isinstance(exc, Exception):
            traceback.print_exc()
            return 1
        raise
    print_table(report)
    if path is not None:
        path.write_text(json.dumps(report, indent=2))
        print(f"report: {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

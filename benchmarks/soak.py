"""A bounded soak of GlmPdConnector: a prefill and a decode instance (tests/support/vllm_pd_serve.py, real NIXL on
loopback) serving random requests (64..1,400 tokens, half with a decode prefix hit) a few at a time, with a
low rate of injected faults, for a few minutes. Reports throughput per window, failures by kind, requests
served from bad KV (must be 0), blocks left once idle (must be 0), p50/p99 handoff time and both processes'
RSS over time. Prints a table, writes JSON.

Run in the vLLM venv: ``$(cat .venv-vllm-path)/bin/python -m benchmarks.soak --minutes 3``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.emit import emit_rows
from tests.support import vllm_fault_matrix as fm
from tests.support.vllm_harness import make_tiny_model

# fault -> what the faulted request must end as
FAULTS = {"corrupt": "failed", "transport_error": "failed", "lose_release": "failed", "duplicate_release": "loaded",
          "abort": "aborted"}  # fmt: skip


def soak(minutes: float, fault_rate: float, window: int, port: int, seed: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="glm-pd-soak-"))
    model = make_tiny_model(work / "model")
    rng = random.Random(seed)
    job = {"model": model, "pool_tokens": 256 * 64, "lease_s": 20.0}
    prefill = fm.Peer("kv_producer", "P", port, work, **job)
    decode = fm.Peer("kv_consumer", "D", port, work, **job)
    inflight: dict[str, str] = {}  # rid -> expected outcome
    outcomes: Counter[str] = Counter()
    unexpected: list[dict] = []
    times: list[float] = []
    samples: list[dict] = []
    served_wrong = n = 0
    start = time.monotonic()
    end, next_sample = start + minutes * 60, start
    try:
        while time.monotonic() < end or inflight:
            while len(inflight) < window and time.monotonic() < end:
                n += 1
                rid, tokens = f"s{n}", rng.randint(64, 1400)
                prefix = rng.choice([0, 64 * rng.randint(0, (tokens - 1) // 64)])
                fault = rng.choice(sorted(FAULTS)) if rng.random() < fault_rate else ""
                prefill.send(op="prefill", rid=rid, tokens=tokens, seed=n)
                params = prefill.wait("params", rid)["params"]
                decode.send(op="decode", rid=rid, params=params, prefix=prefix, seed=n,
                            fault="" if fault == "abort" else fault)  # fmt: skip
                if fault == "abort":
                    decode.send(op="abort", rid=rid)
                inflight[rid] = FAULTS.get(fault, "loaded")
            res = decode.wait("result", timeout=fm.TIMEOUT_S * 6)
            expect = inflight.pop(res["rid"])
            got = "aborted" if res.get("aborted") else res["outcome"]
            outcomes[f"{got} (expected)" if got == expect else f"{got} (UNEXPECTED)"] += 1
            served_wrong += bool(res.get("served_wrong"))
            if got != expect:
                unexpected.append({"rid": res["rid"], "expected": expect, "got": got, "reason": res.get("reason")})
            if got == "loaded":
                times.append(res["t"] - res["t0"])
            if time.monotonic() >= next_sample:
                p, d = prefill.status(), decode.status()
                prefill.discard("freed")
                samples.append({"t_s": round(time.monotonic() - start, 1), "done": sum(outcomes.values()),
                                "prefill_rss_mb": p["rss_kb"] // 1024, "decode_rss_mb": d["rss_kb"] // 1024,
                                "prefill_blocks": p["blocks_held"], "decode_blocks": d["blocks_held"]})  # fmt: skip
                next_sample += 15
        deadline = time.monotonic() + fm.SETTLE_S + 20  # the last leases and holds end
        while True:
            p, d = prefill.status(), decode.status()
            if (p["blocks_held"] == 0 and d["blocks_held"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        prefill.close()
        decode.close()
    times.sort()
    return {
        "minutes": minutes, "requests": n, "outcomes": dict(outcomes), "unexpected": unexpected,
        "served_wrong": served_wrong, "prefill_blocks_left": p["blocks_held"], "decode_blocks_left": d["blocks_held"],
        "service_state_left": {k: v for s in (p, d) for k, v in s.items() if k in fm._SERVICE_STATE and v},
        "handoff_p50_ms": round(statistics.median(times) * 1e3, 1) if times else None,
        "handoff_p99_ms": round(times[int(0.99 * (len(times) - 1))] * 1e3, 1) if times else None,
        "samples": samples, "logs": str(work),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--fault-rate", type=float, default=0.05)
    parser.add_argument("--window", type=int, default=3, help="requests in flight at once")
    parser.add_argument("--port", type=int, default=23700)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    args = parser.parse_args()
    result = soak(args.minutes, args.fault_rate, args.window, args.port, args.seed)
    header = (
        f"soak {result['minutes']} min: {result['requests']} requests, outcomes {result['outcomes']}, "
        f"served from bad KV {result['served_wrong']}, blocks left P/D "
        f"{result['prefill_blocks_left']}/{result['decode_blocks_left']}, "
        f"handoff p50 {result['handoff_p50_ms']} ms p99 {result['handoff_p99_ms']} ms\n"
        f"{'t s':>6} {'done':>6} {'P RSS MB':>9} {'D RSS MB':>9} {'P blocks':>9} {'D blocks':>9}"
    )
    emit_rows(
        [result],
        args.out,
        as_json=args.json,
        header=header,
        line=lambda r: "\n".join(
            f"{s['t_s']:>6} {s['done']:>6} {s['prefill_rss_mb']:>9} {s['decode_rss_mb']:>9} "
            f"{s['prefill_blocks']:>9} {s['decode_blocks']:>9}"
            for s in r["samples"]
        ),
    )


if __name__ == "__main__":
    main()

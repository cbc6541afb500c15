"""A bounded soak of the glm-pd SGLang backend: one prefill/decode pair (tests/support/sglang_proc.py, real SGLang
backend classes, NIXL on loopback) serving a long run of random rooms (64..1,400 tokens, half with a decode
prefix hit), with a low rate of injected faults. Reports rooms served, outcomes by fault, rooms served from
bad KV (decode Success whose pages differ from prefill's: must be 0), pages and per-room state left (must be
0), p50/p99 room time and RSS at the start and end. Prints a table, writes JSON.

Run in the SGLang venv: ``$(cat .venv-sglang-path)/bin/python -m benchmarks.sglang_soak --rooms 600``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.emit import emit_rows
from tests.support.sglang_pair import Pair
from tests.support.tiny_glm import TINY_GLM

FAULTS = {"fault": ["abort", "corrupt"], "prefill_fault": ["error", "abort"]}  # all must end Failed


def soak(rooms: int, fault_rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="glm-pd-sgsoak-"))
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(TINY_GLM))
    requests = []
    for i in range(rooms):
        tokens = rng.randint(64, 1400)
        req = {"room": 10_000 + i, "tokens": tokens, "prefix": rng.choice([0, 64 * rng.randint(0, (tokens - 1) // 64)])}
        if rng.random() < fault_rate:
            key = rng.choice(sorted(FAULTS))
            req[key] = rng.choice(FAULTS[key])
        requests.append(req)
    env = {"SGLANG_GLM_PD_VERIFY_CHECKSUMS": "1", "SGLANG_GLM_PD_TIMEOUT_S": "3"}
    prefill, decode = Pair(work, str(work / "model")).run(requests, env=env, pool_pages=96, timeout_s=3600)
    outcomes: Counter[str] = Counter()
    wrong, times = 0, []
    for req, p, d in zip(requests, prefill["results"], decode["results"], strict=True):
        fault = req.get("fault") or (f"prefill {req['prefill_fault']}" if "prefill_fault" in req else "none")
        ok = d["states"] == [4]
        outcomes[f"{fault}: {'success' if ok else 'failed'}"] += 1
        if ok:
            wrong += d["dst_digests"] != p["src_digests"]
            if fault == "none":
                times.append(d["seconds"])
    times.sort()
    return {
        "rooms": rooms, "outcomes": dict(outcomes), "served_wrong": wrong,
        "pages_left": [prefill["pool_pages"] - n for n in prefill["free_pages"]]
        + [decode["pool_pages"] - n for n in decode["free_pages"]],
        "state_left": [h for r in (prefill, decode) for h in r["leftovers"] if any(h.values())],
        "room_p50_ms": round(statistics.median(times) * 1e3, 1),
        "room_p99_ms": round(times[int(0.99 * (len(times) - 1))] * 1e3, 1),
        "rss_mb": {"prefill": [prefill["results"][0]["rss_kb"] // 1024, prefill["results"][-1]["rss_kb"] // 1024],
                   "decode": [decode["results"][0]["rss_kb"] // 1024, decode["results"][-1]["rss_kb"] // 1024]},
        "logs": str(work),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rooms", type=int, default=600)
    parser.add_argument("--fault-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    parser.add_argument("--out", default="benchmarks/results/sglang_soak.json")
    args = parser.parse_args()
    result = soak(args.rooms, args.fault_rate, args.seed)
    emit_rows(
        [result],
        args.out,
        as_json=args.json,
        header=(
            f"{'rooms':>6} {'wrong':>6} {'pages left':>11} {'p50 ms':>8} {'p99 ms':>8}  RSS MB (start, end)  outcomes"
        ),
        line=lambda r: (
            f"{r['rooms']:>6} {r['served_wrong']:>6} {sum(r['pages_left']):>11} {r['room_p50_ms']:>8} "
            f"{r['room_p99_ms']:>8}  P {r['rss_mb']['prefill']} D {r['rss_mb']['decode']}  {r['outcomes']}"
        ),
    )


if __name__ == "__main__":
    main()

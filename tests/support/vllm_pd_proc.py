"""One instance of a prefill/decode pair in its own process, for the handoff, TP and tiny-DSA tests.

The engine is ``tests.support.vllm_engine.Engine``: vLLM's own Scheduler, KVCacheManager and block pool around
GlmPdConnector (the scheduler side made by vLLM's factory, one worker-side connector per TP rank), NIXL or
Mooncake on loopback. Block ids are the block pool's. A decode ``prefix_tokens`` is a real prefix-cache hit where
vLLM turned prefix caching on: decode first computes those tokens itself (its own bytes, not prefill's).
Test double: the GPU forward alone: that module's segment writer, or for ``e2e`` jobs the tiny DSA model's
forward (tests/support/tiny_dsa.py), which writes fp8_ds_mla rows and split indexer pages into the blocks vLLM
assigned and samples greedily.

Run: ``python -m tests.support.vllm_pd_proc JOB_JSON``. Prefill reports its requests' kv_transfer_params and
sampled tokens, then which requests vLLM freed. Decode reports ``ready`` once its engine (and own prefix hit) is
up, reads the params on stdin (the router's relay), reports what vLLM asked the connector and what it answered,
then each request's outcome. Report lines are ``PD {json}``
and carry ``engine``: what vLLM configured (block size, prefix caching, AMX), so tests never assume it.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from vllm.v1.request import Request

from tests.support.vllm_engine import Engine

SEED = 5  # request i's KV bytes come from seed SEED + i
PREFIX_SALT = 1000  # decode's own prefix bytes differ from prefill's: a read that strays into them shows
ENGINE: dict = {}  # what vLLM configured, sent with every report


def say(obj: dict) -> None:
    sys.stdout.write("PD " + json.dumps({**obj, "engine": ENGINE}) + "\n")
    sys.stdout.flush()


class TinyDsaEngine(Engine):
    """The engine with the tiny DSA model's forward in place of the segment writer (a test double for the GPU
    forward: real cache layouts, CPU arithmetic). A request listed in ``drop_indexer_past`` has its indexer
    pages past that many tokens (its local hit) zeroed before its first forward: the negative control, a
    handoff that moved the KV but not the indexer."""

    def __init__(self, job: dict) -> None:
        from glm_pd_common.layout.geometry import ModelGeometry
        from tests.support.tiny_dsa import TinyDsa

        super().__init__(job)
        geometry = ModelGeometry.from_config(job["model"], include_mtp=False)
        self.model = TinyDsa(geometry.num_layers, list(geometry.full_indexer_layers), seed=job["e2e"]["seed"])
        self.drop_indexer_past: dict[str, int] = {}
        self._dropped: set[tuple[str, int]] = set()
        self._sampled: dict[tuple[int, str], list[int]] = {}  # (first rank of a DCP group, request) -> its tokens

    def compute(self, rank: int, request: Request, table: np.ndarray, start: int, end: int) -> list[int]:
        """Under DCP the first rank of each group of N runs the forward over the group's N shards (as DCP
        attention gathers them); the others sample what it sampled."""
        from tests.support.tiny_dsa import PagedCache, ShardedCache

        n, rid = self.sharding.token_shards, request.request_id
        if rank % n:
            return self._sampled[rank - rank % n, rid]
        group = [self.caches[r] for r in range(rank, rank + n)]
        past = self.drop_indexer_past.get(rid)
        if past is not None and (rid, rank) not in self._dropped:
            self._dropped.add((rid, rank))
            for caches in group:
                for (kind, _), buf in caches.buffers.items():
                    if kind == "indexer":
                        buf[table[past // self.scheduler_block :]] = 0
        rows = {"main": group[0].spec.row.row_bytes, "indexer": group[0].spec.indexer.row_bytes}
        paged = []
        for caches in group:
            views = {key: torch.from_numpy(buf) for key, buf in caches.buffers.items()}
            by_kind = {kind: {lay: v[:, : self.block_size * rows[kind]] for (k, lay), v in views.items() if k == kind}
                       for kind in rows}  # fmt: skip
            paged.append(PagedCache(by_kind["main"], by_kind["indexer"], table, self.block_size))
        cache = paged[0] if n == 1 else ShardedCache(paged, self.sharding.interleave)
        logits = None
        for pos in range(start, end):
            logits = self.model.step(request.all_token_ids[pos], pos, cache)
        sampled = [int(torch.argmax(logits))] if logits is not None and end >= request.num_tokens else []
        self._sampled[rank, rid] = sampled
        return sampled


def serve(engine: Engine, until: Callable[[], bool], seconds: float, each: Callable[[], None] | None = None) -> None:
    """EngineCore's loop for at most ``seconds``, until ``until()`` holds (loads and releases run on the
    connector's threads meanwhile)."""
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        stepped = engine.step()
        if each is not None:
            each()
        time.sleep(0.002 if stepped else 0.01)


def prompt(job: dict, i: int) -> list[int]:
    """Request i's prompt, the same in both processes (the router sends both the same tokens)."""
    if job.get("e2e"):
        return list(job["e2e"]["prompts"][i])
    return list(range((i + 1) * 1_000_000, (i + 1) * 1_000_000 + job["tokens"]))


def segments(job: dict, i: int, end: int, own: int = 0) -> list[tuple[int, int]]:
    """The segment writer's content for request i up to ``end``, decode's own first ``own`` tokens salted. None
    under the tiny model: its bytes are what it computes, and its tokens are the check."""
    if job.get("e2e"):
        return []
    return [(own, SEED + i + PREFIX_SALT), (end, SEED + i)] if own else [(end, SEED + i)]


def run_prefill(engine: Engine, job: dict) -> None:
    rids = job["requests"]
    for i, rid in enumerate(rids):
        tokens = prompt(job, i)
        engine.add(rid, tokens, segments(job, i, len(tokens)), {"do_remote_decode": True})
    serve(engine, lambda: all(engine.tracked[r].finish for r in rids), job["wait_s"])
    tracked = [engine.tracked[r] for r in rids]
    say({"params": [t.kv_transfer_params for t in tracked], "first": [(t.tokens or [None])[0] for t in tracked]})
    start = time.monotonic()
    serve(engine, lambda: not set(rids) & set(engine.scheduler.requests), job["wait_s"])
    say({"freed": sorted(set(rids) - set(engine.scheduler.requests)), "elapsed_s": time.monotonic() - start})
    serve(engine, lambda: False, job.get("linger_s", 0))  # keep serving: a late decode must get an answer


def own_prefix(engine: Engine, job: dict) -> int:
    """Decode's own prefix-cache hit, made before prefill's params arrive: decode computes the first
    ``prefix_tokens`` of each prompt itself and vLLM caches them. 0 where vLLM has prefix caching off."""
    prefix = job["prefix_tokens"] if engine.prefix_caching else 0
    if prefix:
        for i, rid in enumerate(job["requests"]):
            engine.add(f"{rid}/own-prefix", prompt(job, i)[:prefix], segments(job, i, prefix, prefix), None)
        serve(engine, lambda: not engine.scheduler.requests, job["wait_s"])
    return prefix


def run_decode(engine: Engine, job: dict, prefix: int, params: list[dict]) -> None:
    rids = job["requests"]
    steps = job["e2e"]["steps"] if job.get("e2e") else 1
    asked: dict[str, list] = {}  # request id -> [vLLM's local hit, the connector's count, async]
    connector = engine.connector
    matched = connector.get_num_new_matched_tokens

    def recording(request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, is_async = matched(request, num_computed_tokens)
        asked[request.request_id] = [num_computed_tokens, count, is_async]
        if isinstance(engine, TinyDsaEngine) and job["e2e"].get("drop_indexer"):
            engine.drop_indexer_past[request.request_id] = num_computed_tokens  # what vLLM holds locally stays
        return count, is_async

    connector.get_num_new_matched_tokens = recording  # type: ignore[method-assign]
    requests: dict[str, Request] = {}
    for i, (rid, p) in enumerate(zip(rids, params, strict=True)):
        tokens = prompt(job, i)
        engine.add(rid, tokens, segments(job, i, len(tokens), prefix), p, max_tokens=steps)
        requests[rid] = engine.scheduler.requests[rid]
    tables: dict[str, list[int]] = {}  # each request's blocks, as vLLM's KVCacheManager last gave them

    def record_tables() -> None:
        for rid in set(rids) & set(engine.scheduler.requests):
            tables[rid] = list(engine.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    serve(engine, lambda: set(rids) <= set(asked), job["wait_s"], record_tables)  # allocation comes with asking
    say({"matched": {r: asked[r][1:] for r in rids if r in asked}, "hits": {r: asked[r][0] for r in asked}})
    serve(engine, lambda: not set(rids) & set(engine.scheduler.requests), job["wait_s"], record_tables)
    out = {}
    for rid in rids:
        track, live = engine.tracked[rid], rid in engine.scheduler.requests
        loaded = rid in engine.reported_recving and rid not in engine.reported_failed
        hit_blocks = asked.get(rid, [0])[0] // engine.scheduler_block
        out[rid] = {
            "outcome": "timeout" if live else "failed" if rid in engine.reported_failed else
                       "loaded" if loaded else "no_load",
            "loaded": loaded,
            "finish": track.finish,
            "tokens": track.tokens,
            "mismatched": track.mismatched[:5],
            "checked_ranks": sorted(track.checked),
            "suffix_blocks": sorted(tables.get(rid, [])[hit_blocks:]),
            "do_remote_prefill": (requests[rid].kv_transfer_params or {}).get("do_remote_prefill"),
        }  # fmt: skip
    say({"requests": out, "bad_blocks": sorted(engine.invalid_block_ids), "stats": engine.rank_counts})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    job = json.loads(sys.argv[1])
    threading.current_thread().name = job["role"]
    engine = TinyDsaEngine(job) if job.get("e2e") else Engine(job)
    ENGINE.update(
        block_size=engine.block_size,
        prefix_caching=engine.prefix_caching,
        amx=bool(torch.cpu._is_amx_tile_supported()),
    )
    try:
        if job["role"] == "kv_producer":
            run_prefill(engine, job)
        else:
            prefix = own_prefix(engine, job)
            say({"ready": True})
            run_decode(engine, job, prefix, json.loads(sys.stdin.readline()))  # the router's relay of prefill's params
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

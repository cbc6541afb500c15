"""One vLLM instance's connector side, driven through the hooks in the order vLLM calls them.

A real ``VllmConfig`` (tiny local GLM-5.x config), real ``GlmPdConnector`` objects for the scheduler and
for each TP rank's worker (ranks as threads), real ``Request``/``KVCacheBlocks``/``SchedulerOutput``
objects, and CPU tensors named and shaped as vLLM allocates them for a DSA model (one backing buffer per
layer, ``[num_blocks, 1, block_size, 656]`` main and ``[num_blocks, 1, block_size, 132]`` indexer). Test
double: the model forward itself (no GPU here): prefill's "compute" writes layout-valid token bytes into
the request's blocks, as the attention kernels would.

Run: ``python -m tests.support.vllm_pd_proc JOB_JSON``; prefill prints the kv_transfer_params of its requests, then
which blocks it freed; decode reads the params on stdin and prints each request's outcome. Lines are marked ``PD``.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
from collections import Counter

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request, RequestStatus

from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_vllm.config import GlmPdVllmConfig
from glm_pd_vllm.params import cache_spec

SEED = 5
# Decode's own prefix-cache hit holds other bytes than prefill's (a different seed): a read that strays into the
# prefix overwrites them with prefill's and the check below sees it.
PREFIX_SEED = SEED + 1000
ENGINE: dict = {}  # what vLLM configured (set by Instance), sent with every report: tests never assume it


def say(obj: dict) -> None:
    sys.stdout.write("PD " + json.dumps({**obj, "engine": ENGINE}) + "\n")
    sys.stdout.flush()


def vllm_config(job: dict, rank: int) -> VllmConfig:
    extra = {
        "side_channel_port": job["port"],
        "allow_tcp": True,
        "timeout_s": 20.0,
        "lease_s": job["lease_s"],
        "verify_checksums": True,
        **job.get("extra", {}),
    }
    kv = KVTransferConfig(
        kv_connector="GlmPdConnector",
        kv_connector_module_path=job.get("module_path"),
        kv_role=job["role"],
        engine_id=job["engine_id"],
        kv_connector_extra_config=extra,
        kv_load_failure_policy=job.get("failure_policy", "fail"),
    )
    return VllmConfig(
        model_config=ModelConfig(model=job["model"], skip_tokenizer_init=True, enforce_eager=True),
        cache_config=CacheConfig(block_size=job["block_size"], cache_dtype=job.get("cache_dtype", "fp8")),
        parallel_config=ParallelConfig(
            tensor_parallel_size=job["tp"],
            rank=rank,
            data_parallel_size=job.get("dp_size", 1),
            data_parallel_rank=job.get("dp_rank", 0),
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv,
    )


def kv_caches(caches: HostCaches) -> dict[str, torch.Tensor]:
    """vLLM's names and shapes, over the same memory the HostCaches fill and check."""
    out = {}
    for (kind, layer), buf in caches.buffers.items():
        row = caches.spec.row.row_bytes if kind == "main" else caches.spec.indexer.row_bytes
        view = torch.from_numpy(buf).view(caches.num_pages, 1, caches.page_tokens, row)
        out[f"model.layers.{layer}.self_attn.{'attn' if kind == 'main' else 'indexer.k_cache'}"] = view
    return out


class Instance:
    """One engine: a scheduler-side connector and one worker-side connector per TP rank."""

    def __init__(self, job: dict) -> None:
        self.job = job
        configs = [vllm_config(job, r) for r in range(job["tp"])]
        # vLLM's platform may override the requested block size (the CPU MLA backend without AMX forces 16):
        # from here on the harness shapes its caches and tables with what the engine chose.
        job["block_size"] = configs[0].cache_config.block_size
        job["num_blocks"] = job.pop("pool_tokens") // job["block_size"]  # the pool is sized in tokens
        ENGINE.update(
            block_size=job["block_size"],
            prefix_caching=bool(configs[0].cache_config.enable_prefix_caching),
            amx=bool(torch.cpu._is_amx_tile_supported()),
        )
        kv_cache_config = KVCacheConfig(num_blocks=job["num_blocks"], kv_cache_tensors=[], kv_cache_groups=[])
        self.scheduler = KVConnectorFactory.create_connector(configs[0], KVConnectorRole.SCHEDULER, kv_cache_config)
        self.workers = [
            KVConnectorFactory.create_connector(c, KVConnectorRole.WORKER, kv_cache_config) for c in configs
        ]
        spec = cache_spec(
            configs[0], GlmPdVllmConfig.from_extra(configs[0].kv_transfer_config.kv_connector_extra_config)
        )
        self.caches = [HostCaches(spec, page_tokens=job["block_size"], num_pages=job["num_blocks"]) for _ in configs]
        for worker, caches in zip(self.workers, self.caches, strict=True):
            worker.register_kv_caches(kv_caches(caches))
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()

    def step(self) -> tuple[set[str], set[str], set[str], set[int]]:
        """One engine step: scheduler metadata -> every worker (bind, start_load_kv, results, clear)."""
        meta = self.scheduler.build_connector_meta(SchedulerOutput.make_empty())
        failed: set[str] = set()
        bad_blocks: set[int] = set()
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            res = worker.get_transfer_results(set())
            bad_blocks |= worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            self.sent.update(res.finished_sending)
            self.received.update(res.finished_recving)
            failed |= res.failed_recving
        # as vLLM's KVOutputAggregator: finished once every worker has reported it, in any step
        n = len(self.workers)
        return (
            {r for r, c in self.sent.items() if c == n},
            {r for r, c in self.received.items() if c == n},
            failed,
            bad_blocks,
        )

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


def request(rid: str, num_tokens: int, params: dict) -> Request:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(num_tokens)), sp, None)


def tables(job: dict, seed: int) -> list[np.ndarray]:
    """Disjoint random block tables, one per request, as an allocator under load hands them out."""
    per = -(-job["tokens"] // job["block_size"])
    pool = np.random.default_rng(seed).permutation(job["num_blocks"])
    return [pool[i * per : (i + 1) * per] for i in range(len(job["requests"]))]


def run_prefill(job: dict) -> None:
    inst = Instance(job)
    n = job["tokens"]
    params = []
    for rid, table in zip(job["requests"], tables(job, 1), strict=True):
        for caches in inst.caches:  # every TP rank computes the same replicated MLA/indexer caches
            caches.write_tokens(table, 0, n, seed=SEED)
        req = request(rid, n, {"do_remote_decode": True})
        req.num_computed_tokens = n
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, p = inst.scheduler.request_finished_all_groups(req, (table.tolist(),))
        assert delay
        params.append(p)
    say({"params": params})
    deadline = time.monotonic() + job["wait_s"]
    freed: set[str] = set()
    while time.monotonic() < deadline and len(freed) < len(params):
        freed |= inst.step()[0]
        time.sleep(0.01)
    say({"freed": sorted(freed), "elapsed_s": job["wait_s"] - (deadline - time.monotonic())})
    linger = time.monotonic() + job.get("linger_s", 0)  # keep serving: a late decode must get an answer
    while time.monotonic() < linger:
        inst.step()
        time.sleep(0.01)
    inst.shutdown()


def run_decode(job: dict, params: list[dict]) -> None:
    inst = Instance(job)
    n, prefix, bs = job["tokens"], job["prefix_tokens"], job["block_size"]
    reqs, matched = {}, {}
    for p, table in zip(params, tables(job, 2), strict=True):
        rid = p.get("remote_request_id", "r")
        for caches in inst.caches:
            caches.write_tokens(table, 0, prefix, seed=PREFIX_SEED)  # the local prefix-cache hit
        req = request(rid, n, p)
        count, is_async = inst.scheduler.get_num_new_matched_tokens(req, prefix)
        matched[rid] = [count, is_async]
        if count:
            inst.scheduler.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(int(b)) for b in table],)), count)
        reqs[rid] = (req, table, count)
    say({"matched": matched})
    deadline = time.monotonic() + job["wait_s"]
    done, failed, bad = set(), set(), set()
    waiting = {rid for rid, (_, _, count) in reqs.items() if count}
    while time.monotonic() < deadline and not waiting <= done:
        _, recving, failed_now, bad_now = inst.step()
        done |= recving
        failed |= failed_now
        bad |= bad_now
        time.sleep(0.01)
    out = {}
    for rid, (req, table, _) in reqs.items():
        out[rid] = {
            "outcome": "timeout" if rid in waiting - done else "failed" if rid in failed else "loaded",
            "mismatched": [
                m
                for c in inst.caches
                for m in c.mismatched_tokens(table, 0, prefix, seed=PREFIX_SEED)
                + c.mismatched_tokens(table, prefix, n, seed=SEED)
            ][:5],
            "suffix_blocks": sorted(int(b) for b in table[prefix // bs :]),
            "do_remote_prefill": req.kv_transfer_params.get("do_remote_prefill"),
        }
    stats = [w.get_kv_connector_stats() for w in inst.workers]
    say({"requests": out, "bad_blocks": sorted(bad), "stats": [s.data if s else {} for s in stats]})
    inst.shutdown()


def model_caches(inst: Instance, table: np.ndarray):
    """The tiny DSA model's view of rank 0's cache memory for one request (tests/support/tiny_dsa.py)."""
    from tests.support.tiny_dsa import PagedCache

    caches = inst.caches[0]
    views = {}
    for (kind, layer), buf in caches.buffers.items():
        row = caches.spec.row.row_bytes if kind == "main" else caches.spec.indexer.row_bytes
        views[kind, layer] = torch.from_numpy(buf)[:, : caches.page_tokens * row]
    main = {lay: v for (k, lay), v in views.items() if k == "main"}
    index = {lay: v for (k, lay), v in views.items() if k == "indexer"}
    return PagedCache(main, index, table, caches.page_tokens)


def e2e_tables(job: dict, sizes: list[int], seed: int) -> list[np.ndarray]:
    pool = np.random.default_rng(seed).permutation(job["num_blocks"])
    starts = np.cumsum([0, *sizes])
    return [pool[a:b] for a, b in itertools.pairwise(starts)]


def tiny_model(job: dict):
    from glm_pd_common.layout.geometry import ModelGeometry
    from tests.support.tiny_dsa import TinyDsa

    geometry = ModelGeometry.from_config(job["model"], include_mtp=False)
    return TinyDsa(geometry.num_layers, list(geometry.full_indexer_layers), seed=job["e2e"]["seed"])


def run_prefill_e2e(job: dict) -> None:
    """Prefill with the tiny DSA model: its forward writes every layer's caches, then the connector hands off."""
    inst, model, prompts, bs = Instance(job), tiny_model(job), job["e2e"]["prompts"], job["block_size"]
    params, firsts = [], []
    for rid, prompt, table in zip(
        job["requests"], prompts, e2e_tables(job, [num_pages_for(len(p), bs) for p in prompts], 1), strict=True
    ):
        firsts.append(model.prefill(prompt, model_caches(inst, table)))
        req = request(rid, len(prompt), {"do_remote_decode": True})
        req.num_computed_tokens = len(prompt)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        params.append(inst.scheduler.request_finished_all_groups(req, (table.tolist(),))[1])
    say({"params": params, "first": firsts})
    deadline, freed = time.monotonic() + job["wait_s"], set()
    while time.monotonic() < deadline and len(freed) < len(params):
        freed |= inst.step()[0]
        time.sleep(0.01)
    say({"freed": sorted(freed)})
    inst.shutdown()


def run_decode_e2e(job: dict, relay: dict) -> None:
    """Decode with the tiny DSA model: a local prefix hit, the connector loads the suffix, greedy decode."""
    inst, model, e2e, bs = Instance(job), tiny_model(job), job["e2e"], job["block_size"]
    prompts, steps, prefix = e2e["prompts"], e2e["steps"], job["prefix_tokens"]
    sizes = [num_pages_for(len(p) + steps, bs) for p in prompts]
    reqs = {}
    for p, prompt, table in zip(relay["params"], prompts, e2e_tables(job, sizes, 2), strict=True):
        rid = p.get("remote_request_id", "r")
        if prefix:
            model.prefill(prompt, model_caches(inst, table), 0, prefix)  # decode's own prefix-cache hit
        req = request(rid, len(prompt), p)
        count, _ = inst.scheduler.get_num_new_matched_tokens(req, prefix)
        blocks = KVCacheBlocks(([KVCacheBlock(int(b)) for b in table[: num_pages_for(len(prompt), bs)]],))
        inst.scheduler.update_state_after_alloc(req, blocks, count)
        reqs[rid] = (prompt, table, count)
    deadline, done, failed = time.monotonic() + job["wait_s"], set(), set()
    while time.monotonic() < deadline and not set(reqs) <= done | failed:
        _, recving, failed_now, _ = inst.step()
        done |= recving
        failed |= failed_now
        time.sleep(0.01)
    out = {}
    for (rid, (prompt, table, count)), first in zip(reqs.items(), relay["first"], strict=True):
        cache = model_caches(inst, table)
        if e2e.get("drop_indexer"):  # the negative control: decode's indexer pages never filled
            for buf in cache.index.values():
                buf[table[prefix // bs :]] = 0
        loaded = rid in done and rid not in failed
        tokens = model.decode(first, len(prompt), cache, steps) if loaded else []
        out[rid] = {"loaded": loaded, "tokens": tokens, "matched": count}
    stats = [w.get_kv_connector_stats() for w in inst.workers]
    say({"requests": out, "stats": [s.data if s else {} for s in stats]})
    inst.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    job = json.loads(sys.argv[1])
    threading.current_thread().name = job["role"]
    if job.get("e2e"):
        if job["role"] == "kv_producer":
            run_prefill_e2e(job)
        else:
            run_decode_e2e(job, json.loads(sys.stdin.readline()))
    elif job["role"] == "kv_producer":
        run_prefill(job)
    else:
        run_decode(job, json.loads(sys.stdin.readline()))  # the router's relay of prefill's params


if __name__ == "__main__":
    main()

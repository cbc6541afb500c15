"""One vLLM engine in-process on CPU: vLLM's own ``Scheduler`` (with its KVCacheManager and block pool) drives
``GlmPdConnector`` on the scheduler side and one connector per TP rank on the worker side, step by step as
vLLM's EngineCore does (``has_requests`` -> ``schedule`` -> executor -> ``update_from_output``).

Test double: the GPU forward alone (``Engine._forward``). It writes layout-valid KV bytes for the tokens the
scheduler scheduled into the blocks the KVCacheManager gave the request, and samples a fixed token once a
prompt is done. Around it, each rank's connector is called in the order vLLM's model runner calls it
(``KVConnectorModelRunnerMixin._get_kv_connector_output``: bind, start_load_kv before or after the forward,
wait_for_save, transfer results, load errors, stats, clear), and the ranks' outputs are merged by vLLM's own
``KVOutputAggregator``. Ranks run in one thread (their services have threads of their own).

KV bytes are a function of (content seed, token position): the driver gives each request its content as
segments ``[(end, seed), ...]``, so two requests sharing a prefix share its bytes, as real KV does. A decode
request's first forward checks, on every rank, every block it got (prefix hit and load) against those segments.
With decode context parallelism (job ``dcp``, ``interleave``) each rank's double writes and checks only its
token shard, at glm-pd's shard slots (``HostCaches``; vLLM's own slot mapping is held to those in
``tests/vllm/test_vllm_dcp.py``); the scheduler's block span is vLLM's (``resolve_kv_cache_block_sizes``).
A subclass may replace what the double computes (``compute``), e.g. with a tiny model's forward.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from glm_pd_common.layout.shards import token_shard
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_vllm.config import GlmPdVllmConfig
from glm_pd_vllm.model import cache_spec, context_parallel
from tests.support.credential import suite_credential
from tests.support.faults import FaultyTransport, Injector

SAMPLED = 7  # the token the forward double samples
POISON = 0xA5  # a freed, uncached block is overwritten at once, as a busy engine reuses it


def vllm_config(job: dict, rank: int) -> VllmConfig:
    """What ``vllm serve`` would build for one rank from the job's flags (tiny local GLM-5.x config, CPU)."""
    extra = {
        "side_channel_port": job["port"],
        "allow_tcp": True,
        "timeout_s": 20.0,
        "lease_s": job["lease_s"],
        "verify_checksums": True,
        "credential": suite_credential(),
        # the double steps engines one after another in one thread (``run``, the tests' loops): an idle decode
        # step waiting for a load would hold prefill's steps, which that load waits for (own test: test_idle_steps)
        "idle_wait_s": 0.0,
        **job.get("extra", {}),
    }
    if "rank_hosts" in job:  # each rank on its own node: that node's side_channel_host
        extra["side_channel_host"] = job["rank_hosts"][rank]
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
            decode_context_parallel_size=job.get("dcp", 1),
            cp_kv_cache_interleave_size=job.get("interleave", 1),
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv,
    )


def kv_caches(caches: HostCaches) -> dict[str, torch.Tensor]:
    """vLLM's layer names and DSA cache shapes (``[num_blocks, 1, block_size, row]``, main and indexer) over the
    memory the HostCaches fill and check."""
    out = {}
    for (kind, layer), buf in caches.buffers.items():
        row = caches.spec.row.row_bytes if kind == "main" else caches.spec.indexer.row_bytes
        view = torch.from_numpy(buf).view(caches.num_pages, 1, caches.page_tokens, row)
        out[f"model.layers.{layer}.self_attn.{'attn' if kind == 'main' else 'indexer.k_cache'}"] = view
    return out


@dataclass
class Tracked:
    """What the driver declared about one request, and what the forward double saw."""

    segments: list[tuple[int, int]]  # [(end, seed)]: token bytes of [previous end, end) come from seed
    checked: set[int] = field(default_factory=set)  # ranks whose caches were checked at its first forward
    table: list[int] = field(default_factory=list)  # its blocks at its first forward
    mismatched: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    kv_transfer_params: dict | None = None


class Engine:
    """vLLM's scheduler and the connector's workers for one instance (prefill or decode)."""

    def __init__(self, job: dict) -> None:
        configs = [vllm_config(job, rank) for rank in range(job["tp"])]
        config = configs[0]
        self.block_size = config.cache_config.block_size  # what vLLM chose, not what was asked
        self.num_blocks = job["pool_tokens"] // self.block_size
        self.prefix_caching = bool(config.cache_config.enable_prefix_caching)
        spec = cache_spec(config, GlmPdVllmConfig.from_extra(config.kv_transfer_config.kv_connector_extra_config))
        self.sharding = context_parallel(config)
        self.caches = [
            HostCaches(
                spec, page_tokens=self.block_size, num_pages=self.num_blocks, shard=token_shard(rank, self.sharding)
            )
            for rank in range(len(configs))
        ]
        layers = list(kv_caches(self.caches[0]))
        group = KVCacheGroupSpec(
            layers,
            MLAAttentionSpec(
                block_size=self.block_size,
                num_kv_heads=1,
                head_size=spec.row.row_bytes,
                dtype=torch.uint8,
                cache_dtype_str=config.cache_config.cache_dtype,
            ),
        )
        kv_cache_config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])
        config.cache_config.num_gpu_blocks = self.num_blocks  # as EngineCore sets it after profiling
        config.scheduler_config.max_num_seqs = job.get("max_num_seqs", config.scheduler_config.max_num_seqs)
        # chunked prefill (a long prompt over several steps), where vLLM left it on: its CPU platform turns it off
        # for MLA without AMX (and sizes the budget to a whole prompt)
        self.chunked_prefill = bool(config.scheduler_config.enable_chunked_prefill)
        if "max_num_batched_tokens" in job and self.chunked_prefill:
            config.scheduler_config.max_num_batched_tokens = job["max_num_batched_tokens"]
        # as EngineCore: one scheduler block spans block_size x DCP tokens
        self.scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, config)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=self.scheduler_block,
            hash_block_size=hash_block,
            log_stats=True,
        )
        self.connector = self.scheduler.connector
        self.workers = [
            KVConnectorFactory.create_connector(c, KVConnectorRole.WORKER, kv_cache_config) for c in configs
        ]
        try:
            for worker, caches in zip(self.workers, self.caches, strict=True):
                worker.register_kv_caches(kv_caches(caches))
            # as EngineCore once the caches are registered: each worker's handshake metadata to the scheduler
            published = {(0, rank): worker.get_handshake_metadata() for rank, worker in enumerate(self.workers)}
            self.connector.set_xfer_handshake_metadata_pp_aware({k: m for k, m in published.items() if m is not None})
        except BaseException:
            # a refused start-up ends vLLM's engine process, and with it the workers' services
            for worker in self.workers:
                worker.shutdown()
            raise
        self.aggregator = KVOutputAggregator.from_connector(self.workers[0], len(self.workers))
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(hash_block, hash_fn)
        # request id -> its fault (tests/support/faults.py), for every decode rank: the injector and the wrapping
        # transport are handed to each rank's service as a test builds one (the worker built these itself)
        self.faults: dict[str, str] = {}
        for worker in self.workers:
            service = worker._worker.decode
            if service is not None:
                service.faults = Injector(self.faults)
                service.local = dataclasses.replace(
                    service.local, transport=FaultyTransport(service.local.transport, service.faults)
                )
        self.tracked: dict[str, Tracked] = {}
        self.invalid_block_ids: set[int] = set()  # every id a worker reported, for the tests' account
        self.reported_recving: list[str] = []  # every finished_recving vLLM's scheduler was given
        self.reported_failed: set[str] = set()  # every failed_recving
        self.counts: dict[str, float] = {}  # the connector's stats counters, summed over steps
        self.rank_counts: list[dict[str, float]] = [{} for _ in configs]  # the same, per TP rank (before merging)
        self._owned: set[int] = set()

    # -- the driver's side (what the API server hands EngineCore) ---------------------------------
    def add(
        self,
        rid: str,
        prompt: list[int],
        segments: list[tuple[int, int]],
        params: dict | None,
        max_tokens: int = 1,
        **sampling_args,
    ) -> None:
        sampling = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params}, **sampling_args
        )
        request = Request(rid, list(prompt), sampling, None, block_hasher=self._hasher)
        self.tracked[rid] = Tracked(segments)
        self.scheduler.add_request(request)

    def refuse(self, rid: str, params: dict) -> None:
        """The API server refused a request (admission control) and frees what it pinned the way vLLM does: a
        one-token stand-in marked ``abort_immediately`` (AsyncLLM.notify_kv_transfer_request_rejected), added
        and aborted at once (EngineCore.add_request)."""
        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)})
        request = Request(rid, [0], sampling, None, block_hasher=self._hasher, abort_immediately=True)
        self.scheduler.add_request(request)
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def abort(self, rid: str) -> None:
        """A client disconnect: the API server asks EngineCore to abort the request."""
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    # -- EngineCore.step ----------------------------------------------------------------------------
    def step(self) -> bool:
        if not self.scheduler.has_requests():
            return False
        out = self.scheduler.schedule()
        runner_outputs = [self._rank_output(rank, out) for rank in range(len(self.workers))]
        merged = self.aggregator.aggregate(runner_outputs, 0)
        conn = merged.kv_connector_output
        if conn is not None:  # what vLLM's scheduler is told, once every rank has reported
            self.reported_recving.extend(conn.finished_recving or ())
            self.reported_failed |= conn.failed_recving
            _add_counts(self.counts, conn.kv_connector_stats)
        for core_outputs in self.scheduler.update_from_output(out, merged).values():
            for o in core_outputs.outputs:
                track = self.tracked.get(o.request_id)
                if track is None:
                    continue
                track.tokens.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    track.finish = str(o.finish_reason)
                    track.kv_transfer_params = o.kv_transfer_params
        self._poison_freed()
        return True

    def _rank_output(self, rank: int, out: SchedulerOutput) -> ModelRunnerOutput:
        worker = self.workers[rank]
        worker.bind_connector_metadata(out.kv_connector_metadata)
        after = not getattr(out, "has_sync_kv_loads", False)
        if not after:
            worker.start_load_kv(None)
        runner = self._forward(rank, out) if out.total_num_scheduled_tokens else ModelRunnerOutput([], {})
        if after:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        conn = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
        )
        self.invalid_block_ids |= conn.invalid_block_ids
        _add_counts(self.rank_counts[rank], conn.kv_connector_stats)  # before vLLM's merge adds rank 1.. into rank 0's
        worker.clear_connector_metadata()
        runner.kv_connector_output = conn
        return runner

    def _forward(self, rank: int, out: SchedulerOutput) -> ModelRunnerOutput:
        caches = self.caches[rank]
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        ids, sampled = [], []
        for rid, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            table = np.asarray(self.scheduler.kv_cache_manager.get_block_ids(rid)[0], dtype=np.int64)
            start = starts[rid]
            track = self.tracked[rid]
            if rank not in track.checked:  # what the request holds on this rank before its first forward
                track.checked.add(rank)
                track.table = table.tolist()
                found = _mismatched(caches, table, track.segments, start)
                track.mismatched += [f"rank {rank}: {m}" for m in found] if rank else found
            ids.append(rid)
            sampled.append(self.compute(rank, request, table, start, start + count))
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled)  # fmt: skip

    def compute(self, rank: int, request: Request, table: np.ndarray, start: int, end: int) -> list[int]:
        """The forward double: KV bytes of the request's segments for positions ``[start, end)`` (prompt only),
        and the fixed token once the request's known tokens are all computed."""
        segments = self.tracked[request.request_id].segments
        _write(self.caches[rank], table, segments, start, end, request.num_prompt_tokens)
        return [SAMPLED] if end >= request.num_tokens else []

    def _poison_freed(self) -> None:
        manager = self.scheduler.kv_cache_manager
        owned = {b for rid in self.scheduler.requests for b in manager.get_block_ids(rid)[0]}
        pool = manager.block_pool
        freed = [b for b in self._owned - owned if pool.blocks[b].block_hash is None]
        self._owned = owned
        if freed:
            for caches in self.caches:
                for buf in caches.buffers.values():
                    buf[freed] = POISON

    # -- vLLM's own state, for the tests ------------------------------------------------------------
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def idle(self) -> bool:
        return not self.scheduler.requests and self.free_blocks() == self.num_blocks - 1  # block 0 is vLLM's null

    def run(self, until, steps: int = 20000, pause_s: float = 0.002) -> None:
        """Step until ``until()`` holds (loads and releases complete on service threads meanwhile)."""
        for _ in range(steps):
            if until():
                return
            if not self.step():
                time.sleep(pause_s)
            time.sleep(pause_s)
        raise AssertionError(f"engine did not reach the state in {steps} steps: {self.state()}")

    def state(self) -> dict:
        return {
            "requests": {rid: str(r.status) for rid, r in self.scheduler.requests.items()},
            "free_blocks": self.free_blocks(),
            "num_blocks": self.num_blocks,
        }

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.connector.shutdown()


def _add_counts(into: dict[str, float], stats) -> None:
    """The connector's counts in one stats object (its lists are per-load samples, not counts)."""
    for key, value in (stats.data if stats is not None else {}).items():
        if isinstance(value, int | float):
            into[key] = into.get(key, 0) + value


def _segments(segments: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int, int]]:
    out, prev = [], 0
    for seg_end, seed in segments:
        a, b = max(prev, start), min(seg_end, end)
        if a < b:
            out.append((a, b, seed))
        prev = seg_end
    return out


def _write(caches: HostCaches, table: np.ndarray, segments, start: int, end: int, num_prompt: int) -> None:
    for a, b, seed in _segments(segments, start, min(end, num_prompt)):
        caches.write_tokens(table, a, b, seed=seed)


def _mismatched(caches: HostCaches, table: np.ndarray, segments, upto: int) -> list[str]:
    return [m for a, b, seed in _segments(segments, 0, upto) for m in caches.mismatched_tokens(table, a, b, seed=seed)]

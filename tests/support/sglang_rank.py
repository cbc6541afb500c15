"""One SGLang attention-TP rank built from SGLang's own classes on CPU (used by tests/support/sglang_proc.py).

Real SGLang objects: ``DSATokenToKVPool`` for the target layers (``LayerSplitDSATokenToKVPool`` on a prefill
CP rank under DSA cache layer split: only its layer shard has rows) and another for the draft (MTP) layer,
``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool``, ``MetadataBuffers`` (with the DSA top-k seed buffer
when the model config asks for it), ``ReqToMetadataIdxAllocator``, and the role's queue, whose
``_init_kv_manager`` builds ``KVArgs`` from those pools and constructs the glm-pd manager exactly as a
scheduler does: ``PrefillBootstrapQueue`` on prefill, ``DecodePreallocQueue`` on decode.

Test doubles (no GPU, no model runner here): ``SchedulerDouble`` carries only the attributes those queues
read from SGLang's ``Scheduler`` (model config, server args, pools, the KV dtype string); the tree cache
is absent (decode's host-receive path, which needs it, is off).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.base.conn import StateType
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin
from sglang.srt.disaggregation.utils import (
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
    get_dsa_seed_metadata_dim,
)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.runtime_context import get_context, get_parallel

from tests.support.faults import FaultyTransport, Injector
from tests.support.tiny_dsa import PagedCache

MAX_REQS = 16  # request rows and metadata slots per rank


class SchedulerDouble(SchedulerDisaggregationPrefillMixin):
    """Test double for SGLang's ``Scheduler``: the attributes its disaggregation code reads, and SGLang's own
    prefill mixin methods (``send_kv_chunk``, ``maybe_send_cached_prefix_chunk``) on top of them."""

    def __init__(self, server_args: Any, model_config: ModelConfig, rank: Rank) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.tp_worker = SimpleNamespace(
            is_hybrid_swa=False,
            model_runner=SimpleNamespace(
                effective_logical_max_total_num_tokens=rank.pool_tokens,
                kv_cache_dtype_str=server_args.kv_cache_dtype,
            ),
        )
        self.kv_shard_widening = 1
        self.processed_tokens_counter = 0
        self.attn_cp_cpu_group = self.attn_tp_cpu_group = None  # the default gloo group, one process
        self.rust_server = None
        self.enable_hisparse = False
        self.random_seed = 0
        self.token_to_kv_pool_allocator = rank.allocator
        self.req_to_token_pool = rank.req_to_token_pool
        self.req_to_metadata_buffer_idx_allocator = rank.meta_slots
        self.disagg_metadata_buffers = rank.meta
        self.enable_overlap = True  # SGLang's default: the early send carries a wait_event
        self.enable_staging = False
        self.forward_stream = None  # replaced by the prefill loop's stream double
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.kv_checksum_computer = None
        self.failed: list[Any] = []

    def handle_bootstrap_failure(self, req: Any) -> None:
        """SGLang's aborts the request, frees its KV and metadata slot and streams the error; here: record it."""
        self.failed.append(req)
        if req.metadata_buffer_index >= 0:
            self.req_to_metadata_buffer_idx_allocator.free(req.metadata_buffer_index)
            req.metadata_buffer_index = -1
        req.pending_bootstrap = False


DEVICE_BASE = {"prefill": 1, "decode": 5}  # device ids of rank 0 (DRAM registered under these ids on CPU)


class Rank:
    """One rank's pools, allocators, metadata buffers and the role's SGLang queue (which owns the manager)."""

    def __init__(self, rank: int, cfg: dict[str, Any], server_args: Any, model_config: ModelConfig) -> None:
        """Rank ``rank`` of ``tp`` x ``cp``, in SGLang's order: CP rank ``rank // tp``, attention-TP ``rank % tp``."""
        page, role = cfg["page_size"], cfg["role"]
        attn_tp, cp = cfg["tp"], cfg.get("cp", 1)
        split = bool(cfg.get("layer_split")) and cp > 1
        self.page = page
        self.pool_tokens = cfg.get("pool_pages", 48) * page
        geom = model_config.hf_config
        num_layers = geom.num_hidden_layers
        full = set(cfg["full_layers"])
        row = cfg.get("row_bytes", 656)
        dsa = {"kv_lora_rank": geom.kv_lora_rank, "qk_rope_head_dim": geom.qk_rope_head_dim, "index_head_dim": 128}
        common = {"size": self.pool_tokens, "page_size": page, "dtype": torch.float8_e4m3fn, "device": "cpu"}
        common |= {"enable_memory_saver": False, "kv_cache_dim": row, **dsa}
        # The rank's place in SGLang's parallel state, before any pool or manager reads it (one process holds
        # every rank, each built with its own values; what they read later is the same for all of them).
        get_parallel().override_permanently(
            tp_size=attn_tp * cp, attn_tp_size=attn_tp, attn_cp_size=cp, enable_dsa_cache_layer_split=split,
            attn_tp_rank=rank % attn_tp, attn_cp_rank=rank // attn_tp, attn_dp_rank=0, attn_dcp_rank=0, tp_rank=rank,
            pp_rank=0, pp_size=1, pp_group=None, dp_rank=None, attn_tp_group=SimpleNamespace(cpu_group=None),
            attn_cp_group=SimpleNamespace(world_size=cp, pynccl_comm=None, cpu_group=None),
        )  # fmt: skip
        skip = {"skip_topk_layers": [i not in full for i in range(num_layers)]}
        if split:  # SGLang's layer-split pool: the shard's layers have rows, the others are 0-row placeholders
            self.pool: DSATokenToKVPool = LayerSplitDSATokenToKVPool(
                layer_num=num_layers, layer_shard_rank=rank // attn_tp, layer_shard_size=cp, **skip, **common
            )
        else:
            self.pool = DSATokenToKVPool(layer_num=num_layers, **skip, **common)
        num_mtp = (getattr(geom, "num_nextn_predict_layers", 0) or 0) if cfg.get("draft", True) else 0
        self.draft = DSATokenToKVPool(layer_num=num_mtp, start_layer=num_layers, **common) if num_mtp else None
        self.allocator = PagedTokenToKVPoolAllocator(
            self.pool_tokens, page, torch.float8_e4m3fn, "cpu", self.pool, False
        )
        self.req_to_token_pool = ReqToTokenPool(MAX_REQS, geom.max_position_embeddings, "cpu", False)
        self.meta_slots = ReqToMetadataIdxAllocator(MAX_REQS)
        self.meta = MetadataBuffers(
            MAX_REQS,
            hidden_size=16,
            hidden_states_dtype=torch.float32,
            max_sampling_mask_tokens=1,
            output_dsa_topk_indices_dim=get_dsa_seed_metadata_dim(geom),
        )
        self.main = [*self.pool.kv_buffer, *(self.draft.kv_buffer if self.draft else [])]
        self.index = [
            *self.pool.index_k_with_scale_buffer,
            *(self.draft.index_k_with_scale_buffer if self.draft else []),
        ]
        # Test double for SGLang's owner broadcast under layer split: the tiny model's forward (every rank computes
        # all of it here) reads and writes a layer this rank does not own in a private copy, never in the pool.
        self.not_owned: dict[tuple[str, int], torch.Tensor] = {}
        if split:
            like_main = next(t for t in self.main if t.shape[0])
            like_index = next((t for t in self.index if t.shape[0]), None)
            for i, t in enumerate(self.main[:num_layers]):
                if not t.shape[0]:
                    self.not_owned["main", i] = torch.zeros_like(like_main)
                    if i in full and like_index is not None:
                        self.not_owned["index", i] = torch.zeros_like(like_index)
        gen = torch.Generator().manual_seed(cfg.get("seed", 0) * 1000 + rank * 10 + (role == "decode"))
        for t in [*self.main, *self.index]:  # what earlier requests left in the pool
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
        # Each rank on its own device, never 0 (as ranks 1..7 of a node are): the regions are registered under it,
        # so a descriptor naming another device fails. SGLang's launcher sets it the same way (``publish``).
        get_context().config_bag("device")._set("gpu_id", DEVICE_BASE[role] + rank)
        self.tree = RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
                page_size=page,
            )
        )  # fmt: skip
        self.scheduler = SchedulerDouble(server_args, model_config, self)
        backend = TransferBackend(server_args.disaggregation_transfer_backend)
        port, tokens = cfg["bootstrap_port"], self.pool_tokens
        if role == "prefill":
            self.queue: Any = PrefillBootstrapQueue(
                self.pool, self.draft, self.meta_slots, self.meta, 0, port, tokens, self.scheduler, None, backend
            )
            self.scheduler.disagg_prefill_bootstrap_queue = self.queue
        else:
            self.queue = DecodePreallocQueue(
                self.req_to_token_pool, self.allocator, self.draft, self.meta_slots, self.meta, self.scheduler,
                None, None, 0, port, tokens, 0, backend,
            )  # fmt: skip
        self.mgr = self.queue.kv_manager
        self.transitions: list[tuple[int, int]] = []
        original = self.mgr.update_status

        def spy(room: int, status: int) -> None:  # observe the real status updates, in order
            original(room, status)
            self.transitions.append((room, int(self.mgr.request_status.get(room, -1))))

        self.mgr.update_status = spy
        self.faults = Injector()  # room (as text) -> its fault (tests/support/faults.py)
        self.mgr.faults = self.faults
        self._wrap_transport()

    def _wrap_transport(self) -> None:
        """The manager's transport behind the fault-injecting wrapper (SGLang built both, so the test hands it)."""
        self.mgr.transport = FaultyTransport(self.mgr.transport, self.faults)

    def release_and_resume(self) -> None:
        """SGLang's ``release_memory_occupation`` then ``resume_memory_occupation`` on the role's queue, with
        the caches back at new addresses in ``KVArgs`` (the old buffers are kept: a stale registration would
        write there, unseen)."""
        self.queue.release_memory_occupation()
        self.stale = [*self.main, *self.index]
        self.main = [t.clone() if t.numel() else t for t in self.main]
        self.index = [t.clone() if t.numel() else t for t in self.index]
        moved = {old.data_ptr(): new.data_ptr() for old, new in zip(self.stale, [*self.main, *self.index], strict=True)}
        args = self.mgr.kv_args
        args.kv_data_ptrs = [moved[p] for p in args.kv_data_ptrs]
        dsa = args.state_types.index(StateType.DSA)
        args.state_data_ptrs[dsa] = [moved.get(p, p) for p in args.state_data_ptrs[dsa]]  # 0-row: nothing moved
        self.queue.resume_memory_occupation()
        self._wrap_transport()  # the resume opened a new transport

    def paged(self, table: np.ndarray) -> PagedCache:
        """The tiny model's view of this rank's pool: page p of a layer is rows [p * page, (p + 1) * page)."""
        main = {i: self.not_owned.get(("main", i), t) for i, t in enumerate(self.main)}
        main = {i: t.view(torch.uint8).view(-1, self.page * t.shape[-1]) for i, t in main.items()}
        index = {i: self.not_owned.get(("index", i), t) for i, t in enumerate(self.index)}
        return PagedCache(main, {i: t for i, t in index.items() if t.shape[0]}, table, self.page)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every cache buffer this rank holds, by region (``main 3``, ``indexer 6``): layer ids index the lists."""
        out = {f"main {i}": t.view(torch.uint8).view(-1, self.page * t.shape[-1]) for i, t in enumerate(self.main)}
        out |= {f"indexer {i}": t for i, t in enumerate(self.index)}
        return {name: t for name, t in out.items() if t.shape[0]}

    def page_digests(self, pages: np.ndarray) -> dict[str, list[str]]:
        """Per region this rank holds, per page: a digest of the page's bytes (what must match across)."""
        return {
            name: [xxhash.xxh3_64_hexdigest(t[p].numpy().tobytes()) for p in pages.tolist()]
            for name, t in self.buffers().items()
        }

    def write_pages(self, pages: np.ndarray, seed: int) -> None:
        """What a forward leaves in these pages: fresh bytes in every buffer, the same on every rank holding it."""
        idx = torch.as_tensor(pages, dtype=torch.int64)
        for name, t in self.buffers().items():
            gen = torch.Generator().manual_seed(seed * 1000 + int(name.split()[1]) * 2 + name.startswith("indexer"))
            t[idx] = torch.randint(0, 256, (len(pages), t.shape[1]), dtype=torch.uint8, generator=gen)

    def free_pages(self) -> int:
        return self.allocator.available_size() // self.page


def rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

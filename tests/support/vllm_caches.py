"""GLM-5.x cache tensors made by vLLM's own planning and allocation code on this CPU, registered through the
adapter: what the layout suites share (``tests/vllm/test_vllm_layouts.py``, ``tests/vllm/test_vllm_dcp.py``).

A layout is one (device, sparse attention backend, cache dtype, block size) GLM-5.x runs with under vLLM 0.33,
optionally with tensor and decode context parallelism. Its caches come from vLLM's functions: the layers'
specs (``MLAAttention.get_kv_cache_spec``, ``DeepseekV32IndexerCache``, ``customize_attention_spec``), the
grouping and placement (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``,
``resolve_kv_cache_layout``), the kernel block size (``prepare_kernel_block_sizes``) and the tensors
(``allocate_kv_cache``). The adapter then builds the spec (``params.cache_spec``) and the regions
(``caches.regions_from_kv_caches``).

Test doubles, both for the GPU alone: the device capability vLLM's functions and the adapter read
(``current_platform.get_device_capability`` patched to SM90 or SM100; no GPU here), and the MLA attention
layers (namespaces holding what ``MLAAttention.get_kv_cache_spec`` reads and the backend class vLLM would have
chosen; the indexer caches are vLLM's own ``DeepseekV32IndexerCache``). Where a token's bytes go inside a kernel
block is written out from vLLM's kernels (``place``): a main row is ``view[k, 0, t]``; an indexer key sits at
``128 * t`` and its scale at ``128 * K + 4 * t`` of a K-token kernel block (``deepseek_v32/common/kernels.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import mla_attention
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache, customize_attention_spec, prepare_kernel_block_sizes

from glm_pd_common.layout.regions import Region
from glm_pd_vllm.caches import pages_per_block, regions_from_kv_caches
from glm_pd_vllm.config import GlmPdVllmConfig
from glm_pd_vllm.model import cache_spec

try:  # vLLM 0.33 moved the planning functions out of kv_cache_utils
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

FP8_DS_MLA, RAW_FP8, BF16, INDEXER_ROW = 656, 576, 1152, 132  # FACTS.md §2
KERNEL_TOKENS = 64  # the CUDA indexer's kernel block (v1/attention/backends/mla/indexer.py)
SCALES = {(9, 0): "fp32", (10, 0): "ue8m0x4"}  # FACTS.md §2: SM90 fp32, SM100 four UE8M0 bytes
NUM_LAYERS, FULL_LAYERS = 7, (0, 1, 2, 6)  # tests/support/tiny_glm.py: 6 layers + MTP 6; full 0-2 and the MTP


@dataclass(frozen=True)
class Choice:
    capability: tuple[int, int]
    backend: str
    cache_dtype: str
    row_bytes: int
    block_size: int
    kv_cache_layout: str | None
    tp_size: int = 1
    dcp: int = 1  # vLLM's decode_context_parallel_size
    interleave: int = 1  # vLLM's cp_kv_cache_interleave_size

    @property
    def name(self) -> str:
        layout = f"-{self.kv_cache_layout}" if self.kv_cache_layout else ""
        parallel = f"-tp{self.tp_size}-dcp{self.dcp}-i{self.interleave}" if self.tp_size > 1 else ""
        return f"SM{self.capability[0]}0-{self.backend}-{self.cache_dtype}-b{self.block_size}{layout}{parallel}"

    @property
    def byte_class(self) -> tuple[int, str]:
        """What decides compatibility, from the facts above: the main row and the indexer scale format."""
        return self.row_bytes, SCALES[self.capability]


@dataclass
class Built:
    choice: Choice
    caches: dict[str, torch.Tensor]
    backing: np.ndarray  # vLLM's one backing allocation, as bytes
    spec: object
    regions: list[Region]
    ratio: int  # kernel pages per scheduler block
    config: VllmConfig


def _backing(t: torch.Tensor) -> np.ndarray:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()


def on_device(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(
        type(current_platform),
        "get_device_capability",
        classmethod(lambda cls, device_id=0: DeviceCapability(*capability)),
    )


_UNIMPORTABLE: dict[str, str] = {}  # backend module -> why it cannot be imported


def build(choice: Choice, model_config: ModelConfig, *, num_blocks: int, copies: int = 1) -> list[Built]:
    """``copies`` separate allocations of one layout (ranks of one engine hold identical layouts), each
    registered through the adapter; skips, naming why, where this vLLM or machine cannot build the layout."""
    if choice.backend not in AttentionBackendEnum.__members__:
        pytest.skip(f"this vLLM has no {choice.backend} backend")
    cache = CacheConfig(
        block_size=choice.block_size, cache_dtype=choice.cache_dtype, num_gpu_blocks_override=num_blocks
    )
    parallel = ParallelConfig(
        tensor_parallel_size=choice.tp_size,
        decode_context_parallel_size=choice.dcp,
        cp_kv_cache_interleave_size=choice.interleave,
    )
    cfg = VllmConfig(
        model_config=copy.deepcopy(model_config),
        cache_config=cache,
        parallel_config=parallel,
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.kv_cache_layout = choice.kv_cache_layout  # a layout recorded here wins vLLM's resolution
    if cfg.cache_config.block_size != choice.block_size:
        pytest.skip(f"vLLM chose blocks of {cfg.cache_config.block_size} for {choice.block_size} on this machine")
    module = AttentionBackendEnum[choice.backend].get_path().rsplit(".", 1)[0]
    if module in _UNIMPORTABLE:
        pytest.skip(f"{choice.backend}: {_UNIMPORTABLE[module]}")
    try:
        backend = AttentionBackendEnum[choice.backend].get_class()
    except ImportError as exc:  # FlashAttention's sparse backends load CUDA extensions at import; a second
        # import would find the half-initialized module, so the first failure stands for the whole module
        _UNIMPORTABLE[module] = f"{module} cannot be imported on this machine: {exc}"
        pytest.skip(f"{choice.backend}: {_UNIMPORTABLE[module]}")
    hf = cfg.model_config.hf_config
    with set_current_vllm_config(cfg):
        dtype = mla_attention._canonicalize_sparse_mla_kv_cache_dtype(backend, cfg.cache_config.cache_dtype)
        cfg.cache_config.cache_dtype = dtype  # as MLAAttention.__init__ records it
        specs, main_names, index_names = {}, [], []
        for layer in range(NUM_LAYERS):
            name = f"model.layers.{layer}.self_attn.attn"
            attn = SimpleNamespace(
                attn_backend=backend,
                kv_cache_dtype=dtype,
                head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
                sliding_window=None,
                topk_buffer_width=hf.index_topk,
                indexer=object() if layer in FULL_LAYERS else None,
                non_causal_multi_token_decode=False,
            )
            cfg.compilation_config.static_forward_context[name] = attn
            spec = customize_attention_spec(backend, mla_attention.MLAAttention.get_kv_cache_spec(attn, cfg))
            if layer >= hf.num_hidden_layers and "is_draft" in {f.name for f in fields(spec)}:  # vLLM 0.33
                spec = replace(spec, is_draft=True)  # the MTP layer, as the drafter's runner marks it
            specs[name] = spec
            main_names.append(name)
            if layer in FULL_LAYERS:
                k = DeepseekV32IndexerCache(
                    INDEXER_ROW, torch.uint8, f"model.layers.{layer}.self_attn.indexer.k_cache", cfg.cache_config
                )
                specs[k.prefix] = customize_attention_spec(DeepseekV32IndexerBackend, k.get_kv_cache_spec(cfg))
                index_names.append(k.prefix)
        supported = [layout.name for layout in get_supported_kv_cache_layouts([backend, DeepseekV32IndexerBackend])]
        layout = resolve_kv_cache_layout(cfg, [supported], specs.values())
        kv_config = get_kv_cache_config_from_groups(cfg, get_kv_cache_groups(cfg, specs), 1 << 30)
        groups = [
            [
                AttentionGroup(backend, main_names, specs[main_names[0]], 0),
                AttentionGroup(DeepseekV32IndexerBackend, index_names, specs[index_names[0]], 0),
            ]
        ]
        kernel_sizes = prepare_kernel_block_sizes(kv_config, groups)
        all_caches = [allocate_kv_cache(kv_config, torch.device("cpu"), layout, kernel_sizes) for _ in range(copies)]
        cfg.device_config.device_type = "cuda"  # the adapter asks the (patched) platform for the capability
        spec = cache_spec(cfg, GlmPdVllmConfig())
    out = []
    for caches in all_caches:
        regions = regions_from_kv_caches(caches, spec, cfg.cache_config.block_size)
        first = next(iter(caches.values()))
        ratio = pages_per_block(regions, choice.block_size)
        out.append(Built(choice, caches, _backing(first), spec, regions, ratio, cfg))
    return out


def place(b: Built, backing: np.ndarray, slots: np.ndarray, rows: dict[str, np.ndarray]) -> None:
    """Write ``rows[name][i]`` (one token's bytes of cache ``name``) at vLLM slot ``slots[i]`` of ``b``'s caches,
    into ``backing`` (``b.backing`` or a copy of it). A slot counts tokens of whole scheduler blocks of this rank,
    as vLLM's slot mapping does; kernel block ``slot // K`` is where vLLM's K-token kernel views put it."""
    base = b.backing.ctypes.data
    for name, t in b.caches.items():
        kernel_tokens, row = t.shape[-2], t.shape[-1] * t.element_size()
        page = t.data_ptr() - base + (slots // kernel_tokens) * t.stride(0) * t.element_size()
        in_page = slots % kernel_tokens
        data = rows[name]
        if name.endswith("indexer.k_cache"):
            keys = page[:, None] + 128 * in_page[:, None] + np.arange(128)
            scales = page[:, None] + 128 * kernel_tokens + 4 * in_page[:, None] + np.arange(4)
            backing[keys], backing[scales] = data[:, :128], data[:, 128:]
        else:
            backing[page[:, None] + row * in_page[:, None] + np.arange(row)] = data

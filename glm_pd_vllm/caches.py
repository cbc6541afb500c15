"""vLLM's per-layer cache tensors -> glm-pd regions, checked against the model geometry.

vLLM names the caches ``model.layers.{i}.self_attn.attn`` (main MLA KV, MTP layers included with ids
num_hidden_layers + k) and ``model.layers.{i}.self_attn.indexer.k_cache`` (the indexer, only on full
layers). Each tensor is a view ``[num_blocks, ..., block_size, row]`` whose block b starts at
``data_ptr() + b * stride(0) * element_size``; the bytes inside a block are the layout's page.
"""

from __future__ import annotations

import re

import torch

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.regions import Region, build_regions
from glm_pd_common.layout.spec import CacheSpec

_MAIN = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.attn$")
_INDEXER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.indexer\.k_cache$")


def _page_geometry(name: str, t: torch.Tensor, block_size: int, row_bytes: int) -> tuple[int, int]:
    """(page stride in bytes, number of blocks) of one layer's view; refuses a layout glm-pd cannot address."""
    item = t.element_size()
    page_bytes = block_size * row_bytes
    inner = t[0]
    if inner.numel() * item != page_bytes or not inner.is_contiguous():
        raise ConfigError(
            f"cache {name}: a block holds {inner.numel() * item} B (shape {tuple(t.shape)}, dtype {t.dtype}); "
            f"the layout says {block_size} tokens x {row_bytes} B = {page_bytes} B, contiguous"
        )
    return t.stride(0) * item, t.shape[0]


def regions_from_kv_caches(kv_caches: dict[str, torch.Tensor], spec: CacheSpec, block_size: int) -> list[Region]:
    main: dict[int, torch.Tensor] = {}
    indexer: dict[int, torch.Tensor] = {}
    for name, tensor in kv_caches.items():
        if m := _MAIN.match(name):
            main[int(m.group(1))] = tensor
        elif m := _INDEXER.match(name):
            indexer[int(m.group(1))] = tensor
        else:
            raise ConfigError(f"GlmPdConnector does not know the cache {name!r} (a non-DSA layer?)")
    strides: dict[str, set[int]] = {"main": set(), "indexer": set()}
    blocks: set[int] = set()
    for kind, tensors, row in (("main", main, spec.row.row_bytes), ("indexer", indexer, spec.indexer.row_bytes)):
        for layer, t in tensors.items():
            stride, n = _page_geometry(f"{kind}[layer {layer}]", t, block_size, row)
            strides[kind].add(stride)
            blocks.add(n)
    if len(blocks) != 1 or any(len(s) > 1 for s in strides.values()):
        raise ConfigError(f"cache tensors disagree on block count {sorted(blocks)} or page stride {strides}")
    any_tensor = next(iter(kv_caches.values()))
    return build_regions(
        spec.geometry,
        spec.row,
        spec.indexer,
        page_tokens=block_size,
        num_pages=blocks.pop(),
        main_addrs={lay: t.data_ptr() for lay, t in main.items()},
        indexer_addrs={lay: t.data_ptr() for lay, t in indexer.items()},
        main_stride=strides["main"].pop(),
        indexer_stride=strides["indexer"].pop() if strides["indexer"] else None,
        mem_kind="VRAM" if any_tensor.is_cuda else "DRAM",
        device_id=any_tensor.device.index or 0,
    )

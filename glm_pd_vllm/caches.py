"""vLLM's per-layer cache tensors -> glm-pd regions, checked against the cache spec and the model geometry.

vLLM names the caches ``model.layers.{i}.self_attn.attn`` (main MLA KV, MTP layers included with ids
num_hidden_layers + k) and ``model.layers.{i}.self_attn.indexer.k_cache`` (the indexer, only on full
layers). What the connector is handed are vLLM's kernel-block views ``[pages, 1, K, row]``: page p starts
at ``data_ptr() + p * stride(0) * element_size`` and holds K tokens in the layout of a K-token page. With
``--block-size 128`` and the CUDA indexer's 64-token kernel block, each scheduler block is two such pages
(vLLM's ``allocate_kv_cache`` with the group's kernel block size). Regions are registered per kernel page,
because a 128-token indexer block holds [64 keys, 64 scales] twice, not 128 keys then 128 scales; the worker
translates block ids into pages with ``pages.block_pages`` and ``pages_per_block``.
"""

from __future__ import annotations

import re

import torch

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.cache_dtypes import indexer_scale_format
from glm_pd_common.layout.formats import ROW_FORMATS, check_page_tokens, main_row_format
from glm_pd_common.layout.regions import Region, build_regions
from glm_pd_common.layout.spec import CacheSpec

MAIN_CACHE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.attn$")
INDEXER_CACHE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.indexer\.k_cache$")
# What a main row format's tensor may hold besides a plain byte view (vLLM allocates fp8 rows as uint8).
_BYTE_VIEWS = (torch.uint8, torch.int8)
_ROW_DTYPES = {"bf16": (torch.bfloat16,), "fp8_raw": (torch.float8_e4m3fn,), "fp8_ds_mla": ()}


def _describe_row(kind: str, row_bytes: int, spec: CacheSpec) -> str:
    if kind == "indexer":
        return f"{row_bytes} B indexer rows"
    g = spec.geometry
    known = {main_row_format(f, g.kv_lora_rank, g.qk_rope_head_dim).row_bytes: f for f in ROW_FORMATS}
    return f"{row_bytes} B rows ({known.get(row_bytes, 'no row format glm-pd knows')})"


def _page_view(name: str, kind: str, t: torch.Tensor, spec: CacheSpec) -> tuple[int, int, int]:
    """(tokens per page, page stride in bytes, number of pages) of one layer's view, whose rows must be the
    spec's; refuses a layout glm-pd cannot address, naming what vLLM allocated and what the spec expects."""
    want = spec.row.row_bytes if kind == "main" else spec.indexer.row_bytes
    item = t.element_size()
    got = t.shape[-1] * item
    if got != want:
        raise ConfigError(
            f"cache {name}: vLLM allocated {_describe_row(kind, got, spec)} (shape {tuple(t.shape)}, dtype "
            f"{t.dtype}); {spec.origin or 'the cache spec'} gives {_describe_row(kind, want, spec)}"
        )
    if kind == "main" and t.dtype not in _BYTE_VIEWS + _ROW_DTYPES[spec.row.name]:
        raise ConfigError(
            f"cache {name}: vLLM allocated {t.dtype} rows; {spec.row.name} rows are read as "
            f"{', '.join(str(d) for d in _BYTE_VIEWS + _ROW_DTYPES[spec.row.name])}"
        )
    page = t[0]
    if not page.is_contiguous():
        raise ConfigError(f"cache {name}: one page of the view (shape {tuple(t.shape)}) is not contiguous")
    return page.numel() // t.shape[-1], t.stride(0) * item, t.shape[0]


def _check_scale_device(tensor: torch.Tensor, spec: CacheSpec) -> None:
    """On CUDA caches, the scale format must be the one vLLM writes on the caches' own device."""
    if tensor.is_cuda:
        major, minor = torch.cuda.get_device_capability(tensor.device)
        indexer_scale_format("vllm", "cuda", (major, minor), spec.indexer.scale_format)


def regions_from_kv_caches(kv_caches: dict[str, torch.Tensor], spec: CacheSpec, block_size: int) -> list[Region]:
    """Regions of one kernel page each for vLLM's caches (``block_size``: vLLM's scheduler block tokens)."""
    main: dict[int, torch.Tensor] = {}
    indexer: dict[int, torch.Tensor] = {}
    for name, tensor in kv_caches.items():
        if m := MAIN_CACHE.match(name):
            main[int(m.group(1))] = tensor
        elif m := INDEXER_CACHE.match(name):
            indexer[int(m.group(1))] = tensor
        else:
            raise ConfigError(f"GlmPdConnector does not know the cache {name!r} (a non-DSA layer?)")
    strides: dict[str, set[int]] = {"main": set(), "indexer": set()}
    shapes: set[tuple[int, int]] = set()  # (tokens per page, pages)
    for kind, tensors in (("main", main), ("indexer", indexer)):
        for layer, t in tensors.items():
            page_tokens, stride, num_pages = _page_view(f"{kind}[layer {layer}]", kind, t, spec)
            strides[kind].add(stride)
            shapes.add((page_tokens, num_pages))
    if len(shapes) != 1 or any(len(s) > 1 for s in strides.values()):
        raise ConfigError(
            f"cache tensors disagree on (tokens per page, pages) {sorted(shapes)} or page stride {strides}"
        )
    page_tokens, num_pages = shapes.pop()
    check_page_tokens(page_tokens, what="kernel block tokens of vLLM's cache views")
    if block_size % page_tokens or num_pages % (block_size // page_tokens):
        raise ConfigError(
            f"vLLM's cache views hold {num_pages} pages of {page_tokens} tokens, which do not split evenly into "
            f"scheduler blocks of {block_size} tokens"
        )
    any_tensor = next(iter(kv_caches.values()))
    _check_scale_device(any_tensor, spec)
    return build_regions(
        spec.geometry,
        spec.row,
        spec.indexer,
        page_tokens=page_tokens,
        num_pages=num_pages,
        main_addrs={lay: t.data_ptr() for lay, t in main.items()},
        indexer_addrs={lay: t.data_ptr() for lay, t in indexer.items()},
        main_stride=strides["main"].pop(),
        indexer_stride=strides["indexer"].pop() if strides["indexer"] else None,
        mem_kind="VRAM" if any_tensor.is_cuda else "DRAM",
        device_id=any_tensor.device.index or 0,
    )


def pages_per_block(regions: list[Region], block_size: int) -> int:
    """Kernel pages in one of vLLM's scheduler blocks (1 unless vLLM split the blocks for its kernels)."""
    return block_size // regions[0].page_tokens

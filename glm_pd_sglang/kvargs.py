"""SGLang's ``KVArgs`` -> glm-pd's cache spec and regions, checked against the model geometry.

SGLang describes a DSA rank positionally:
- ``kv_data_ptrs``: one main MLA buffer per target layer, then one per draft (MTP) layer; each item is one
  page (``page_size`` rows), so the row bytes are ``item_len / page_size`` (656 fp8_ds_mla, 576 raw fp8,
  1152 bf16). The row must be one SGLang allocates for ``kv_cache_dtype`` under some DSA backend
  (``cache_dtypes``): the dtype alone cannot tell 656 B fp8_ds_mla from 576 B raw fp8.
- one ``StateType.DSA`` state component: the indexer buffer of every target layer (item length 0 on a shared
  layer, which has no indexer), then the draft's. Items are pages too, indexed by the same page ids.
Zero-length entries carry no cache; they are skipped here, identically on both sides, and the layers that
remain must be exactly the geometry's full layers, or nothing may move.
Under DSA CP layer split (``LayerSplitDSATokenToKVPool``) a prefill rank lists only the layers it holds
(``held``): its contiguous share of the target layers from ``prefill_start_layer`` on, then the draft's on the
last shard only; both lists stay positional over those layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.cache_dtypes import row_formats_by_backend
from glm_pd_common.layout.formats import ROW_FORMATS, main_page_format, main_row_format
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.regions import MemKind, Region, RegionKind, plan_order
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.transport.base import Span

_DSA = "dsa"


@dataclass(frozen=True)
class RankCaches:
    """One rank's caches as glm-pd sees them: spec, cache regions (plan order) and metadata buffers."""

    spec: CacheSpec
    regions: list[Region]
    aux: list[Span]
    aux_item_lens: list[int]
    page_tokens: int
    dsa_component: int  # index of the StateType.DSA entry in KVArgs' state lists


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def row_format_name(item_len: int, page_size: int, kv_cache_dtype: str, geometry: ModelGeometry) -> str:
    """The main row format of SGLang's buffers, from the bytes per row, cross-checked with the dtype."""
    if item_len % page_size:
        raise ConfigError(f"main KV item length {item_len} B is not a whole number of rows of a {page_size}-token page")
    row = item_len // page_size
    by_bytes = {main_row_format(f, geometry.kv_lora_rank, geometry.qk_rope_head_dim).row_bytes: f for f in ROW_FORMATS}
    name = by_bytes.get(row)
    if name is None:
        raise ConfigError(f"main KV rows of {row} B match no DSA layout glm-pd knows ({sorted(by_bytes)} B)")
    allowed = row_formats_by_backend("sglang", kv_cache_dtype)
    if name not in allowed.values():
        raise ConfigError(
            f"main KV rows of {row} B ({name}) do not fit kv_cache_dtype {kv_cache_dtype!r}, "
            f"which SGLang allocates as {', '.join(sorted(set(allowed.values())))}"
        )
    return name


def rank_caches(
    kv_args: Any,
    geometry: ModelGeometry,
    *,
    scale_format: str,
    mem_kind: MemKind,
    device_id: int,
    held: tuple[int, ...] | None = None,
) -> RankCaches:
    """Map ``kv_args`` onto regions; raise naming the entry, layer or length that does not fit. ``held``: the
    cache layers of a layer-split rank (None: every layer)."""
    page = int(kv_args.page_size)
    ptrs, lens, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
    num_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
    if int(getattr(kv_args, "pp_rank", 0) or 0) != 0 or (held is None and start != 0):
        raise ConfigError("glm-pd does not support pipeline parallelism on the prefill side (pp_rank > 0)")
    if held is not None and start != held[0]:
        raise ConfigError(f"KVArgs starts at layer {start}; this layer-split rank holds layers {list(held)}")
    if not ptrs or not len(ptrs) == len(lens) == len(items):
        raise ConfigError(f"KVArgs lists {len(ptrs)} KV pointers, {len(lens)} lengths, {len(items)} item lengths")
    num_target = len(ptrs) - num_draft
    want_target = geometry.num_layers if held is None else sum(lay < geometry.num_layers for lay in held)
    if num_target != want_target:
        raise ConfigError(
            f"KVArgs holds {num_target} target main KV buffers; this rank holds {want_target} of the model's "
            f"{geometry.num_layers} layers"
        )
    want_draft = geometry.num_mtp_layers if held is None else len(held) - want_target
    if num_draft not in (0, want_draft) or (held is not None and num_draft != want_draft):
        raise ConfigError(f"KVArgs holds {num_draft} draft KV buffers; this rank holds {want_draft} MTP layers")
    if num_draft == 0 and held is None and geometry.num_mtp_layers:
        geometry = replace(geometry, num_mtp_layers=0)
    layers = geometry.all_layers if held is None else held
    if len(set(items)) != 1:
        raise ConfigError(f"main KV item lengths differ between layers: {sorted(set(items))}")
    row_name = row_format_name(items[0], page, str(kv_args.kv_cache_dtype_str), geometry)
    spec = CacheSpec.create(geometry, row_format=row_name, scale_format=scale_format)
    main_fmt, idx_fmt = main_page_format(spec.row), spec.indexer.page_format

    def region(kind: RegionKind, layer: int, ptr: int, data_len: int, item_len: int) -> Region:
        fmt = main_fmt if kind == "main" else idx_fmt
        if item_len != fmt.page_bytes(page):
            raise ConfigError(
                f"{kind} buffer of layer {layer}: item length {item_len} B, but {page} tokens x "
                f"{fmt.bytes_per_token} B = {fmt.page_bytes(page)} B"
            )
        if ptr <= 0 or data_len < item_len:
            raise ConfigError(f"{kind} buffer of layer {layer}: pointer {ptr:#x} / length {data_len} B unusable")
        return Region(
            kind=kind,
            layer_id=layer,
            is_mtp=layer >= geometry.num_layers,
            base_addr=int(ptr),
            page_tokens=page,
            page_bytes=item_len,
            page_stride=item_len,
            num_pages=data_len // item_len,
            page_format=fmt,
            mem_kind=mem_kind,
            device_id=device_id,
        )

    regions = [region("main", lay, ptrs[i], lens[i], items[i]) for i, lay in enumerate(layers)]
    dsa, indexer = _indexer_regions(kv_args, geometry, layers, region)
    regions += indexer
    aux = [
        Span(f"aux[{i}]", int(p), int(n), "DRAM", 0)
        for i, (p, n) in enumerate(zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens, strict=True))
    ]
    return RankCaches(spec, plan_order(regions), aux, [int(x) for x in kv_args.aux_item_lens], page, dsa)


def _indexer_regions(
    kv_args: Any, geometry: ModelGeometry, layers: tuple[int, ...], region: Any
) -> tuple[int, list[Region]]:
    types = [_value(t) for t in getattr(kv_args, "state_types", None) or []]
    others = sorted(set(types) - {_DSA})
    if others:
        raise ConfigError(
            f"state components {others} are not part of a GLM-5.x DSA handoff (index_kpool compression or a "
            "hybrid pool?); glm-pd moves the main MLA KV and the DSA indexer only"
        )
    if types.count(_DSA) != 1:
        raise ConfigError(f"KVArgs carries {types.count(_DSA)} DSA state components; a DSA model has one")
    k = types.index(_DSA)
    ptrs, lens = list(kv_args.state_data_ptrs[k]), list(kv_args.state_data_lens[k])
    items = list(kv_args.state_item_lens[k])
    if not len(ptrs) == len(lens) == len(items) == len(layers):
        raise ConfigError(
            f"the DSA state lists {len(ptrs)} indexer buffers; this rank's {len(layers)} cache layers need one "
            f"each (layers {layers[0]}..{layers[-1]})"
        )
    owned = [(i, lay) for i, lay in enumerate(layers) if items[i] > 0]
    got = [lay for _, lay in owned]
    want = [lay for lay in geometry.indexer_layers if lay in layers]
    if got != want:
        raise ConfigError(
            f"SGLang's indexer buffers sit on layers {got}; the model config says full layers "
            f"{list(geometry.full_indexer_layers)} plus MTP {list(geometry.mtp_layers)}, {want} of them here "
            f"(differ on {sorted(set(got) ^ set(want))})"
        )
    return k, [region("indexer", lay, ptrs[i], lens[i], items[i]) for i, lay in owned]

"""Byte-relevant facts two peers must share, a stable digest of them, and a field-level diff.

Page size, TP shape and context-parallel sharding are not part of the fingerprint: they may differ (the plan
converts them) and travel in the hello's ``PeerShape``, checked for convertibility instead. The wire's protocol
version is not part of it either: it lives with the protocol (``glm_pd_common.handoff.wire.protocol``) and every
message is checked against it before this is read.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import xxhash

from glm_pd_common.errors import ConfigError, LayoutMismatch
from glm_pd_common.layout.formats import IndexerFormat, MainRowFormat, check_page_tokens
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import MAX_PAGES_PER_BLOCK
from glm_pd_common.layout.shards import REPLICATED, Sharding, check_sharding
from glm_pd_common.layout.tp import SUPPORTED_TP

# The meaning of the fields below: bump when the same field values would lay bytes out differently.
LAYOUT_VERSION = 1
Text = Annotated[str, msgspec.Meta(max_length=256)]  # a peer's fingerprint is remote input, shown in refusals


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    layout_version: int
    model_type: Text
    num_layers: int
    full_indexer_layers: tuple[int, ...]
    mtp_layers: tuple[int, ...]
    kv_lora_rank: int
    qk_rope_head_dim: int
    cache_dtype: Text
    main_row_format: Text
    main_row_bytes: int
    indexer_head_dim: int
    indexer_row_bytes: int
    indexer_scale_format: Text
    model_revision: Text | None = None

    def digest(self) -> str:
        """xxh3-64 of the canonical msgpack encoding (field order is the struct's, so it is stable)."""
        return xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(self))


class PeerShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What may differ between peers: exchanged and checked for convertibility, not equality."""

    page_tokens: int  # tokens of one registered page (vLLM: its kernel block)
    tp_size: int
    tp_rank: int
    pages_per_block: int = 1  # pages in one of the engine's block ids (vLLM: kernel blocks per scheduler block)
    sharding: Sharding = REPLICATED  # context parallelism: how this side's ranks split each request's caches


def make_fingerprint(
    geometry: ModelGeometry, cache_dtype: str, row: MainRowFormat, indexer: IndexerFormat
) -> Fingerprint:
    return Fingerprint(
        layout_version=LAYOUT_VERSION,
        model_type=geometry.model_type,
        num_layers=geometry.num_layers,
        full_indexer_layers=geometry.full_indexer_layers,
        mtp_layers=geometry.mtp_layers,
        kv_lora_rank=geometry.kv_lora_rank,
        qk_rope_head_dim=geometry.qk_rope_head_dim,
        cache_dtype=cache_dtype,
        main_row_format=row.name,
        main_row_bytes=row.row_bytes,
        indexer_head_dim=indexer.head_dim,
        indexer_row_bytes=indexer.row_bytes,
        indexer_scale_format=indexer.scale_format,
        model_revision=geometry.revision,
    )


def diff(a: Fingerprint, b: Fingerprint) -> list[tuple[str, object, object]]:
    """Every field on which the two differ, with both values. A revision counts only when both know it."""
    out = []
    for name in a.__struct_fields__:
        va, vb = getattr(a, name), getattr(b, name)
        if name == "model_revision" and (va is None or vb is None):
            continue
        if va != vb:
            out.append((name, va, vb))
    return out


def require_match(
    local: Fingerprint, remote: Fingerprint, *, local_name: str = "local", remote_name: str = "remote"
) -> None:
    """Refuse a peer whose layout differs in any byte-relevant fact, naming every field."""
    diffs = diff(local, remote)
    if diffs:
        raise LayoutMismatch(diffs, local=local_name, remote=remote_name)


def check_shape(shape: PeerShape, *, side: str) -> None:
    """A page size and TP shape the plan can convert from or to; anything else is refused with the value."""
    check_page_tokens(shape.page_tokens, what=f"{side} page_tokens")
    if shape.tp_size not in SUPPORTED_TP:
        raise ConfigError(f"{side} tp_size must be one of {SUPPORTED_TP}, got {shape.tp_size}")
    if not 0 <= shape.tp_rank < shape.tp_size:
        raise ConfigError(f"{side} tp_rank {shape.tp_rank} is outside 0..{shape.tp_size - 1}")
    if not 1 <= shape.pages_per_block <= MAX_PAGES_PER_BLOCK:
        raise ConfigError(f"{side} pages_per_block must be in 1..{MAX_PAGES_PER_BLOCK}, got {shape.pages_per_block}")
    check_sharding(shape.sharding, tp_size=shape.tp_size, page_tokens=shape.page_tokens, side=side)


def require_convertible(prefill: PeerShape, decode: PeerShape) -> None:
    """Both shapes must be ones the plan converts between (any supported pair converts)."""
    check_shape(prefill, side="prefill")
    check_shape(decode, side="decode")

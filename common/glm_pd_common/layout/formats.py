"""Byte layouts of one cache page.

Every page glm-pd moves is a sequence of *segments*; each segment is token-major with a fixed number of
bytes per token and starts at ``page_tokens × (bytes per token of the segments before it)``. The main MLA
row is one segment (656 B for ``fp8_ds_mla``); the indexer page is two (128 B fp8 keys, then 4 B scales).
Page-size conversion maps each segment separately, which is why the indexer's scale block is never
split proportionally with the page's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glm_pd_common.errors import ConfigError

FP8_TILE = 128  # fp8_ds_mla quantizes the latent in tiles of 128 values, one fp32 scale per tile
INDEXER_SCALE_BYTES = 4
INDEXER_SCALE_FORMATS = ("fp32", "ue8m0x4")  # one fp32 per token; four identical UE8M0 bytes (cache_dtypes)
SUPPORTED_PAGE_TOKENS = (16, 32, 64, 128)


@dataclass(frozen=True)
class MainRowFormat:
    """One token's row of the main MLA cache, with the named byte ranges inside it."""

    name: str
    row_bytes: int
    fields: tuple[tuple[str, int, int], ...]  # (field, start byte, end byte)

    def field_range(self, field: str) -> tuple[int, int]:
        for name, start, end in self.fields:
            if name == field:
                return start, end
        raise KeyError(f"row format {self.name} has no field {field!r}; it has {[f[0] for f in self.fields]}")


ROW_FORMATS = ("fp8_ds_mla", "fp8_raw", "bf16")  # engines' dtype names map onto these in cache_dtypes


def main_row_format(row_format: str, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64) -> MainRowFormat:
    """The main-KV row of one of glm-pd's row formats; raises on any other name (engine names go through
    ``cache_dtypes`` first, because the same name means different rows to different engines)."""
    if row_format not in ROW_FORMATS:
        raise ConfigError(f"main row format {row_format!r} is not one of {', '.join(ROW_FORMATS)}")
    fields: tuple[tuple[str, int, int], ...]
    if row_format == "fp8_ds_mla":
        if kv_lora_rank % FP8_TILE:
            raise ConfigError(f"fp8_ds_mla needs kv_lora_rank divisible by {FP8_TILE}, got {kv_lora_rank}")
        scales_end = kv_lora_rank + 4 * (kv_lora_rank // FP8_TILE)
        fields = (
            ("latent_fp8", 0, kv_lora_rank),
            ("latent_scales_fp32", kv_lora_rank, scales_end),
            ("rope_bf16", scales_end, scales_end + 2 * qk_rope_head_dim),
        )
    elif row_format == "bf16":
        fields = (
            ("latent_bf16", 0, 2 * kv_lora_rank),
            ("rope_bf16", 2 * kv_lora_rank, 2 * (kv_lora_rank + qk_rope_head_dim)),
        )
    else:
        fields = (("latent_fp8", 0, kv_lora_rank), ("rope_fp8", kv_lora_rank, kv_lora_rank + qk_rope_head_dim))
    return MainRowFormat(name=row_format, row_bytes=fields[-1][2], fields=fields)


@dataclass(frozen=True)
class PageFormat:
    """The segments of one page, each as bytes per token; the same format serves any page size."""

    segment_bytes_per_token: tuple[int, ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(self.segment_bytes_per_token)

    def page_bytes(self, page_tokens: int) -> int:
        return page_tokens * self.bytes_per_token

    def segment_starts(self, page_tokens: int) -> np.ndarray:
        """Byte offset of each segment inside a page of ``page_tokens`` tokens."""
        widths = np.asarray(self.segment_bytes_per_token, dtype=np.int64)
        return page_tokens * np.concatenate(([0], np.cumsum(widths)[:-1]))

    def token_ranges(self, token_in_page: np.ndarray | int, page_tokens: int) -> np.ndarray:
        """Start byte of token t's slice in every segment: shape (..., segments); widths are the segments'."""
        t = np.asarray(token_in_page, dtype=np.int64)
        if np.any((t < 0) | (t >= page_tokens)):
            raise ValueError(f"token index outside a page of {page_tokens} tokens")
        widths = np.asarray(self.segment_bytes_per_token, dtype=np.int64)
        return self.segment_starts(page_tokens) + t[..., None] * widths


def main_page_format(row: MainRowFormat) -> PageFormat:
    return PageFormat((row.row_bytes,))


@dataclass(frozen=True)
class IndexerFormat:
    """The lightning-indexer key cache: per page, all fp8 keys, then all scales."""

    head_dim: int = 128
    scale_format: str = "fp32"

    def __post_init__(self) -> None:
        if self.scale_format not in INDEXER_SCALE_FORMATS:
            raise ConfigError(
                f"indexer scale format {self.scale_format!r} is not one of {', '.join(INDEXER_SCALE_FORMATS)}"
            )

    @property
    def row_bytes(self) -> int:
        return self.head_dim + INDEXER_SCALE_BYTES

    @property
    def page_format(self) -> PageFormat:
        return PageFormat((self.head_dim, INDEXER_SCALE_BYTES))

    def key_range(self, token_in_page: int, page_tokens: int) -> tuple[int, int]:
        start = int(self.page_format.token_ranges(token_in_page, page_tokens)[0])
        return start, start + self.head_dim

    def scale_range(self, token_in_page: int, page_tokens: int) -> tuple[int, int]:
        start = int(self.page_format.token_ranges(token_in_page, page_tokens)[1])
        return start, start + INDEXER_SCALE_BYTES


def check_page_tokens(page_tokens: int, *, what: str = "page_tokens") -> int:
    if page_tokens not in SUPPORTED_PAGE_TOKENS:
        raise ConfigError(f"{what} must be one of {SUPPORTED_PAGE_TOKENS}, got {page_tokens!r}")
    return page_tokens

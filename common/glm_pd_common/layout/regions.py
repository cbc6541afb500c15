"""Registered cache regions: one buffer of pages per (kind, layer), and the bounds checks on page ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from glm_pd_common.errors import ConfigError, PageOutOfRange
from glm_pd_common.layout.formats import IndexerFormat, MainRowFormat, PageFormat, main_page_format
from glm_pd_common.layout.geometry import ModelGeometry

RegionKind = Literal["main", "indexer"]
MemKind = Literal["DRAM", "VRAM"]


@dataclass(frozen=True)
class Region:
    """One cache buffer as registered with a transport. Page ``p`` starts at ``base_addr + p * page_stride``."""

    kind: RegionKind
    layer_id: int
    is_mtp: bool
    base_addr: int
    page_tokens: int
    page_bytes: int
    page_stride: int
    num_pages: int
    page_format: PageFormat
    mem_kind: MemKind = "DRAM"
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.page_bytes != self.page_format.page_bytes(self.page_tokens):
            raise ConfigError(
                f"region {self.name}: page_bytes {self.page_bytes} != {self.page_tokens} tokens × "
                f"{self.page_format.bytes_per_token} B of its page format"
            )
        if self.page_stride < self.page_bytes:
            raise ConfigError(f"region {self.name}: page_stride {self.page_stride} < page_bytes {self.page_bytes}")
        if self.num_pages <= 0:
            raise ConfigError(f"region {self.name}: num_pages must be positive, got {self.num_pages}")

    @property
    def name(self) -> str:
        return f"{self.kind}[layer {self.layer_id}{' mtp' if self.is_mtp else ''}]"

    @property
    def key(self) -> tuple[str, int]:
        """What pairs a region with its peer's: the same cache of the same layer."""
        return self.kind, self.layer_id

    @property
    def size_bytes(self) -> int:
        return (self.num_pages - 1) * self.page_stride + self.page_bytes

    def check_pages(self, page_ids: np.ndarray, *, side: str = "local") -> np.ndarray:
        """Refuse any page id outside ``[0, num_pages)``; returns the ids as int64."""
        ids = np.asarray(page_ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise PageOutOfRange(f"{side} page ids for region {self.name} are not integers (dtype {ids.dtype})")
        bad = (ids < 0) | (ids >= self.num_pages)  # on the ids as sent: a uint64 id is named as the peer sent it
        if np.any(bad):
            first = int(ids[np.argmax(bad)])
            raise PageOutOfRange(
                f"{side} page id {first} is outside region {self.name} (valid 0..{self.num_pages - 1}); "
                f"{int(bad.sum())} bad id(s) in all"
            )
        return ids.astype(np.int64, copy=False)


def build_regions(
    geometry: ModelGeometry,
    row: MainRowFormat,
    indexer: IndexerFormat,
    *,
    page_tokens: int,
    num_pages: int,
    main_addrs: dict[int, int],
    indexer_addrs: dict[int, int],
    main_stride: int | None = None,
    indexer_stride: int | None = None,
    mem_kind: MemKind = "DRAM",
    device_id: int = 0,
    held: tuple[int, ...] | None = None,
) -> list[Region]:
    """Describe a rank's caches as regions in plan order, checked against the geometry.

    The layer sets must be exactly the geometry's (or, under a layer split, exactly the ``held`` layers'):
    an indexer buffer on a shared layer, or a full layer without one, means the engine and glm-pd disagree
    about the model and nothing may move.
    """
    layers = geometry.all_layers if held is None else held
    _check_layer_set("main", set(main_addrs), set(layers))
    _check_layer_set("indexer", set(indexer_addrs), set(geometry.indexer_layers) & set(layers))
    main_fmt, idx_fmt = main_page_format(row), indexer.page_format
    regions: list[Region] = []
    for layer in layers:
        is_mtp = layer >= geometry.num_layers
        specs = [("main", main_addrs[layer], main_fmt, main_stride)]
        if layer in indexer_addrs:
            specs.append(("indexer", indexer_addrs[layer], idx_fmt, indexer_stride))
        for kind, addr, fmt, stride in specs:
            page_bytes = fmt.page_bytes(page_tokens)
            regions.append(
                Region(
                    kind=kind,  # type: ignore[arg-type]  # "main" or "indexer": the two literals above
                    layer_id=layer,
                    is_mtp=is_mtp,
                    base_addr=addr,
                    page_tokens=page_tokens,
                    page_bytes=page_bytes,
                    page_stride=stride or page_bytes,
                    num_pages=num_pages,
                    page_format=fmt,
                    mem_kind=mem_kind,
                    device_id=device_id,
                )
            )
    return regions


def _check_layer_set(kind: str, got: set[int], want: set[int]) -> None:
    if got != want:
        extra, missing = sorted(got - want), sorted(want - got)
        raise ConfigError(
            f"{kind} cache layers do not match the model geometry: "
            f"unexpected layers {extra} (the config marks them without a {kind} cache), missing layers {missing}"
        )


def plan_order(regions: list[Region]) -> list[Region]:
    """Layer ascending (MTP ids follow the target's), main before indexer within a layer."""
    return sorted(regions, key=lambda r: (r.layer_id, r.kind != "main"))

"""A rank's cache spec: the model geometry plus the byte formats its engine chose."""

from __future__ import annotations

from dataclasses import dataclass

from glm_pd_common.layout.fingerprint import Fingerprint, make_fingerprint
from glm_pd_common.layout.formats import IndexerFormat, MainRowFormat, main_row_format
from glm_pd_common.layout.geometry import ModelGeometry


@dataclass(frozen=True)
class CacheSpec:
    geometry: ModelGeometry
    cache_dtype: str
    row: MainRowFormat
    indexer: IndexerFormat

    @classmethod
    def create(cls, geometry: ModelGeometry, cache_dtype: str = "fp8_ds_mla", scale_format: str = "fp32") -> CacheSpec:
        row = main_row_format(cache_dtype, geometry.kv_lora_rank, geometry.qk_rope_head_dim)
        return cls(geometry, cache_dtype, row, IndexerFormat(geometry.index_head_dim, scale_format))

    def fingerprint(self) -> Fingerprint:
        return make_fingerprint(self.geometry, self.cache_dtype, self.row, self.indexer)

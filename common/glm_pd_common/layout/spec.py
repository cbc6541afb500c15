"""A rank's cache spec: the model geometry plus the byte formats its engine chose."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm_pd_common.layout.fingerprint import Fingerprint, make_fingerprint
from glm_pd_common.layout.formats import IndexerFormat, MainRowFormat, main_row_format
from glm_pd_common.layout.geometry import ModelGeometry


@dataclass(frozen=True)
class CacheSpec:
    """``cache_dtype`` holds glm-pd's row format name (``formats.ROW_FORMATS``), never an engine's dtype name.

    ``origin`` says what chose the formats (engine, dtype name, backend, device), so a refusal of the cache
    tensors can name it; it is not a byte fact and takes no part in the fingerprint.
    """

    geometry: ModelGeometry
    cache_dtype: str
    row: MainRowFormat
    indexer: IndexerFormat
    origin: str = field(default="", compare=False)

    @classmethod
    def create(
        cls, geometry: ModelGeometry, row_format: str = "fp8_ds_mla", scale_format: str = "fp32", *, origin: str = ""
    ) -> CacheSpec:
        row = main_row_format(row_format, geometry.kv_lora_rank, geometry.qk_rope_head_dim)
        return cls(geometry, row_format, row, IndexerFormat(geometry.index_head_dim, scale_format), origin)

    def fingerprint(self) -> Fingerprint:
        return make_fingerprint(self.geometry, self.cache_dtype, self.row, self.indexer)

"""One rank's GLM-5.3 caches in VRAM, and the byte pattern both smoke processes compute on the device.

A CUDA tensor per region, as vLLM allocates one per layer, described as core regions with the device id
taken from the tensors. Page contents are a function of (seed, region, page id, byte offset) that each
process evaluates on its own GPU, so the reader builds the bytes it expects without any host copy, and the
comparison (``torch.equal``) runs on the device.
"""

from __future__ import annotations

import torch

from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.regions import Region, build_regions
from glm_pd_common.layout.spec import CacheSpec

# GLM-5.3 with fp8_ds_mla (FACTS.md §1-2), written out so the smoke checks the spec it runs on:
MAIN_ROW_BYTES = 656  # 512 fp8 + 4 fp32 scales + 64 bf16 RoPE
INDEXER_KEY_BYTES, INDEXER_SCALE_BYTES = 128, 4  # per token; a page holds every key, then every scale
MAIN_LAYERS, INDEXER_LAYERS = 78 + 1, 21 + 1  # the target's layers and full layers, each plus the MTP layer

_P = 2_147_483_647  # 2^31 - 1: the pattern's modulus (int64 products never overflow)
_CHUNK_PAGES = 256  # bound the int64 temporaries of one fill to ~100 MB per call


def cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def glm53_spec() -> CacheSpec:
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    got = (len(spec.geometry.all_layers), len(spec.geometry.indexer_layers), spec.row.row_bytes)
    want = (MAIN_LAYERS, INDEXER_LAYERS, MAIN_ROW_BYTES)
    if got != want or spec.indexer.row_bytes != INDEXER_KEY_BYTES + INDEXER_SCALE_BYTES:
        raise AssertionError(f"glm-5.3 spec is {got} / {spec.indexer.row_bytes} B, expected {want} / 132 B")
    return spec


def pattern(seed: int, region_no: int, pages: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """The bytes of ``pages`` (int64 ids on the device) of region ``region_no`` under ``seed``: [n, page_bytes]."""
    offsets = torch.arange(page_bytes, device=pages.device, dtype=torch.int64)
    x = pages[:, None] * 65_537 + offsets[None, :] + (region_no * 131 + seed * 7_919) * 1_000_003
    x = x % _P
    x = (x * 48_271) % _P
    x = (x * 48_271) % _P
    return (x & 0xFF).to(torch.uint8)


class VramCaches:
    """A rank's caches: one uint8 tensor [num_pages, page_bytes] per region, all on ``device`` (a GPU)."""

    def __init__(self, spec: CacheSpec, *, page_tokens: int, num_pages: int, device: torch.device) -> None:
        g = spec.geometry
        self.num_pages = num_pages
        self.tensors: dict[tuple[str, int], torch.Tensor] = {}
        for layer in g.all_layers:
            self.tensors["main", layer] = self._alloc(num_pages, spec.row.row_bytes * page_tokens, device)
            if g.is_full(layer):
                self.tensors["indexer", layer] = self._alloc(num_pages, spec.indexer.row_bytes * page_tokens, device)
        devices = {t.device for t in self.tensors.values()}
        if len(devices) != 1:
            raise AssertionError(f"caches span devices {devices}")
        (where,) = devices
        # as glm_pd_vllm.caches describes vLLM's tensors: memory kind and device id come from the tensors
        self.device_id: int = where.index if where.type == "cuda" else 0
        self.regions: list[Region] = build_regions(
            g,
            spec.row,
            spec.indexer,
            page_tokens=page_tokens,
            num_pages=num_pages,
            main_addrs={lay: t.data_ptr() for (k, lay), t in self.tensors.items() if k == "main"},
            indexer_addrs={lay: t.data_ptr() for (k, lay), t in self.tensors.items() if k == "indexer"},
            mem_kind="VRAM" if where.type == "cuda" else "DRAM",
            device_id=self.device_id,
        )

    @staticmethod
    def _alloc(num_pages: int, page_bytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty((num_pages, page_bytes), dtype=torch.uint8, device=device)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    def tensor(self, region: Region) -> torch.Tensor:
        return self.tensors[region.key]

    def fill(self, seed: int, pages: torch.Tensor) -> None:
        """Write ``seed``'s pattern into ``pages`` of every region, on the current stream (no host sync)."""
        for no, region in enumerate(self.regions):
            t = self.tensor(region)
            for part in pages.split(_CHUNK_PAGES):
                t[part] = pattern(seed, no, part, region.page_bytes)

    def expected(
        self, no: int, *, own_seed: int, src_seed: int, src_pages: torch.Tensor, dst_pages: torch.Tensor
    ) -> torch.Tensor:
        """Region ``no`` after a load: ``own_seed`` everywhere, the source's pages on ``dst_pages``. Pages of one
        size travel whole, a partly filled last page too (``common/layout/pages.py``: SGLang's checksum
        compares whole pages), so a page is either all decode's or all the source's."""
        region = self.regions[no]
        exp = torch.empty_like(self.tensor(region))
        for part in torch.arange(self.num_pages, device=exp.device, dtype=torch.int64).split(_CHUNK_PAGES):
            exp[part] = pattern(own_seed, no, part, region.page_bytes)
        for s, d in zip(src_pages.split(_CHUNK_PAGES), dst_pages.split(_CHUNK_PAGES), strict=True):
            exp[d] = pattern(src_seed, no, s, region.page_bytes)
        return exp

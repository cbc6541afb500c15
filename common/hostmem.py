"""Host-memory caches with real GLM-5.x byte layouts, for the demo, the benchmarks and the tests.

Content is a pure function of (seed, kind, layer, token index), never of the page a token sits in, so a
decode side can hold "the same prefix" as prefill after a prefix-cache hit, and a byte-exact check can
compare tokens across different page sizes and page tables. Every value is layout-valid: fp8 e4m3 bytes
that are not NaN, power-of-two scales, bf16 RoPE values.
"""

from __future__ import annotations

import numpy as np

from glm_pd_common.errors import ConfigError
from glm_pd_common.regions import MemKind, Region, build_regions
from glm_pd_common.spec import CacheSpec

_FP8_NAN = (0x7F, 0xFF)
_BLOCK_TOKENS = 8192  # bounds the index arrays of one fancy-indexed write to ~50 MB


def _blocks(start: int, end: int) -> list[np.ndarray]:
    return [np.arange(s, min(s + _BLOCK_TOKENS, end), dtype=np.int64) for s in range(start, end, _BLOCK_TOKENS)]


def _mix(seed: int, kind: int, layer: int, tokens: np.ndarray, width: int) -> np.ndarray:
    """A cheap deterministic uint32 stream of shape (tokens, width) (splitmix-style multiply/xorshift)."""
    t = tokens.astype(np.uint64)[:, None]
    b = np.arange(width, dtype=np.uint64)[None, :]
    x = (t * np.uint64(0x9E3779B97F4A7C15)) ^ (b * np.uint64(0xBF58476D1CE4E5B9))
    x ^= np.uint64((seed * 1_000_003 + kind * 7919 + layer * 104_729) & 0xFFFFFFFFFFFF)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    return (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _fp8(bits: np.ndarray) -> np.ndarray:
    out = (bits & 0xFF).astype(np.uint8)
    out[np.isin(out, _FP8_NAN)] = 0x3C  # 1.5: any non-NaN value keeps the row valid
    return out


def _pow2_fp32(bits: np.ndarray) -> np.ndarray:
    exponent = -(bits % 12).astype(np.int32)
    return np.ldexp(np.ones(bits.shape, dtype=np.float32), exponent).astype("<f4").view(np.uint8)


def _bf16(bits: np.ndarray) -> np.ndarray:
    values = ((bits % 2001).astype(np.float32) - 1000.0) / 256.0
    return (values.astype("<f4").view("<u2")[..., 1::2]).copy().view(np.uint8)


def token_rows(spec: CacheSpec, kind: str, layer: int, tokens: np.ndarray, seed: int) -> np.ndarray:
    """Each token's bytes for one cache, shape (tokens, bytes per token), segments concatenated."""
    if kind == "main":
        fields = {name: (start, end) for name, start, end in spec.row.fields}
        out = np.empty((tokens.size, spec.row.row_bytes), dtype=np.uint8)
        for name, (start, end) in fields.items():
            width = end - start
            if name.endswith("fp8"):
                out[:, start:end] = _fp8(_mix(seed, 1, layer, tokens, width))
            elif name.endswith("fp32"):
                out[:, start:end] = _pow2_fp32(_mix(seed, 2, layer, tokens, width // 4))
            else:
                out[:, start:end] = _bf16(_mix(seed, 3, layer, tokens, width // 2))
        return out
    head = spec.indexer.head_dim
    keys = _fp8(_mix(seed, 4, layer, tokens, head))
    bits = _mix(seed, 5, layer, tokens, 1)
    if spec.indexer.scale_format == "fp32":
        scales = _pow2_fp32(bits)
    else:
        scales = np.repeat((127 - (bits % 12)).astype(np.uint8), 4, axis=1)
    return np.concatenate([keys, scales], axis=1)


class HostCaches:
    """One rank's caches in host memory: a numpy buffer per region, described as core regions."""

    def __init__(
        self, spec: CacheSpec, *, page_tokens: int, num_pages: int, page_padding: int = 0, mem_kind: MemKind = "DRAM"
    ) -> None:
        self.spec = spec
        self.page_tokens = page_tokens
        self.num_pages = num_pages
        g = spec.geometry
        main_page = spec.row.row_bytes * page_tokens
        index_page = spec.indexer.row_bytes * page_tokens
        self.buffers: dict[tuple[str, int], np.ndarray] = {}
        for layer in g.all_layers:
            self.buffers["main", layer] = np.zeros((num_pages, main_page + page_padding), dtype=np.uint8)
            if g.is_full(layer):
                self.buffers["indexer", layer] = np.zeros((num_pages, index_page + page_padding), dtype=np.uint8)
        self.regions: list[Region] = build_regions(
            g,
            spec.row,
            spec.indexer,
            page_tokens=page_tokens,
            num_pages=num_pages,
            main_addrs={lay: b.ctypes.data for (k, lay), b in self.buffers.items() if k == "main"},
            indexer_addrs={lay: b.ctypes.data for (k, lay), b in self.buffers.items() if k == "indexer"},
            main_stride=main_page + page_padding,
            indexer_stride=index_page + page_padding,
            mem_kind=mem_kind,
        )

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    @staticmethod
    def bytes_needed(spec: CacheSpec, *, page_tokens: int, num_pages: int) -> int:
        g = spec.geometry
        per_page = len(g.all_layers) * spec.row.row_bytes + len(g.indexer_layers) * spec.indexer.row_bytes
        return per_page * page_tokens * num_pages

    def _slots(self, region: Region, page_table: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page row, byte column) index arrays of each token's bytes in one region's buffer."""
        page_index = tokens // self.page_tokens
        if page_index.size and page_index.max() >= page_table.size:
            raise ConfigError(f"page table of {page_table.size} pages cannot hold token {int(tokens.max())}")
        pages = region.check_pages(page_table[page_index])
        starts = region.page_format.token_ranges(tokens % self.page_tokens, self.page_tokens)
        cols = [
            start[:, None] + np.arange(width, dtype=np.int64)[None, :]
            for start, width in zip(starts.T, region.page_format.segment_bytes_per_token, strict=True)
        ]
        return pages[:, None], np.concatenate(cols, axis=1)

    def write_tokens(self, page_table: np.ndarray, start: int, end: int, *, seed: int) -> None:
        """Write tokens ``[start, end)`` of a request whose pages are ``page_table``."""
        table = np.asarray(page_table, dtype=np.int64)
        for tokens in _blocks(start, end):
            for region in self.regions:
                rows, cols = self._slots(region, table, tokens)
                data = token_rows(self.spec, region.kind, region.layer_id, tokens, seed)
                self.buffers[region.key][rows, cols] = data

    def read_tokens(self, region: Region, page_table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        rows, cols = self._slots(region, np.asarray(page_table, dtype=np.int64), tokens)
        return self.buffers[region.key][rows, cols]

    def mismatched_tokens(self, page_table: np.ndarray, start: int, end: int, *, seed: int) -> list[str]:
        """Regions whose tokens ``[start, end)`` differ from the expected content, with the first bad token."""
        wrong: dict[str, list[int]] = {}
        for tokens in _blocks(start, end):
            for region in self.regions:
                got = self.read_tokens(region, page_table, tokens)
                want = token_rows(self.spec, region.kind, region.layer_id, tokens, seed)
                hit = tokens[np.any(got != want, axis=1)]
                if hit.size:
                    count_first = wrong.setdefault(region.name, [0, int(hit[0])])
                    count_first[0] += int(hit.size)
        return [f"{name}: {n} token(s) differ, first token {first}" for name, (n, first) in wrong.items()]

"""Host-memory caches with real GLM-5.x byte layouts, for the demo, the benchmarks and the tests.

Content is a pure function of (seed, kind, layer, token index), never of the page a token sits in, so a
decode side can hold "the same prefix" as prefill after a prefix-cache hit, and a byte-exact check can
compare tokens across different page sizes and page tables. Every value is layout-valid: fp8 e4m3 bytes
that are not NaN, power-of-two scales, bf16 RoPE values.
"""

from __future__ import annotations

import time

import numpy as np

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.regions import MemKind, Region, build_regions
from glm_pd_common.layout.shards import WHOLE, TokenShard
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.transport.base import Span, Transport
from glm_pd_common.transport.staging import HostMover, StageMode, Staging

_BLOCK_TOKENS = 16384  # bounds the temporaries of one block to ~100 MB


def _blocks(start: int, end: int) -> list[np.ndarray]:
    return [np.arange(s, min(s + _BLOCK_TOKENS, end), dtype=np.int64) for s in range(start, end, _BLOCK_TOKENS)]


def _token_hash(tokens: np.ndarray, seed: int, kind: int, layer: int) -> np.ndarray:
    """A 64-bit splitmix hash per token, as 8 bytes: shape (tokens, 8)."""
    x = tokens.astype(np.uint64) + np.uint64((seed * 1_000_003 + kind * 7919 + layer * 104_729) & 0xFFFFFFFF)
    x *= np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    return x.view(np.uint8).reshape(-1, 8)


def _stream(seed: int, kind: int, layer: int, tokens: np.ndarray, width: int) -> np.ndarray:
    """Deterministic bytes of shape (tokens, width): a per-(kind, layer) template shifted by a per-token hash.

    Cheap (one byte add per output byte) and distinct per token: any misplaced token shows up.
    """
    template = np.random.default_rng([seed, kind, layer]).integers(0, 256, width, dtype=np.uint8)
    h = _token_hash(tokens, seed, kind, layer)
    return np.add(template[None, :], np.tile(h, -(-width // 8))[:, :width], order="C")


def _fp8(raw: np.ndarray) -> np.ndarray:
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # 0x7F/0xFF are NaN in e4m3; 1.5 keeps the row valid
    return raw


def _pow2_fp32(raw: np.ndarray) -> np.ndarray:
    exponent = -(raw % 12).astype(np.int32)
    return np.ldexp(np.ones(raw.shape, dtype=np.float32), exponent).astype("<f4").view(np.uint8)


def _bf16(raw: np.ndarray) -> np.ndarray:
    values = (raw.astype(np.float32) - 128.0) / 16.0
    return (values.astype("<f4").view("<u2")[..., 1::2]).copy().view(np.uint8)


def token_rows(spec: CacheSpec, kind: str, layer: int, tokens: np.ndarray, seed: int) -> np.ndarray:
    """Each token's bytes for one cache, shape (tokens, bytes per token), segments concatenated."""
    if kind == "main":
        out = np.empty((tokens.size, spec.row.row_bytes), dtype=np.uint8)
        for i, (name, start, end) in enumerate(spec.row.fields):
            width = end - start
            if name.endswith("fp8"):
                out[:, start:end] = _fp8(_stream(seed, 10 + i, layer, tokens, width))
            elif name.endswith("fp32"):
                out[:, start:end] = _pow2_fp32(_stream(seed, 10 + i, layer, tokens, width // 4))
            else:
                out[:, start:end] = _bf16(_stream(seed, 10 + i, layer, tokens, width // 2))
        return out
    keys = _fp8(_stream(seed, 20, layer, tokens, spec.indexer.head_dim))
    raw = _stream(seed, 21, layer, tokens, 1)
    if spec.indexer.scale_format == "fp32":
        scales = _pow2_fp32(raw)
    else:
        scales = np.repeat((127 - (raw % 12)).astype(np.uint8), 4, axis=1)
    return np.concatenate([keys, scales], axis=1)


def _touched(shape: tuple[int, int]) -> np.ndarray:
    """Zeroed memory with every page faulted in, as an engine's preallocated cache is; an untouched
    destination would make the first transfer pay the kernel's page faults."""
    buf = np.empty(shape, dtype=np.uint8)
    buf.fill(0)
    return buf


class HostCaches:
    """One rank's caches in host memory: a numpy buffer per region, described as core regions."""

    def __init__(
        self,
        spec: CacheSpec,
        *,
        page_tokens: int,
        num_pages: int,
        page_padding: int = 0,
        mem_kind: MemKind = "DRAM",
        shard: TokenShard = WHOLE,
        held: tuple[int, ...] | None = None,
    ) -> None:
        """``shard``: the tokens this rank holds, each at its local slot (context parallelism); ``held``: the
        layers it holds (a layer split; default every layer)."""
        self.spec = spec
        self.page_tokens = page_tokens
        self.num_pages = num_pages
        self.shard = shard
        g = spec.geometry
        main_page = spec.row.row_bytes * page_tokens
        index_page = spec.indexer.row_bytes * page_tokens
        self.buffers: dict[tuple[str, int], np.ndarray] = {}
        for layer in g.all_layers if held is None else held:
            self.buffers["main", layer] = _touched((num_pages, main_page + page_padding))
            if g.is_full(layer):
                self.buffers["indexer", layer] = _touched((num_pages, index_page + page_padding))
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
            held=held,
        )

    def flip(self, region: Region, offset: int) -> None:
        """Invert one byte of a region (the demo's injected corruption: a faulty link's damage)."""
        self.buffers[region.kind, region.layer_id].reshape(-1)[offset] ^= 0xFF

    @staticmethod
    def bytes_needed(spec: CacheSpec, *, page_tokens: int, num_pages: int) -> int:
        g = spec.geometry
        per_page = len(g.all_layers) * spec.row.row_bytes + len(g.indexer_layers) * spec.indexer.row_bytes
        return per_page * page_tokens * num_pages

    def _segments(self, region: Region, page_table: np.ndarray, tokens: np.ndarray):
        """Per segment: (a (pages, page_tokens, width) view of the buffer, page ids, token-in-page, columns).
        ``tokens`` are this rank's own (``owned``), placed at their local slots."""
        tokens = self.shard.local(tokens)
        page_index = tokens // self.page_tokens
        if page_index.size and page_index.max() >= page_table.size:
            raise ConfigError(f"page table of {page_table.size} pages cannot hold token {int(tokens.max())}")
        pages = region.check_pages(page_table[page_index])
        in_page = tokens % self.page_tokens
        buf = self.buffers[region.key]
        col, out = 0, []
        for start, width in zip(
            region.page_format.segment_starts(self.page_tokens).tolist(),
            region.page_format.segment_bytes_per_token,
            strict=True,
        ):
            view = buf[:, start : start + self.page_tokens * width].reshape(self.num_pages, self.page_tokens, width)
            out.append((view, pages, in_page, slice(col, col + width)))
            col += width
        return out

    def owned(self, start: int, end: int) -> list[np.ndarray]:
        """This rank's tokens of ``[start, end)``, in blocks."""
        return [b[self.shard.owns(b)] for b in _blocks(start, end)]

    def write_tokens(self, page_table: np.ndarray, start: int, end: int, *, seed: int) -> None:
        """Write this rank's tokens of ``[start, end)`` of a request whose pages are ``page_table``."""
        table = np.asarray(page_table, dtype=np.int64)
        for tokens in self.owned(start, end):
            for region in self.regions:
                data = token_rows(self.spec, region.kind, region.layer_id, tokens, seed)
                for view, pages, in_page, cols in self._segments(region, table, tokens):
                    view[pages, in_page] = data[:, cols]

    def read_tokens(self, region: Region, page_table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        table = np.asarray(page_table, dtype=np.int64)
        parts = [view[pages, in_page] for view, pages, in_page, _ in self._segments(region, table, tokens)]
        return np.concatenate(parts, axis=1)

    def mismatched_tokens(self, page_table: np.ndarray, start: int, end: int, *, seed: int) -> list[str]:
        """Regions whose tokens (this rank's) of ``[start, end)`` differ from the expected content, with the
        first bad token."""
        wrong: dict[str, list[int]] = {}
        for tokens in self.owned(start, end):
            for region in self.regions:
                got = self.read_tokens(region, page_table, tokens)
                want = token_rows(self.spec, region.kind, region.layer_id, tokens, seed)
                hit = tokens[np.any(got != want, axis=1)]
                if hit.size:
                    count_first = wrong.setdefault(region.name, [0, int(hit[0])])
                    count_first[0] += int(hit.size)
        return [f"{name}: {n} token(s) differ, first token {first}" for name, (n, first) in wrong.items()]

    def equal_bytes(self, page_table: np.ndarray, start: int, end: int, *, seed: int) -> int:
        """How many bytes of tokens ``[start, end)``, over every region, equal the content ``seed`` writes."""
        same = 0
        for tokens in self.owned(start, end):
            for region in self.regions:
                got = self.read_tokens(region, page_table, tokens)
                same += int(np.count_nonzero(got == token_rows(self.spec, region.kind, region.layer_id, tokens, seed)))
        return same


def host_staging(
    transport: Transport, regions: list[Region], *, slot_bytes: int, pairs: int, mode: StageMode = "auto"
) -> Staging:
    """A staging buffer in host memory, registered with ``transport`` beside ``regions`` (``transport.staging``)."""
    buffer = np.zeros(2 * slot_bytes * pairs, dtype=np.uint8)
    span = Span("staging", buffer.ctypes.data, buffer.size)
    transport.register([span])
    mover = HostMover([*(Span(r.name, r.base_addr, r.size_bytes) for r in regions), span])
    return Staging(span, slot_bytes, mover, mode, backing=buffer)


def memcpy_gbps(num_bytes: int, repeats: int = 3) -> float:
    """Single-thread memcpy ceiling of this machine, measured now: best of ``repeats`` over ``num_bytes``
    (at least 1 MiB, at most 512 MiB), on memory faulted in beforehand."""
    n = int(min(max(num_bytes, 1 << 20), 512 << 20))
    src, dst = np.ones(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9

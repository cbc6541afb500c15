"""A test-only tiny DSA model in torch, shaped like GLM-5.x where bytes are concerned.

It computes on the CPU, but its caches sit in pages with the exact byte layouts glm-pd moves:
- the main MLA latent cache: one 656 B ``fp8_ds_mla`` row per token. That is 512 fp8 e4m3 values in 4
  tiles of 128, then the 4 tiles' fp32 scales, then 64 bf16 RoPE values.
- the lightning-indexer key cache, per page: all tokens' 128 fp8 keys, then all tokens' fp32 power-of-two
  scales (SM90's format).

Full layers select their top-k cached tokens with the indexer. Shared layers reuse the previous full
layer's selection. An MTP layer (id ``num_layers``) runs on the last hidden state with its own caches, and
its logits count. The top-k is 16 tokens, so prompts of a few pages make the selection matter. Everything
is deterministic: identical cache bytes give identical tokens, whichever process or page size holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

LATENT, ROPE, TILE, INDEX_DIM = 512, 64, 128, 128
ROW = LATENT + 4 * (LATENT // TILE) + 2 * ROPE  # 656
INDEX_ROW = INDEX_DIM + 4  # 132
FP8_MAX = 448.0


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _unfp8(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).to(torch.float32)


def encode_main_row(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """One token's 656 B fp8_ds_mla row: per-tile fp32 scales (amax / 448), bf16 RoPE."""
    tiles = latent.view(LATENT // TILE, TILE)
    scales = (tiles.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-8)
    fp8 = _fp8(tiles / scales[:, None]).reshape(-1)
    return torch.cat([fp8, scales.to(torch.float32).view(torch.uint8), rope.to(torch.bfloat16).view(torch.uint8)])


def decode_main_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 656]`` uint8 -> latent ``[n, 512]`` and RoPE ``[n, 64]`` (float32)."""
    n = rows.shape[0]
    scales = rows[:, LATENT : LATENT + 16].contiguous().view(torch.float32)  # [n, 4]
    latent = (_unfp8(rows[:, :LATENT].contiguous()).view(n, 4, TILE) * scales[:, :, None]).view(n, LATENT)
    rope = rows[:, LATENT + 16 :].contiguous().view(torch.bfloat16).to(torch.float32)
    return latent, rope


def encode_index_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 key bytes and the 4 bytes of its power-of-two fp32 scale."""
    scale = torch.exp2(torch.ceil(torch.log2((key.abs().amax() / FP8_MAX).clamp(min=1e-8))))
    return _fp8(key / scale), scale.reshape(1).to(torch.float32).view(torch.uint8)


@dataclass
class PagedCache:
    """One request's view of a rank's caches: page buffers per layer and the request's page table.

    ``main[layer]`` is ``[num_pages, page_tokens * 656]`` uint8 and ``index[layer]`` is
    ``[num_pages, page_tokens * 132]`` uint8 (full and MTP layers only), both views of the engine's memory.
    """

    main: dict[int, torch.Tensor]
    index: dict[int, torch.Tensor]
    table: np.ndarray
    page_tokens: int

    def _where(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.as_tensor(self.table, dtype=torch.int64)
        return table[pos // self.page_tokens], pos % self.page_tokens

    def write(self, layer: int, pos: int, latent: torch.Tensor, rope: torch.Tensor, key: torch.Tensor | None) -> None:
        page, t = (int(v) for v in self._where(torch.tensor(pos)))
        self.main[layer][page, t * ROW : (t + 1) * ROW] = encode_main_row(latent, rope)
        if key is not None:
            fp8, scale = encode_index_key(key)
            P = self.page_tokens
            self.index[layer][page, t * INDEX_DIM : (t + 1) * INDEX_DIM] = fp8
            self.index[layer][page, P * INDEX_DIM + 4 * t : P * INDEX_DIM + 4 * t + 4] = scale

    def read_main(self, layer: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        page, t = self._where(pos)
        flat = self.main[layer].reshape(-1)
        base = page * self.main[layer].shape[1] + t * ROW
        return decode_main_rows(flat[base[:, None] + torch.arange(ROW)])

    def read_keys(self, layer: int, pos: torch.Tensor) -> torch.Tensor:
        page, t = self._where(pos)
        flat, P = self.index[layer].reshape(-1), self.page_tokens
        start = page * self.index[layer].shape[1]
        keys = _unfp8(flat[(start + t * INDEX_DIM)[:, None] + torch.arange(INDEX_DIM)])
        scales = flat[(start + P * INDEX_DIM + 4 * t)[:, None] + torch.arange(4)].contiguous().view(torch.float32)
        return keys * scales


@dataclass
class ShardedCache:
    """A decode-context-parallel engine's ranks as the one cache its attention reads (DCP gathers every rank's
    tokens): token ``pos`` lives on rank ``(pos // I) % N`` at local slot ``(pos // (I·N))·I + pos % I``, as
    vLLM's slot-mapping kernel places it (``v1/worker/block_table.py``; ``tests/vllm/test_vllm_dcp.py`` holds
    the handoff to vLLM's own kernel)."""

    ranks: list[PagedCache]
    interleave: int

    def _split(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, i = len(self.ranks), self.interleave
        return (pos // i) % n, (pos // (i * n)) * i + pos % i

    def write(self, layer: int, pos: int, latent: torch.Tensor, rope: torch.Tensor, key: torch.Tensor | None) -> None:
        owner, local = (int(v) for v in self._split(torch.tensor(pos)))
        self.ranks[owner].write(layer, local, latent, rope, key)

    def _gather(self, pos: torch.Tensor, read: Callable[[PagedCache, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        owner, local = self._split(pos)
        parts = {r: read(cache, local[owner == r]) for r, cache in enumerate(self.ranks) if bool((owner == r).any())}
        first = next(iter(parts.values()))
        out = torch.empty((pos.numel(), *first.shape[1:]), dtype=first.dtype)
        for r, rows in parts.items():
            out[owner == r] = rows
        return out

    def read_main(self, layer: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = self._gather(pos, lambda cache, p: torch.cat(cache.read_main(layer, p), dim=1))
        return both[:, :LATENT], both[:, LATENT:]

    def read_keys(self, layer: int, pos: torch.Tensor) -> torch.Tensor:
        return self._gather(pos, lambda cache, p: cache.read_keys(layer, p))


class TinyDsa:
    """``num_layers`` target layers (full ones own an indexer) plus one MTP layer, random fixed weights."""

    def __init__(self, num_layers: int, full_layers: list[int], *, seed: int = 0, topk: int = 16, dense: bool = False):
        g = torch.Generator().manual_seed(seed)
        hidden, self.heads, vocab = 64, 2, 256

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        self.num_layers, self.full, self.topk, self.dense = num_layers, set(full_layers), topk, dense
        self.embed, self.lm_head = w(vocab, hidden) * 8, w(hidden, vocab)
        layers = [*range(num_layers), num_layers]  # the MTP layer last; it always owns an indexer
        self.w = {
            lay: {
                "kv": w(hidden, LATENT + ROPE),
                "q": w(hidden, self.heads * (LATENT + ROPE)),
                "o": w(self.heads * LATENT, hidden),
                "up": w(hidden, 4 * hidden),
                "down": w(4 * hidden, hidden),
                "ik": w(hidden, INDEX_DIM),
                "iq": w(hidden, INDEX_DIM),
            }
            for lay in layers
        }

    def _layer(self, lay: int, x: torch.Tensor, pos: int, cache: PagedCache, sel: torch.Tensor | None):
        w = self.w[lay]
        kv = x @ w["kv"]
        full = lay in self.full or lay == self.num_layers
        cache.write(lay, pos, kv[:LATENT], kv[LATENT:], x @ w["ik"] if full else None)
        seen = torch.arange(pos + 1)
        if full:
            scores = cache.read_keys(lay, seen) @ (x @ w["iq"])
            k = pos + 1 if self.dense else min(self.topk, pos + 1)
            sel = torch.sort(torch.topk(scores, k).indices).values
        latent, rope = cache.read_main(lay, sel)  # type: ignore[arg-type]
        q = (x @ w["q"]).view(self.heads, LATENT + ROPE)
        att = torch.softmax((q[:, :LATENT] @ latent.T + q[:, LATENT:] @ rope.T) / (LATENT + ROPE) ** 0.5, dim=-1)
        x = x + (att @ latent).reshape(-1) @ w["o"]
        x = x + torch.tanh(x @ w["up"]) @ w["down"]
        return x / (x.norm() + 1e-6) * x.numel() ** 0.5, sel

    def step(self, token: int, pos: int, cache: PagedCache) -> torch.Tensor:
        """Write every layer's cache rows for ``pos`` and return the logits for the next token."""
        x, sel = self.embed[token], None
        for lay in range(self.num_layers):
            x, sel = self._layer(lay, x, pos, cache, sel)
        y, _ = self._layer(self.num_layers, x, pos, cache, None)
        return x @ self.lm_head + 0.5 * (y @ self.lm_head)

    def prefill(self, tokens: list[int], cache: PagedCache, start: int = 0, end: int | None = None) -> int:
        """Compute positions ``start..end``; the greedy next token after ``end`` (prefill's first output)."""
        logits = None
        for pos in range(start, len(tokens) if end is None else end):
            logits = self.step(tokens[pos], pos, cache)
        return int(torch.argmax(logits))  # type: ignore[arg-type]

    def decode(self, first: int, num_prompt: int, cache: PagedCache, steps: int) -> list[int]:
        """Greedy decode from prefill's first token, reading every prompt position from the cache."""
        out = [first]
        for i in range(steps - 1):
            out.append(int(torch.argmax(self.step(out[-1], num_prompt + i, cache))))
        return out

    def generate(
        self, tokens: list[int], page_tokens: int, steps: int, *, on_cache: Callable | None = None
    ) -> list[int]:
        """The monolithic reference: one process, one paged cache."""
        pages = -(-(len(tokens) + steps) // page_tokens)
        cache = scratch_cache(self, pages, page_tokens)
        out = self.decode(self.prefill(tokens, cache), len(tokens), cache, steps)
        if on_cache is not None:
            on_cache(cache)
        return out


def scratch_cache(model: TinyDsa, pages: int, page_tokens: int) -> PagedCache:
    layers = [*range(model.num_layers), model.num_layers]
    main = {lay: torch.zeros(pages, page_tokens * ROW, dtype=torch.uint8) for lay in layers}
    index = {
        lay: torch.zeros(pages, page_tokens * INDEX_ROW, dtype=torch.uint8)
        for lay in layers
        if lay in model.full or lay == model.num_layers
    }
    return PagedCache(main, index, np.arange(pages), page_tokens)


def prompts(count: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=lengths[i % len(lengths)]).tolist() for i in range(count)]

"""How one side's ranks split a request's caches, and which rank of the other side serves each piece.

The MLA main KV and the indexer keys have one head, so TP alone replicates them on every rank. Context
parallelism shards them instead, in two ways the engines use:
- **token shards** (vLLM DCP, and PCP times DCP): token ``t`` lives on shard ``(t // I) % N`` at local slot
  ``(t // (I·N))·I + t % I``; a rank's shard is ``tp_rank % N``, so every N consecutive TP ranks hold one copy.
  With ``I`` dividing the page, page ``j`` of the request's (shared) page table holds, on each shard, that
  shard's tokens of global tokens ``[j·P·N, (j+1)·P·N)``: one page-table entry spans ``P·N`` tokens.
- **layer shards** (SGLang CP layer split): each rank holds every token of the layers it owns, none of the others;
  ranks ``[s·T/S, (s+1)·T/S)`` form shard ``s``.

Which prefill rank serves which piece of a decode rank is ``tp``'s business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np

from glm_pd_common.errors import ConfigError


class Sharding(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a side's ranks split every request's caches (all 1: each rank holds one whole copy)."""

    token_shards: int = 1  # N: ranks one copy of a request's tokens is spread over
    interleave: int = 1  # I: consecutive tokens per shard turn (vLLM ``cp_kv_cache_interleave_size``)
    layer_shards: int = 1  # ranks the layers are split over (SGLang CP layer split)


REPLICATED = Sharding()


def describe(sharding: Sharding) -> str:
    if sharding.layer_shards > 1:
        return f"layers split over {sharding.layer_shards} ranks"
    if sharding.token_shards > 1:
        return f"tokens sharded over {sharding.token_shards} ranks, {sharding.interleave} per turn"
    return "caches replicated on every rank"


@dataclass(frozen=True)
class TokenShard:
    """One rank's share of a request's tokens: shard ``index`` of ``count``, ``interleave`` tokens per turn."""

    count: int = 1
    index: int = 0
    interleave: int = 1

    def owns(self, tokens: np.ndarray) -> np.ndarray:
        if self.count == 1:
            return np.ones(tokens.shape, dtype=bool)
        return (tokens // self.interleave) % self.count == self.index

    def local(self, tokens: np.ndarray) -> np.ndarray:
        """Each (owned) token's slot among this shard's tokens."""
        if self.count == 1:
            return tokens
        i = self.interleave
        return (tokens // (i * self.count)) * i + tokens % i

    def table_tokens(self, page_tokens: int) -> int:
        """Global tokens one entry of the request's page table spans."""
        return page_tokens * self.count

    def grain(self) -> int | None:
        """Tokens that always stay together on this shard (None: all of them)."""
        return self.interleave if self.count > 1 else None


WHOLE = TokenShard()


def check_sharding(sharding: Sharding, *, tp_size: int, page_tokens: int, side: str) -> None:
    """A sharding the plan can convert from or to, or a ConfigError naming the field and its value."""
    n, i, lay = sharding.token_shards, sharding.interleave, sharding.layer_shards
    if n < 1 or tp_size % n:
        raise ConfigError(f"{side} token_shards {n} must divide its TP size {tp_size}")
    if lay < 1 or tp_size % lay:
        raise ConfigError(f"{side} layer_shards {lay} must divide its TP size {tp_size}")
    if n > 1 and lay > 1:
        raise ConfigError(f"{side} shards both tokens ({n}) and layers ({lay}); glm-pd moves one kind at a time")
    if i < 1 or (n > 1 and page_tokens % i):
        raise ConfigError(f"{side} interleave {i} must divide its page of {page_tokens} tokens")


def token_shard(rank: int, sharding: Sharding) -> TokenShard:
    n = sharding.token_shards
    return TokenShard(n, rank % n, sharding.interleave) if n > 1 else WHOLE


def layer_shard(rank: int, sharding: Sharding, tp_size: int) -> int:
    """A rank's layer shard: SGLang puts CP outside attention TP, so consecutive ranks share a shard."""
    return rank // (tp_size // sharding.layer_shards)


def owned_layers(num_layers: int, num_mtp: int, sharding: Sharding, rank: int, tp_size: int) -> tuple[int, ...]:
    """The cache layers a rank holds (and serves): every layer, or under a layer split SGLang's contiguous
    share of the target layers (the first ``L % S`` shards take one more); the MTP layers are served by the
    last shard (SGLang's drafter keeps a whole cache on every rank, and only the last CP rank sends it)."""
    mtp = tuple(range(num_layers, num_layers + num_mtp))
    count = sharding.layer_shards
    if count == 1:
        return tuple(range(num_layers)) + mtp
    shard = layer_shard(rank, sharding, tp_size)
    base, extra = divmod(num_layers, count)
    start = shard * base + min(shard, extra)
    end = start + base + (1 if shard < extra else 0)
    return tuple(range(start, end)) + (mtp if shard == count - 1 else ())


def overlaps(src: TokenShard, dst: TokenShard) -> bool:
    """Whether any token lives on both shards (both patterns repeat every lcm of their periods)."""
    period = math.lcm(src.interleave * src.count, dst.interleave * dst.count)
    tokens = np.arange(period, dtype=np.int64)
    return bool(np.any(src.owns(tokens) & dst.owns(tokens)))

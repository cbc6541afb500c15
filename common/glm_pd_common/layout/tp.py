"""Which prefill rank serves which piece of a decode rank's caches, and who confirms to whom.

The MLA main KV holds one latent "head" shared by every query head, and the lightning indexer holds one
key head; without context parallelism every attention-TP rank keeps an identical, whole copy of both.
Slicing them by head would be meaningless (there is one head), and reading from several prefill ranks
would move the same bytes N times. So a decode rank reads each piece it holds (its token shard of every
layer it holds, see ``shards``) from exactly one prefill rank holding it, and the decode ranks are spread
evenly over the prefill copies (contiguous groups, as SGLang pairs MLA ranks). Both sides compute this
from the same two shapes, so prefill plans, and expects releases for, exactly what decode claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.shards import Sharding, TokenShard, overlaps, owned_layers, token_shard

SUPPORTED_TP = (1, 2, 4, 8, 16)


class RankShape(Protocol):
    """What pairing needs of a side's shape (a peer's ``PeerShape``, a request's ``RemotePrefill``)."""

    @property
    def tp_size(self) -> int: ...

    @property
    def sharding(self) -> Sharding: ...


@dataclass(frozen=True)
class SideLayout:
    """One side's ranks as the pairing sees them."""

    tp_size: int
    sharding: Sharding
    num_layers: int  # the model's target layers
    num_mtp: int  # its MTP layers (cache layers num_layers ..)

    def __post_init__(self) -> None:
        if self.tp_size not in SUPPORTED_TP:
            raise ConfigError(f"tp_size must be one of {SUPPORTED_TP}, got {self.tp_size!r}")

    @classmethod
    def of(cls, tp_size: int, sharding: Sharding, geometry: ModelGeometry) -> SideLayout:
        return cls(tp_size, sharding, geometry.num_layers, geometry.num_mtp_layers)

    @classmethod
    def of_shape(cls, shape: RankShape, geometry: ModelGeometry) -> SideLayout:
        return cls.of(shape.tp_size, shape.sharding, geometry)

    def layers(self, rank: int) -> tuple[int, ...]:
        """The cache layers ``rank`` holds."""
        return owned_layers(self.num_layers, self.num_mtp, self.sharding, rank, self.tp_size)

    def holders(self, layer: int, shard: int) -> list[int]:
        """Ranks holding ``layer`` and token shard ``shard``, in rank order."""
        n = self.sharding.token_shards
        return [r for r in range(self.tp_size) if r % n == shard and layer in self.layers(r)]


@dataclass(frozen=True)
class Source:
    """One prefill rank a decode rank reads from: which of its layers, and the token shard it holds."""

    rank: int
    layers: tuple[int, ...]
    shard: TokenShard


@lru_cache(maxsize=1024)
def sources(decode_rank: int, prefill: SideLayout, decode: SideLayout) -> tuple[Source, ...]:
    """The prefill ranks ``decode_rank`` reads, each with its layers, in rank order.

    For every prefill token shard that shares tokens with this decode rank, and every layer it holds, the
    holders of that piece are spread over the decode ranks contiguously (decode rank d of D takes holder
    ``d·H // D``), so with replicated caches every prefill copy serves an equal share of decode ranks.
    """
    if not 0 <= decode_rank < decode.tp_size:
        raise ConfigError(f"decode_rank {decode_rank} is outside 0..{decode.tp_size - 1}")
    mine = token_shard(decode_rank, decode.sharding)
    picked: dict[int, list[int]] = {}
    for shard in range(prefill.sharding.token_shards):
        if not overlaps(token_shard(shard, prefill.sharding), mine):
            continue
        for layer in decode.layers(decode_rank):
            holders = prefill.holders(layer, shard)
            if not holders:
                raise ConfigError(f"no prefill rank holds layer {layer} (token shard {shard})")
            picked.setdefault(holders[decode_rank * len(holders) // decode.tp_size], []).append(layer)
    return tuple(
        Source(rank, tuple(layers), token_shard(rank, prefill.sharding)) for rank, layers in sorted(picked.items())
    )


def source_for(prefill_rank: int, decode_rank: int, prefill: SideLayout, decode: SideLayout) -> Source | None:
    """What ``decode_rank`` reads from ``prefill_rank`` (None: nothing)."""
    return next((s for s in sources(decode_rank, prefill, decode) if s.rank == prefill_rank), None)


@lru_cache(maxsize=1024)
def release_set(decode_rank: int, prefill: SideLayout, decode: SideLayout) -> tuple[int, ...]:
    """Prefill ranks ``decode_rank`` confirms to: its sources, then the prefill ranks nobody reads (they hold
    the request's pages too and free them only on a release), each given to one decode rank contiguously."""
    used = {s.rank for d in range(decode.tp_size) for s in sources(d, prefill, decode)}
    mine = [s.rank for s in sources(decode_rank, prefill, decode)]
    idle = [r for r in range(prefill.tp_size) if r not in used and r * decode.tp_size // prefill.tp_size == decode_rank]
    return tuple(mine + idle)


def expected_releases(prefill_rank: int, prefill: SideLayout, decode: SideLayout) -> int:
    """How many decode ranks confirm a lease held by ``prefill_rank`` before it may free the pages."""
    if not 0 <= prefill_rank < prefill.tp_size:
        raise ConfigError(f"prefill_rank {prefill_rank} is outside 0..{prefill.tp_size - 1}")
    return sum(prefill_rank in release_set(d, prefill, decode) for d in range(decode.tp_size))

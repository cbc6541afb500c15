"""SGLang's prefill context parallelism as glm-pd's pairing sees it: which prefill rank serves which layers.

SGLang numbers a prefill instance's attention ranks ``tp_rank = (dp·cp + cp_rank)·attn_tp + attn_tp_rank``;
within one attention-DP group glm-pd calls rank ``cp_rank·attn_tp + attn_tp_rank`` of ``T = cp·attn_tp``.
- ``--enable-dsa-cache-layer-split``: CP rank ``s`` holds layer shard ``s`` (every token of SGLang's
  contiguous share of the target layers; the last shard also the MTP layers), so a decode rank reads every
  layer shard from one of its ``attn_tp`` holders: T ranks with ``Sharding(layer_shards=cp)``. SGLang's
  decode pulls from every CP rank for it and waits for ``cp`` responses, which is the same pairing.
- CP without layer split: every CP rank holds every layer and token, but SGLang's decode talks to CP rank 0
  only (the other CP ranks are its dummies, reporting Success to nobody), so the copies decode can read are
  CP rank 0's ``attn_tp`` ranks: those are the ranks the pairing spreads decode over.
Both sides derive the layout from the same facts (prefill from its own ranks, decode from the bootstrap
server's ``/route``), so prefill plans exactly the layers decode expects from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.shards import REPLICATED, Sharding
from glm_pd_common.layout.tp import SideLayout, sources


@dataclass(frozen=True)
class AttentionRanks:
    """One instance's attention ranks (one DP group; decode has no CP, SGLang asserts it)."""

    attn_tp_size: int
    attn_cp_size: int = 1
    layer_split: bool = False

    @property
    def splits_layers(self) -> bool:
        return self.layer_split and self.attn_cp_size > 1

    @property
    def sharding(self) -> Sharding:
        """What every rank holds: a layer shard under layer split, else a whole copy."""
        return Sharding(layer_shards=self.attn_cp_size) if self.splits_layers else REPLICATED

    @property
    def num_ranks(self) -> int:
        return self.attn_tp_size * self.attn_cp_size

    def rank(self, cp_rank: int, tp_rank: int) -> int:
        """glm-pd's index of a prefill rank among all T of its DP group."""
        return cp_rank * self.attn_tp_size + tp_rank

    def layout(self, geometry: ModelGeometry) -> SideLayout:
        """The prefill ranks decode ranks are paired with (see the module docstring)."""
        if self.splits_layers:
            return SideLayout.of(self.num_ranks, self.sharding, geometry)
        return SideLayout.of(self.attn_tp_size, REPLICATED, geometry)

    def pairing_rank(self, cp_rank: int, tp_rank: int) -> int | None:
        """A rank's index in ``layout`` (None: a CP rank SGLang's decode never reads from)."""
        if self.splits_layers:
            return self.rank(cp_rank, tp_rank)
        return tp_rank if cp_rank == 0 else None


def refuse_unsupported(parallel: Any, all_cp_ranks_transfer: bool) -> None:
    """Refuse the context-parallel modes glm-pd does not move, naming the option and why."""
    if getattr(parallel, "enable_kv_cache_sharding", False):
        raise ConfigError(
            "glm-pd does not support --enable-kv-cache-sharding yet: each rank keeps only its logical pages "
            "(page l on rank l % N) in a compacted local pool whose page table differs per rank, while glm-pd "
            "pairs decode's page ids with one page table shared by every prefill rank"
        )
    if all_cp_ranks_transfer and not getattr(parallel, "enable_dsa_cache_layer_split", False):
        raise ConfigError(
            "glm-pd does not support SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER: it splits each request's "
            "pages over the CP ranks while glm-pd's pairing reads a whole copy from one rank (unset it)"
        )


def check_routing(info: Any, decode_rank: int, decode_tp: int, geometry: ModelGeometry) -> None:
    """SGLang's rank mapping (``_resolve_rank_mapping``) must read from exactly the prefill ranks glm-pd's
    pairing picks, or a layer would be read from a rank that lacks it (or from no rank at all)."""
    if getattr(info, "enable_kv_cache_sharding", False):
        raise ConfigError("the prefill runs --enable-kv-cache-sharding, which glm-pd does not support yet")
    if int(info.pp_size) != 1:
        raise ConfigError(f"glm-pd does not support pipeline parallelism on prefill (pp_size {info.pp_size})")
    ranks = AttentionRanks(int(info.attn_tp_size), int(info.attn_cp_size), bool(info.enable_dsa_cache_layer_split))
    decode = SideLayout.of(decode_tp, REPLICATED, geometry)
    ours = sorted(s.rank for s in sources(decode_rank, ranks.layout(geometry), decode))
    picked = [ranks.pairing_rank(cp, int(info.target_tp_rank)) for cp in info.target_cp_ranks]
    theirs = sorted(r for r in picked if r is not None)
    if ours != theirs or int(info.required_prefill_response_num) != len(ours):
        raise ConfigError(
            f"SGLang pairs decode rank {decode_rank}/{decode_tp} with prefill ranks {theirs} (CP ranks "
            f"{list(info.target_cp_ranks)}, TP rank {info.target_tp_rank}, {info.required_prefill_response_num} "
            f"responses), but glm-pd's pairing reads its layers from {ours} (prefill attn_tp "
            f"{ranks.attn_tp_size}, attn_cp {ranks.attn_cp_size}, layer split {ranks.layer_split})"
        )

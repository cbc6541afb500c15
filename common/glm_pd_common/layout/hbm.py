"""Whether one request fits a rank's GPU memory: weights, the request's KV per rank, and what is left for it.

The engines hand the KV cache what ``gpu_memory_utilization`` leaves after weights and activations, and an MLA
cache is replicated on every TP rank unless it is sharded by context parallelism (vLLM ``-dcp N``, SGLang CP):
then each rank holds every N-th token. The account is in decimal GB, as GPU and checkpoint sizes are quoted.
Weights are the checkpoint's bytes split evenly over TP (expert and data parallelism shard them differently:
pass ``weights_per_rank_bytes`` then).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.shards import Sharding, owned_layers
from glm_pd_common.layout.spec import CacheSpec

GB = 1e9
GPU_HBM_GB = {"h100": 80.0, "h200": 141.0, "b200": 180.0}  # per GPU, as the vendor quotes it
# GLM-5.x FP8 checkpoints (GLM-5.3-FP8: ~89 GB per GPU at TP 8); a --config folder's safetensors index wins
PRESET_WEIGHTS_BYTES = {"glm-5": 712e9, "glm-5.1": 712e9, "glm-5.2": 712e9, "glm-5.3": 712e9}


@dataclass(frozen=True)
class HbmInputs:
    kv_bytes_per_token: int  # one rank's whole copy: main + indexer, MTP layers included
    num_tokens: int
    tp: int
    hbm_bytes: float
    utilization: float
    weights_per_rank_bytes: float
    reserve_bytes: float  # activations, CUDA graphs, the engine's workspace: what profiling would take
    # glm-pd's staging buffer, allocated after the engine sized its KV cache: it comes out of the headroom the
    # engine leaves (1 - utilization), never out of the KV cache
    staging_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.utilization <= 1:
            raise ConfigError(f"gpu memory utilization must be in (0, 1], got {self.utilization}")
        if self.tp <= 0 or self.hbm_bytes <= 0 or min(self.weights_per_rank_bytes, self.reserve_bytes) < 0:
            raise ConfigError("tp and HBM must be positive, weights and reserve not negative")
        if self.staging_bytes < 0:
            raise ConfigError(f"staging bytes must not be negative, got {self.staging_bytes}")


def kv_bytes_per_token(spec: CacheSpec, sharding: Sharding | None, tp: int) -> int:
    """Cache bytes per token on the busiest rank (main and indexer, MTP layers included): every layer, or
    under a layer split the largest share of target layers any rank owns, plus the MTP layers."""
    g = spec.geometry
    per_layer = {
        lay: spec.row.row_bytes + (spec.indexer.row_bytes if lay in g.indexer_layers else 0) for lay in g.all_layers
    }
    if sharding is None or sharding.layer_shards == 1:
        return sum(per_layer.values())
    # SGLang's drafter keeps its whole cache on every rank: the MTP layers count everywhere
    held = (set(owned_layers(g.num_layers, g.num_mtp_layers, sharding, r, tp)) | set(g.mtp_layers) for r in range(tp))
    return max(sum(per_layer[lay] for lay in layers) for layers in held)


def tokens_per_rank(num_tokens: int, shards: int) -> int:
    """Tokens the busiest rank holds when ``shards`` ranks interleave them."""
    return -(-num_tokens // shards)


def kv_free_bytes(inputs: HbmInputs) -> float:
    return inputs.utilization * inputs.hbm_bytes - inputs.weights_per_rank_bytes - inputs.reserve_bytes


def min_shards(inputs: HbmInputs) -> int | None:
    """The fewest context-parallel ranks (a divisor of TP, as both engines require) whose share of the
    request fits; None when even TP-way sharding does not."""
    free = kv_free_bytes(inputs)
    for shards in (d for d in range(1, inputs.tp + 1) if inputs.tp % d == 0):
        if tokens_per_rank(inputs.num_tokens, shards) * inputs.kv_bytes_per_token <= free:
            return shards
    return None


def hbm_account(inputs: HbmInputs, shards: int) -> dict[str, object]:
    """One side's account for a layout with ``shards`` context-parallel ranks (1: replicated)."""
    if shards <= 0 or inputs.tp % shards:
        raise ConfigError(f"context parallel size {shards} must divide TP {inputs.tp}")
    free = kv_free_bytes(inputs)
    kv = tokens_per_rank(inputs.num_tokens, shards) * inputs.kv_bytes_per_token
    headroom = (1 - inputs.utilization) * inputs.hbm_bytes
    return {
        "hbm_bytes": inputs.hbm_bytes,
        "utilization": inputs.utilization,
        "weights_per_rank_bytes": inputs.weights_per_rank_bytes,
        "reserve_bytes": inputs.reserve_bytes,
        "kv_free_bytes": free,
        "context_parallel": shards,
        "kv_per_rank_bytes": kv,
        "fits": kv <= free,
        "min_context_parallel": min_shards(inputs),
        "staging_bytes": inputs.staging_bytes,
        "headroom_bytes": headroom,
        "staging_fits": inputs.staging_bytes <= headroom,
    }


def checkpoint_bytes(config_path: str | None, preset: str | None) -> float | None:
    """The checkpoint's size: ``metadata.total_size`` of the safetensors index beside a config, else the
    preset's; None when neither is known (then it must be given)."""
    if config_path:
        folder = Path(config_path)
        folder = folder if folder.is_dir() else folder.parent
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if isinstance(total, int) and total > 0:
                return float(total)
        return None
    return PRESET_WEIGHTS_BYTES.get(preset or "")

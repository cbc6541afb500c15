"""Model geometry: which layers carry which cache, read from an HF ``config.json``.

The full-indexer layer set decides which indexer regions exist. The engines read it from different
config fields (transformers and SGLang: ``indexer_types`` first, then ``index_topk_pattern``, then
``index_topk_freq``/``index_skip_topk_offset``; vLLM never reads ``indexer_types``), so glm-pd derives the
set by every rule present and refuses a config on which the engines would disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm_pd_common.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32", "deepseek_v2", "deepseek_v3")
# Dense MLA: the same latent cache rows, no lightning indexer (the engines run these on CPU, DSA they do not).
DENSE_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
VLLM_DEFAULT_SKIP_OFFSET = 2  # vLLM's value when index_skip_topk_offset is absent

_RULE_READERS = {
    "indexer_types": "read by transformers and SGLang (first); ignored by vLLM",
    "index_topk_pattern": "read by vLLM (first), by transformers and SGLang after indexer_types",
    "index_topk_freq": "read by every engine when no earlier rule is present",
    "vllm_default": "vLLM's reading when neither index_topk_pattern nor index_topk_freq is present: all full",
}


@dataclass(frozen=True)
class ModelGeometry:
    """Cache-relevant geometry of one DSA model; layer ids are global (MTP ids follow the target's)."""

    model_type: str
    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    num_mtp_layers: int
    full_indexer_layers: tuple[int, ...]
    revision: str | None = None

    @property
    def mtp_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers, self.num_layers + self.num_mtp_layers))

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Every layer that owns an indexer cache: the target's full layers, then every MTP layer (DSA only)."""
        if self.model_type in DENSE_MLA_MODEL_TYPES:
            return ()
        return self.full_indexer_layers + self.mtp_layers

    @property
    def all_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers + self.num_mtp_layers))

    def is_full(self, layer_id: int) -> bool:
        return layer_id in self.indexer_layers

    @classmethod
    def from_config(cls, config: dict[str, Any] | str | Path, *, include_mtp: bool = True) -> ModelGeometry:
        """Parse an HF config (a dict or a path to ``config.json`` or its folder)."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                config = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read model config {path}: {exc}") from exc
            if not isinstance(config, dict):
                raise ConfigError(f"model config {path} is not a JSON object")
        return _parse(config, include_mtp=include_mtp)

    @classmethod
    def preset(cls, name: str) -> ModelGeometry:
        try:
            config = PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
        return _parse(config, include_mtp=True)


def _int_field(config: dict[str, Any], name: str, *, minimum: int = 1) -> int:
    if name not in config:
        raise ConfigError(f"model config lacks required field {name!r}")
    value = config[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"model config field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse(config: dict[str, Any], *, include_mtp: bool) -> ModelGeometry:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model config field 'model_type' is {model_type!r}; glm-pd supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    num_layers = _int_field(config, "num_hidden_layers")
    num_mtp = _int_field(config, "num_nextn_predict_layers", minimum=0) if "num_nextn_predict_layers" in config else 0
    revision = config.get("_commit_hash") or config.get("revision")
    dense = model_type in DENSE_MLA_MODEL_TYPES
    return ModelGeometry(
        model_type=model_type,
        num_layers=num_layers,
        kv_lora_rank=_int_field(config, "kv_lora_rank"),
        qk_rope_head_dim=_int_field(config, "qk_rope_head_dim"),
        index_head_dim=128 if dense else _int_field(config, "index_head_dim"),
        num_mtp_layers=num_mtp if include_mtp else 0,
        full_indexer_layers=() if dense else full_indexer_layers(config, num_layers),
        revision=revision if isinstance(revision, str) else None,
    )


def full_indexer_layers(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The target layers that own an indexer, agreed by every rule present (and by vLLM's reading)."""
    rules: dict[str, frozenset[int]] = {}
    if config.get("indexer_types") is not None:
        rules["indexer_types"] = _from_types(config["indexer_types"], num_layers)
    if config.get("index_topk_pattern") is not None:
        rules["index_topk_pattern"] = _from_pattern(config["index_topk_pattern"], num_layers)
    if config.get("index_topk_freq") is not None:
        rules["index_topk_freq"] = _from_freq(config, num_layers)
    everything = frozenset(range(num_layers))
    if "index_topk_pattern" not in rules and "index_topk_freq" not in rules:
        rules["vllm_default"] = everything
    names = list(rules)
    first = rules[names[0]]
    for name in names[1:]:
        if rules[name] != first:
            differ = sorted(first ^ rules[name])
            raise ConfigError(
                f"indexer layer rules disagree: {names[0]} and {name} differ on layers {differ} "
                f"({names[0]}: {_RULE_READERS[names[0]]}; {name}: {_RULE_READERS[name]}). "
                "Engines reading different rules would place the indexer differently; fix the config."
            )
    return tuple(sorted(first))


def _from_types(types: object, num_layers: int) -> frozenset[int]:
    if not isinstance(types, list) or len(types) != num_layers:
        got = len(types) if isinstance(types, list) else type(types).__name__
        raise ConfigError(f"model config field 'indexer_types' must list {num_layers} entries, got {got}")
    bad = [t for t in types if t not in ("full", "shared")]
    if bad:
        raise ConfigError(f"model config field 'indexer_types' holds {bad[0]!r}; entries are 'full' or 'shared'")
    return frozenset(i for i, t in enumerate(types) if t == "full")


def _from_pattern(pattern: object, num_layers: int) -> frozenset[int]:
    if isinstance(pattern, str):
        marks = list(pattern)
    elif isinstance(pattern, list):
        marks = pattern
    else:
        raise ConfigError(f"model config field 'index_topk_pattern' must be a string or list, got {pattern!r}")
    if len(marks) != num_layers:
        raise ConfigError(
            f"model config field 'index_topk_pattern' has length {len(marks)}, num_hidden_layers is {num_layers}"
        )
    bad = [m for m in marks if not isinstance(m, str) or m.upper() not in ("F", "S")]
    if bad:
        raise ConfigError(f"model config field 'index_topk_pattern' holds {bad[0]!r}; entries are 'F' or 'S'")
    return frozenset(i for i, m in enumerate(marks) if m.upper() == "F")


def _from_freq(config: dict[str, Any], num_layers: int) -> frozenset[int]:
    freq = _int_field(config, "index_topk_freq")
    offset = VLLM_DEFAULT_SKIP_OFFSET
    if config.get("index_skip_topk_offset") is not None:
        offset = _int_field(config, "index_skip_topk_offset")
    return frozenset(i for i in range(num_layers) if max(i - offset + 1, 0) % freq == 0)


def _glm5_config(max_position: int, sparse_rule: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 78,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
        "index_n_heads": 32,
        "index_topk": 2048,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": max_position,
        **sparse_rule,
    }


def _glm52_rule() -> dict[str, Any]:
    freq, offset = 4, 3
    types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(78)]
    return {
        "index_topk_freq": freq,
        "index_skip_topk_offset": offset,
        "index_topk_pattern": None,
        "indexer_types": types,
    }


# Public facts of each model's config.json, reduced to what the cache layout depends on.
PRESETS: dict[str, dict[str, Any]] = {
    "glm-5": _glm5_config(202_752, {}),
    "glm-5.1": _glm5_config(202_752, {}),
    "glm-5.2": _glm5_config(1_048_576, _glm52_rule()),
    "glm-5.3": _glm5_config(1_048_576, _glm52_rule()),
    "deepseek-v3.2": {
        "model_type": "deepseek_v32",
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 2048,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 163_840,
    },
}

"""``kv_transfer_params``: what prefill returns to the router and decode receives, and its validation.

Decode treats the params as remote input: every field is type-checked and the block count must match
the token count before a load is planned (the core plan then bounds-checks every block id).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import numpy as np
from vllm.config import VllmConfig

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.layout.tp import SUPPORTED_TP
from glm_pd_vllm.config import GlmPdVllmConfig

MAX_BLOCKS = 1 << 22  # 4M blocks of 16 tokens: far past any context; more is hostile
MAX_BLOCK_ID = (1 << 63) - 1  # ids travel as int64; a larger JSON integer would overflow, not be refused
_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}(\.[A-Za-z0-9][A-Za-z0-9_-]{0,62})*\.?")

_VLLM_CACHE_DTYPES = {
    "auto": "bf16",
    "bfloat16": "bf16",
    "fp8": "fp8_ds_mla",
    "fp8_e4m3": "fp8_ds_mla",
    "fp8_ds_mla": "fp8_ds_mla",
}


def cache_spec(vllm_config: VllmConfig, config: GlmPdVllmConfig) -> CacheSpec:
    """The core spec from vLLM's model config (vLLM's DSA backends store fp8 as fp8_ds_mla rows)."""
    hf = vllm_config.model_config.hf_config
    geometry = ModelGeometry.from_config(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))
    if config.model_revision:
        geometry = _with_revision(geometry, config.model_revision)
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype not in _VLLM_CACHE_DTYPES:
        raise ConfigError(f"GlmPdConnector supports kv cache dtypes {sorted(_VLLM_CACHE_DTYPES)}, got {dtype!r}")
    return CacheSpec.create(geometry, _VLLM_CACHE_DTYPES[dtype], config.indexer_scale_format)


def _with_revision(geometry: ModelGeometry, revision: str) -> ModelGeometry:
    from dataclasses import replace

    return replace(geometry, revision=revision)


def _int(params: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"kv_transfer_params[{key!r}] must be an integer >= {minimum}, got {value!r}")
    return value


def _str(params: dict[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ConfigError(f"kv_transfer_params[{key!r}] must be a non-empty string, got {value!r}")
    return value


def _host(params: dict[str, Any], key: str) -> str:
    """An IP address or a DNS name: decode connects there, and zmq refuses anything else with a ZMQError."""
    host = _str(params, key)
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        if not _HOSTNAME.fullmatch(host):
            raise ConfigError(f"kv_transfer_params[{key!r}] is not an IP address or host name, got {host!r}") from None
    return host


def parse_remote(params: dict[str, Any]) -> dict[str, Any]:
    """Validate the params decode got from the router; returns the typed fields. Raises naming the field."""
    if not isinstance(params, dict):
        raise ConfigError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    num_tokens = _int(params, "remote_num_tokens", minimum=1)
    page_tokens = _int(params, "remote_page_tokens", minimum=1)
    blocks = params.get("remote_block_ids")
    if isinstance(blocks, (list, tuple)) and len(blocks) == 1 and isinstance(blocks[0], (list, tuple)):
        blocks = blocks[0]  # vLLM's per-group form: DSA has exactly one group
    if not isinstance(blocks, (list, tuple)) or len(blocks) > MAX_BLOCKS:
        raise ConfigError("kv_transfer_params['remote_block_ids'] must be a list of block ids")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise ConfigError("kv_transfer_params['remote_block_ids'] holds a non-integer block id")
    bad = [b for b in (min(blocks, default=0), max(blocks, default=0)) if not 0 <= b <= MAX_BLOCK_ID]
    if bad:
        raise ConfigError(f"kv_transfer_params['remote_block_ids'] holds block id {bad[0]}, outside 0..{MAX_BLOCK_ID}")
    need = num_pages_for(num_tokens, page_tokens)
    if len(blocks) != need:
        raise ConfigError(
            f"kv_transfer_params: {len(blocks)} remote_block_ids for {num_tokens} tokens in blocks of "
            f"{page_tokens} (need {need})"
        )
    port = _int(params, "remote_port", minimum=1)
    if port > 65535:
        raise ConfigError(f"kv_transfer_params['remote_port'] {port} is not a port")
    tp_size = _int(params, "tp_size", minimum=1)
    if tp_size not in SUPPORTED_TP:
        raise ConfigError(f"kv_transfer_params['tp_size'] must be one of {SUPPORTED_TP}, got {tp_size}")
    return {
        "engine_id": _str(params, "remote_engine_id"),
        "request_id": _str(params, "remote_request_id"),
        "host": _host(params, "remote_host"),
        "port": port,
        "tp_size": tp_size,
        "num_tokens": num_tokens,
        "page_tokens": page_tokens,
        "block_ids": np.asarray(blocks, dtype=np.int64),
        "fingerprint": params.get("fingerprint"),
    }

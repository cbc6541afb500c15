"""Command-line arguments shared by ``glm-pd plan``, ``demo`` and ``doctor``: token counts and the model a rank runs."""

from __future__ import annotations

import argparse

from glm_pd_common.layout.cache_dtypes import DEFAULT_CACHE_DTYPE, ENGINES, row_format_for, row_formats_by_backend
from glm_pd_common.layout.formats import main_row_format
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.spec import CacheSpec

_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def token_count(text: str) -> int:
    """``1M`` = 1,048,576 tokens, ``128k`` = 131,072; plain integers as given."""
    raw = text.strip().lower()
    scale = _SUFFIXES.get(raw[-1:], 1)
    digits = raw[:-1] if scale > 1 else raw
    try:
        value = int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (use e.g. 4096, 128k, 1M)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"token count must not be negative: {text!r}")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--preset", default="glm-5.3", help="named model geometry (default glm-5.3)")
    src.add_argument("--config", help="path to an HF config.json (or its folder) instead of a preset")
    parser.add_argument("--engine", choices=ENGINES, default="vllm", help="whose --kv-cache-dtype names (vllm)")
    parser.add_argument(
        "--kv-cache-dtype",
        help="the engine's own name: vllm auto|bfloat16|fp8|fp8_e4m3|fp8_ds_mla (default fp8), "
        "sglang auto|bf16|bfloat16|fp8_e4m3 (default fp8_e4m3)",
    )
    parser.add_argument("--indexer-scale-format", default="fp32", choices=["fp32", "ue8m0x4"])


def load_geometry(args: argparse.Namespace) -> ModelGeometry:
    return ModelGeometry.from_config(args.config) if args.config else ModelGeometry.preset(args.preset)


def cache_dtype(args: argparse.Namespace) -> str:
    return args.kv_cache_dtype or DEFAULT_CACHE_DTYPE[args.engine]


def main_rows_by_backend(args: argparse.Namespace, geometry: ModelGeometry) -> dict[str, dict[str, object]]:
    """The main rows the engine allocates for the dtype named: its default backend first, then the others."""
    rows = row_formats_by_backend(args.engine, cache_dtype(args))
    return {
        backend or "default": {
            "format": name,
            "row_bytes": main_row_format(name, geometry.kv_lora_rank, geometry.qk_rope_head_dim).row_bytes,
        }
        for backend, name in sorted(rows.items(), key=lambda item: item[0] is not None)
    }


def cache_spec(args: argparse.Namespace) -> CacheSpec:
    """The spec of a rank the engine ``--engine`` runs with ``--kv-cache-dtype`` (its default backend)."""
    row_format = row_format_for(args.engine, cache_dtype(args))
    return CacheSpec.create(load_geometry(args), row_format, args.indexer_scale_format)

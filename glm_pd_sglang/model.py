"""What the backend reads about the model: its geometry from the HF config, the indexer's scale format."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from glm_pd_common.layout.cache_dtypes import indexer_scale_format
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_sglang.config import GlmPdSglangConfig


def model_geometry(server_args: Any, revision: str = "") -> ModelGeometry:
    """The model's geometry from its HF config (a local folder, or what transformers resolves)."""
    path = Path(str(server_args.model_path))
    if path.is_dir():
        geometry = ModelGeometry.from_config(path)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            str(server_args.model_path),
            revision=getattr(server_args, "revision", None),
            trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
        )
        geometry = ModelGeometry.from_config(config.to_dict())
    if revision:
        geometry = replace(geometry, revision=revision)
    return geometry


def scale_format(config: GlmPdSglangConfig, device: str, capability: tuple[int | None, int | None]) -> str:
    """The indexer scale encoding SGLang writes on this rank's device: fp32 on every SM and on CPU (see
    ``cache_dtypes``); a configured SGLANG_GLM_PD_INDEXER_SCALE_FORMAT that contradicts it is refused.

    ``capability`` is the rank's own GPU as SGLang's ``get_device_capability`` reads it, ``(None, None)`` where
    it finds no CUDA device; the device of another rank (or GPU 0) would be the wrong one on a mixed node.
    """
    major, minor = capability
    known = None if major is None or minor is None else (major, minor)
    return indexer_scale_format("sglang", device, known, config.indexer_scale_format)

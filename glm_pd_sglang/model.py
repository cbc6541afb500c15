"""What the backend reads about the model: its geometry from the HF config, the indexer's scale format."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

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


def scale_format(config: GlmPdSglangConfig, device: str) -> str:
    """fp32 power-of-two scales on SM90 and CPU; four UE8M0 bytes on SM100 and newer."""
    if config.indexer_scale_format:
        return config.indexer_scale_format
    if device == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10:
            return "ue8m0x4"
    return "fp32"

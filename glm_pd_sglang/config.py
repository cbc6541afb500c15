"""The backend's settings, read from ``SGLANG_GLM_PD_*`` environment variables (SGLang's way for backends).

Every variable is parsed strictly: an unknown ``SGLANG_GLM_PD_*`` name or a bad value is an error that
names it, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.trust import MAX_CONNECTIONS
from glm_pd_common.layout.formats import INDEXER_SCALE_FORMATS
from glm_pd_common.transport.base import BACKENDS
from glm_pd_common.transport.staging import StageMode, settings_problem

PREFIX = "SGLANG_GLM_PD_"


@dataclass(frozen=True)
class GlmPdSglangConfig:
    """Every ``SGLANG_GLM_PD_<NAME>`` glm-pd reads (see README, "SGLang")."""

    transport: str = "mooncake"  # mooncake | nixl
    allow_tcp: bool = False  # accept a data path without RDMA (refused otherwise)
    timeout_s: float = 60.0  # bound on every transfer wait
    verify_checksums: bool = False  # glm-pd's per-region digests, checked before Success
    indexer_scale_format: str = ""  # empty: from the device; SGLang writes fp32 on every device
    model_revision: str = ""  # checked between peers when both set it
    credential: str = ""  # the deployment's key: a *.key_secret file (`glm-pd keygen`) or env:NAME; needed off loopback
    insecure: bool = False  # run SGLang's disaggregation sockets unauthenticated off loopback
    decode_peers: int = 1024  # prefill: decode ranks registered at once (the least recently used idle one makes way)
    connections: int = MAX_CONNECTIONS  # connections a rank's authenticated socket holds (past it, handshakes fail)
    staging: StageMode = "auto"  # auto (GPU caches, short runs) | always | never: pushes through staging slots
    staging_mib: int = 256  # the staging buffer per rank, allocated at start-up where the rank may stage
    staging_slot_kib: int = 32768  # one slot: what one descriptor moves (a multiple of 4); pairs fill the buffer

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GlmPdSglangConfig:
        env = os.environ if env is None else env
        known = {f.name.upper(): f for f in fields(cls)}
        values: dict[str, Any] = {}  # each parsed to its field's type by _parse
        for key, raw in env.items():
            if not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX) :]
            if name not in known:
                raise ConfigError(f"unknown setting {key}; glm-pd reads {sorted(PREFIX + k for k in known)}")
            values[known[name].name] = _parse(key, raw, type(known[name].default))
        config = cls(**values)
        if config.transport not in BACKENDS:
            raise ConfigError(f"{PREFIX}TRANSPORT must be one of {BACKENDS}, got {config.transport!r}")
        for name in ("decode_peers", "connections"):
            if getattr(config, name) < 1:
                raise ConfigError(f"{PREFIX}{name.upper()} must be at least 1, got {getattr(config, name)}")
        if problem := settings_problem(config.staging, config.staging_mib, config.staging_slot_kib):
            raise ConfigError(f"{PREFIX}STAGING, {PREFIX}STAGING_MIB, {PREFIX}STAGING_SLOT_KIB: {problem}")
        if config.timeout_s <= 0:
            raise ConfigError(f"{PREFIX}TIMEOUT_S must be positive, got {config.timeout_s}")
        if config.indexer_scale_format and config.indexer_scale_format not in INDEXER_SCALE_FORMATS:
            raise ConfigError(
                f"{PREFIX}INDEXER_SCALE_FORMAT must be one of {INDEXER_SCALE_FORMATS}, "
                f"got {config.indexer_scale_format!r}"
            )
        return config


def _parse(key: str, raw: str, kind: type) -> object:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{key} must be a boolean (1/0, true/false), got {raw!r}")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {raw!r}") from None
    return raw.strip()

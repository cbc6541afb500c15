"""``kv_connector_extra_config`` parsed into one frozen object; an unknown key is an error, not ignored."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.prefill.caps import DEFAULT_CAPS, PeerCaps
from glm_pd_common.layout.formats import INDEXER_SCALE_FORMATS
from glm_pd_common.transport.base import BACKENDS
from glm_pd_common.transport.staging import StageMode, settings_problem

HOST_ENV = "GLM_PD_SIDE_CHANNEL_HOST"  # the node's own address, set on each node: overrides side_channel_host


@dataclass(frozen=True)
class GlmPdVllmConfig:
    """Every key glm-pd reads from ``kv_connector_extra_config`` (see README, "vLLM")."""

    side_channel_host: str = "127.0.0.1"  # address this node's ranks bind and publish (or GLM_PD_SIDE_CHANNEL_HOST)
    side_channel_port: int = 5710  # base port; TP rank r listens on base + r
    transport: str = "nixl"  # nixl | mooncake
    allow_tcp: bool = False  # accept a data path without RDMA (refused otherwise)
    lease_s: float = 30.0  # prefill holds finished blocks this long for decode's claim
    timeout_s: float = 60.0  # bound on every handshake, claim and transfer wait
    verify_checksums: bool = False  # per-region digests compared before a load counts
    indexer_scale_format: str = ""  # empty: what vLLM writes on the device; fp32 (SM90, CPU) | ue8m0x4 (SM10x)
    model_revision: str = ""  # checked between peers when both set it
    streamed: bool = False  # prefill announces each step's blocks; decode reads while prefill runs (README)
    idle_wait_s: float = 2.0  # decode: a step with no tokens waits up to this for a load to end (0: never; README)
    staging: StageMode = "auto"  # auto (GPU caches, short runs) | always | never: runs moved through staging slots
    staging_mib: int = 256  # the staging buffer per rank (allocated at start-up where this rank may stage)
    staging_slot_kib: int = 32768  # one slot: what one descriptor moves (a multiple of 4); pairs fill the buffer
    credential: str = ""  # the deployment's key: a *.key_secret file (`glm-pd keygen`) or env:NAME; needed off loopback
    insecure: bool = False  # run the side channel unauthenticated off loopback (anyone reaching it can touch the KV)
    caps: PeerCaps = DEFAULT_CAPS  # what decode peers can make prefill hold (an object of PeerCaps' fields)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, env: Mapping[str, str] | None = None) -> GlmPdVllmConfig:
        """The config from ``extra``; a node's ``GLM_PD_SIDE_CHANNEL_HOST`` names its own address (the ranks of an
        instance spanning nodes share one ``--kv-transfer-config`` but not one address)."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown key(s) {unknown}; GlmPdConnector reads {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = type(known[name].default)
            if kind is PeerCaps:
                if not isinstance(value, dict):
                    raise ConfigError(f"kv_connector_extra_config['caps'] must be an object, got {value!r}")
                values[name] = PeerCaps.from_settings(value, "kv_connector_extra_config['caps']")
                continue
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"kv_connector_extra_config[{name!r}] must be {kind.__name__}, got {value!r}")
            values[name] = value
        config = cls(**values)
        host = (os.environ if env is None else env).get(HOST_ENV, "").strip()
        if host:
            config = replace(config, side_channel_host=host)
        if config.transport not in BACKENDS:
            raise ConfigError(
                f"kv_connector_extra_config['transport'] must be one of {BACKENDS}, got {config.transport!r}"
            )
        if config.indexer_scale_format not in ("", *INDEXER_SCALE_FORMATS):
            raise ConfigError(
                f"kv_connector_extra_config['indexer_scale_format'] must be one of {INDEXER_SCALE_FORMATS} "
                f"(or unset: from the device), got {config.indexer_scale_format!r}"
            )
        if config.lease_s <= 0 or config.timeout_s <= 0:
            raise ConfigError("kv_connector_extra_config lease_s and timeout_s must be positive")
        if problem := settings_problem(config.staging, config.staging_mib, config.staging_slot_kib):
            raise ConfigError(f"kv_connector_extra_config staging, staging_mib, staging_slot_kib: {problem}")
        if not config.idle_wait_s >= 0:
            raise ConfigError(f"kv_connector_extra_config['idle_wait_s'] must be 0 or more, got {config.idle_wait_s}")
        if not 0 < config.side_channel_port < 65536:
            raise ConfigError(
                f"kv_connector_extra_config['side_channel_port'] {config.side_channel_port} is not a port"
            )
        return config

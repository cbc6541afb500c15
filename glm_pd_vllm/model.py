"""What vLLM runs, read from its config: the model's cache spec (geometry, the main row for the cache dtype under the
attention backend vLLM chose, the indexer scale format it writes on this device) and how its ranks shard the caches.
"""

from __future__ import annotations

from dataclasses import replace

from vllm.config import VllmConfig

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.cache_dtypes import indexer_scale_format, row_format_for
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.shards import Sharding
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_vllm.caches import MAIN_CACHE
from glm_pd_vllm.config import GlmPdVllmConfig


def cache_spec(vllm_config: VllmConfig, config: GlmPdVllmConfig) -> CacheSpec:
    """The core spec from vLLM's config: the main row for vLLM's cache dtype under the attention backend vLLM
    chose (``cache_dtypes``), the indexer scale format vLLM writes on this device (a configured value must
    agree with it). The worker checks the cache tensors against it when it registers them."""
    hf = vllm_config.model_config.hf_config
    geometry = ModelGeometry.from_config(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))
    if config.model_revision:
        geometry = replace(geometry, revision=config.model_revision)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    backend = attention_backend(vllm_config)
    platform, capability = device_of(vllm_config)
    scale_format = indexer_scale_format("vllm", platform, capability, config.indexer_scale_format)
    where = f"CUDA SM{capability[0]}{capability[1]}" if capability else platform
    origin = f"vLLM cache dtype {cache_dtype!r} under {backend or 'its default backend'} on {where}"
    return CacheSpec.create(geometry, row_format_for("vllm", cache_dtype, backend), scale_format, origin=origin)


def context_parallel(vllm_config: VllmConfig) -> Sharding:
    """How this engine's ranks shard every request's caches: vLLM's decode context parallelism deals tokens
    out to ``dcp`` consecutive TP ranks (``dcp_rank = tp_rank % dcp``), ``cp_kv_cache_interleave_size`` at a
    time. Prefill context parallelism is refused: its ranks are world ranks outside TP (``pcp_rank·TP +
    tp_rank``), which glm-pd's rank pairing and side-channel ports (TP rank r on base + r) do not know."""
    parallel = vllm_config.parallel_config
    pcp = parallel.prefill_context_parallel_size
    if pcp != 1:
        raise ConfigError(
            f"GlmPdConnector does not support prefill_context_parallel_size {pcp} yet: its ranks are world ranks "
            "beyond the TP group (pcp_rank * TP + tp_rank), which glm-pd neither pairs nor gives side-channel "
            "ports; use decode_context_parallel_size (or 1)"
        )
    return Sharding(token_shards=parallel.decode_context_parallel_size, interleave=parallel.cp_kv_cache_interleave_size)


def attention_backend(vllm_config: VllmConfig) -> str | None:
    """The attention backend of the main MLA layers this process built (a worker builds them before its
    connector), else the one selected with ``--attention-backend``; None when neither is known (vLLM's
    engine-core process under a multiprocess executor builds no layers)."""
    layers = vllm_config.compilation_config.static_forward_context
    names = {
        layer.attn_backend.get_name()
        for name, layer in layers.items()
        if MAIN_CACHE.match(name) and getattr(layer, "attn_backend", None) is not None
    }
    if len(names) > 1:
        raise ConfigError(f"the main MLA layers run several attention backends {sorted(names)}; glm-pd needs one")
    if names:
        return names.pop()
    selected = getattr(vllm_config.attention_config, "backend", None)
    return None if selected is None else str(selected.name)


def device_of(vllm_config: VllmConfig) -> tuple[str, tuple[int, int] | None]:
    """The device kind the caches live on (``cuda`` for NVIDIA, ``rocm``, ``cpu``, ...) and the CUDA compute
    capability. It asks vLLM's platform (NVML), as vLLM's own indexer-scale rule does, so the engine-core
    process stays without a CUDA context."""
    from vllm.platforms import current_platform

    kind = str(vllm_config.device_config.device_type)
    if kind == "cuda" and current_platform.is_rocm():
        return "rocm", None
    if kind != "cuda":
        return kind, None
    capability = current_platform.get_device_capability()
    return "cuda", None if capability is None else (capability.major, capability.minor)

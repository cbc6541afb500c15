"""What each engine writes for a GLM-5.x DSA model: the main MLA row per ``--kv-cache-dtype`` name and
attention backend, and the indexer scale encoding per device.

The same word means different rows to different engines and backends (vLLM's ``fp8`` is the 656 B
``fp8_ds_mla`` row under FLASHMLA_SPARSE and the plain 576 B fp8 row under FLASHINFER_MLA_SPARSE; SGLang has
no ``fp8`` at all), so an engine's name is never handed to the layout directly: it goes through this one
table, which both adapters and ``glm-pd plan`` read. The values are glm-pd's row formats
(``formats.ROW_FORMATS``). A key carries the DSA attention backend because the row can depend on it;
``None`` is the engine's default backend, and a backend the table does not name allocates the default row
(the adapters then check the row against the cache tensors themselves).
"""

from __future__ import annotations

from glm_pd_common.errors import ConfigError

ENGINES = ("vllm", "sglang")

# (engine, cache dtype name, attention backend or None for the default) -> glm-pd row format.
_ROW_FORMATS: dict[tuple[str, str, str | None], str] = {
    # vLLM 0.33: FLASHMLA_SPARSE serves every fp8 name as fp8_ds_mla (it rewrites the cache dtype to that
    # name); auto is the model dtype (bf16). The FlashInfer sparse backends keep the plain 576 B fp8 row, and
    # on SM10x vLLM turns auto into fp8_e4m3 for GlmMoeDsaForCausalLM before a backend is chosen.
    ("vllm", "auto", None): "bf16",
    ("vllm", "bfloat16", None): "bf16",
    ("vllm", "fp8", None): "fp8_ds_mla",
    ("vllm", "fp8_e4m3", None): "fp8_ds_mla",
    ("vllm", "fp8_ds_mla", None): "fp8_ds_mla",
    ("vllm", "fp8", "FLASHINFER_MLA_SPARSE"): "fp8_raw",
    ("vllm", "fp8_e4m3", "FLASHINFER_MLA_SPARSE"): "fp8_raw",
    ("vllm", "fp8", "FLASHINFER_MLA_SPARSE_SM90"): "fp8_raw",
    ("vllm", "fp8_e4m3", "FLASHINFER_MLA_SPARSE_SM90"): "fp8_raw",
    # SGLang 0.5.23: fp8_e4m3 is fp8_ds_mla, except under the trtllm and tilelang DSA backends (raw fp8).
    ("sglang", "auto", None): "bf16",
    ("sglang", "bf16", None): "bf16",
    ("sglang", "bfloat16", None): "bf16",
    ("sglang", "fp8_e4m3", None): "fp8_ds_mla",
    ("sglang", "fp8_e4m3", "trtllm"): "fp8_raw",
    ("sglang", "fp8_e4m3", "tilelang"): "fp8_raw",
}

# The fp8 name each engine's recipes launch with: the default of ``glm-pd plan --engine X``.
DEFAULT_CACHE_DTYPE = {"vllm": "fp8", "sglang": "fp8_e4m3"}


def accepted_cache_dtypes(engine: str) -> tuple[str, ...]:
    """The cache dtype names glm-pd accepts from ``engine``, in table order."""
    if engine not in ENGINES:
        raise ConfigError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    return tuple(dict.fromkeys(name for e, name, _ in _ROW_FORMATS if e == engine))


def row_formats_by_backend(engine: str, cache_dtype: str) -> dict[str | None, str]:
    """Every row ``engine`` may allocate for ``cache_dtype``, by attention backend (``None``: the default)."""
    accepted = accepted_cache_dtypes(engine)
    if cache_dtype not in accepted:
        raise ConfigError(
            f"{engine} kv cache dtype {cache_dtype!r} is not supported for GLM DSA; {engine} names glm-pd accepts: "
            f"{', '.join(accepted)}"
        )
    return {backend: row for (e, name, backend), row in _ROW_FORMATS.items() if e == engine and name == cache_dtype}


def row_format_for(engine: str, cache_dtype: str, backend: str | None = None) -> str:
    """The row ``engine`` allocates for ``cache_dtype`` under ``backend`` (``None``: its default backend)."""
    rows = row_formats_by_backend(engine, cache_dtype)
    return rows.get(backend, rows[None])


# The CUDA SM majors on which an engine's DSA indexer stores a token's power-of-two scale as four equal UE8M0
# bytes; on every other CUDA device, and on CPU, it stores one fp32.
_UE8M0_SM_MAJORS: dict[str, tuple[int, ...]] = {
    # vLLM 0.33: exactly where its MQA-logits kernels take MX scales (utils/deep_gemm.py, mqa_logits_use_mx_scales).
    "vllm": (10,),
    # SGLang 0.5.23: none. Its fused indexer-K writers (jit/csrc/deepseek_v32/indexer_k.cuh,
    # jit/csrc/dsa/fused_store_index_cache.cuh) and the fallback behind set_index_k_scale_buffer store an fp32
    # scale whatever the SM, and its paged MQA-logits call reads them as such.
    "sglang": (),
}
_ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def indexer_scale_format(engine: str, platform: str, capability: tuple[int, int] | None, configured: str = "") -> str:
    """The indexer scale encoding ``engine`` writes on a device, confirmed against a configured value.

    The engines differ (vLLM packs UE8M0 bytes on SM10x, SGLang never does), so the rule is the engine's, read
    from the device rather than trusted from a setting. A configured value that contradicts the device is
    refused: the fingerprint would then promise bytes this rank does not hold. ``platform`` is ``cuda``,
    ``cpu`` or what else the engine runs on (refused: glm-pd does not know the indexer bytes there).
    """
    if engine not in _UE8M0_SM_MAJORS:
        raise ConfigError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    name = _ENGINE_NAMES[engine]
    if platform == "cuda":
        if capability is None:
            raise ConfigError(f"cannot read the CUDA device capability, which decides {name}'s indexer scale format")
        detected = "ue8m0x4" if capability[0] in _UE8M0_SM_MAJORS[engine] else "fp32"
        device = f"CUDA SM{capability[0]}{capability[1]}"
    elif platform == "cpu":
        detected, device = "fp32", "CPU"
    else:
        raise ConfigError(f"glm-pd knows the indexer bytes {name} writes on CUDA and CPU devices, not on {platform!r}")
    if configured and configured != detected:
        raise ConfigError(
            f"indexer_scale_format is configured {configured!r}, but {name} writes {detected!r} indexer scales on "
            f"this device ({device}); leave it unset or set it to {detected!r}"
        )
    return detected

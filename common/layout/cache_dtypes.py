"""Each engine's ``--kv-cache-dtype`` names -> the main MLA row that engine allocates for a GLM-5.x DSA model.

The same word means different rows to different engines (vLLM's ``fp8`` is the 656 B ``fp8_ds_mla`` row;
SGLang has no ``fp8`` at all), so an engine's name is never handed to the layout directly: it goes through
this one table, which both adapters and ``glm-pd plan`` read. The values are glm-pd's row formats
(``formats.ROW_FORMATS``). A key carries the DSA attention backend because the row can depend on it;
``None`` is the engine's default backend.
"""

from __future__ import annotations

from glm_pd_common.errors import ConfigError

ENGINES = ("vllm", "sglang")

# (engine, cache dtype name, attention backend or None for the default) -> glm-pd row format.
_ROW_FORMATS: dict[tuple[str, str, str | None], str] = {
    # vLLM 0.33: DSA backends store fp8 as fp8_ds_mla; auto is the model dtype (bf16) on Hopper.
    ("vllm", "auto", None): "bf16",
    ("vllm", "bfloat16", None): "bf16",
    ("vllm", "fp8", None): "fp8_ds_mla",
    ("vllm", "fp8_e4m3", None): "fp8_ds_mla",
    ("vllm", "fp8_ds_mla", None): "fp8_ds_mla",
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


def row_format_for(engine: str, cache_dtype: str) -> str:
    """The row ``engine`` allocates for ``cache_dtype`` under its default attention backend."""
    return row_formats_by_backend(engine, cache_dtype)[None]

"""Each engine's ``--kv-cache-dtype`` names -> the main row it allocates; adapters and CLI read the same table.

The expected row bytes are FACTS.md §2 and §8 (656 B fp8_ds_mla, 576 B raw fp8, 1,152 B bf16; vLLM 0.33 and
SGLang 0.5.23), written out here, never read back from the table.
"""

import json
from typing import Any

import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.cache_dtypes import (
    ENGINES,
    accepted_cache_dtypes,
    indexer_scale_format,
    row_format_for,
    row_formats_by_backend,
)
from glm_pd_common.layout.formats import main_row_format
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.tools.cli import main
from glm_pd_sglang.kvargs import row_format_name

FP8_DS_MLA, RAW_FP8, BF16 = 656, 576, 1152
# (engine, name) -> row bytes under the engine's default DSA backend (Hopper, FACTS.md §2).
DEFAULT_BACKEND_ROW_BYTES = {
    ("vllm", "auto"): BF16,
    ("vllm", "bfloat16"): BF16,
    ("vllm", "fp8"): FP8_DS_MLA,
    ("vllm", "fp8_e4m3"): FP8_DS_MLA,
    ("vllm", "fp8_ds_mla"): FP8_DS_MLA,
    ("sglang", "auto"): BF16,
    ("sglang", "bf16"): BF16,
    ("sglang", "bfloat16"): BF16,
    ("sglang", "fp8_e4m3"): FP8_DS_MLA,
}
GEOMETRY = ModelGeometry.preset("glm-5.3")


def row_bytes(row_format: str) -> int:
    return main_row_format(row_format, GEOMETRY.kv_lora_rank, GEOMETRY.qk_rope_head_dim).row_bytes


@pytest.mark.parametrize(("key", "nbytes"), sorted(DEFAULT_BACKEND_ROW_BYTES.items()))
def test_each_engine_name_maps_to_the_row_that_engine_allocates(key: tuple[str, str], nbytes: int) -> None:
    assert row_bytes(row_format_for(*key)) == nbytes


def test_the_table_holds_exactly_the_names_the_engines_are_known_to_allocate() -> None:
    for engine in ENGINES:
        assert set(accepted_cache_dtypes(engine)) == {n for e, n in DEFAULT_BACKEND_ROW_BYTES if e == engine}


def test_sglang_fp8_is_raw_576_b_under_trtllm_and_tilelang_only() -> None:
    rows = {backend: row_bytes(f) for backend, f in row_formats_by_backend("sglang", "fp8_e4m3").items()}
    assert rows == {None: FP8_DS_MLA, "trtllm": RAW_FP8, "tilelang": RAW_FP8}


@pytest.mark.parametrize(
    ("engine", "name", "accepted"),
    [("vllm", "fp8_e5m2", "fp8_ds_mla"), ("sglang", "fp8", "fp8_e4m3"), ("sglang", "fp8_ds_mla", "bfloat16")],
)
def test_unknown_names_are_refused_naming_the_name_and_the_accepted_ones(engine: str, name: str, accepted: str) -> None:
    with pytest.raises(ConfigError, match=rf"{engine} kv cache dtype '{name}'.*{accepted}"):
        row_format_for(engine, name)


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(ConfigError, match="trt"):
        accepted_cache_dtypes("trt")


def test_engine_names_are_not_row_formats() -> None:
    """The layout takes only glm-pd's own row names, so vLLM's ``fp8`` can never turn into raw fp8 there."""
    for name in ("fp8", "fp8_e4m3", "auto", "bfloat16"):
        with pytest.raises(ConfigError, match=name):
            main_row_format(name)


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", "--json", "--tokens", "4096", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("key", "nbytes"), sorted(DEFAULT_BACKEND_ROW_BYTES.items()))
def test_cli_plan_describes_what_the_engine_allocates(capsys, key: tuple[str, str], nbytes: int) -> None:
    a = plan(capsys, "--engine", key[0], "--kv-cache-dtype", key[1])
    assert a["main_rows_by_backend"]["default"]["row_bytes"] == nbytes
    assert a["bytes_per_token"]["main"] == GEOMETRY.num_layers * nbytes
    assert (a["engine"], a["kv_cache_dtype"]) == key


def test_cli_plan_names_the_other_backends_row(capsys) -> None:
    a = plan(capsys, "--engine", "sglang", "--kv-cache-dtype", "fp8_e4m3")
    assert a["main_rows_by_backend"]["trtllm"]["row_bytes"] == RAW_FP8
    assert main(["plan", "--engine", "sglang", "--tokens", "4096"]) == 0
    assert "576 B" in capsys.readouterr().out


@pytest.mark.parametrize(("engine", "name"), [("vllm", "fp16"), ("sglang", "fp8")])
def test_cli_refuses_unknown_names_in_one_line(capsys, engine: str, name: str) -> None:
    assert main(["plan", "--engine", engine, "--kv-cache-dtype", name]) == 2
    err = capsys.readouterr().err.strip()
    assert f"'{name}'" in err and "\n" not in err


@pytest.mark.parametrize(("row", "name"), [(FP8_DS_MLA, "fp8_e4m3"), (RAW_FP8, "fp8_e4m3"), (BF16, "auto")])
def test_sglang_adapter_accepts_the_rows_sglang_allocates(row: int, name: str) -> None:
    assert row_bytes(row_format_name(64 * row, 64, name, GEOMETRY)) == row


@pytest.mark.parametrize(("row", "name"), [(BF16, "fp8_e4m3"), (FP8_DS_MLA, "bf16"), (RAW_FP8, "auto")])
def test_sglang_adapter_refuses_rows_the_dtype_does_not_give(row: int, name: str) -> None:
    with pytest.raises(ConfigError, match="do not fit kv_cache_dtype"):
        row_format_name(64 * row, 64, name, GEOMETRY)


# vLLM 0.33 by sparse backend (FACTS.md §8): FLASHMLA_SPARSE serves fp8 as 656 B fp8_ds_mla, the FlashInfer
# sparse backends keep 576 B plain fp8 rows, bf16 is 1,152 B everywhere; a backend not named keeps the default.
VLLM_BACKEND_ROW_BYTES = [
    ("fp8_e4m3", "FLASHINFER_MLA_SPARSE", RAW_FP8),
    ("fp8", "FLASHINFER_MLA_SPARSE", RAW_FP8),
    ("fp8_e4m3", "FLASHINFER_MLA_SPARSE_SM90", RAW_FP8),
    ("bfloat16", "FLASHINFER_MLA_SPARSE", BF16),
    ("auto", "FLASH_ATTN_MLA_SPARSE", BF16),
    ("fp8", "FLASHMLA_SPARSE", FP8_DS_MLA),
    ("fp8_ds_mla", "FLASHMLA_SPARSE", FP8_DS_MLA),
    ("bfloat16", "FLASH_ATTN_MLA_SPARSE_FA4", BF16),
]


@pytest.mark.parametrize(("name", "backend", "nbytes"), VLLM_BACKEND_ROW_BYTES)
def test_vllm_rows_follow_the_sparse_backend(name: str, backend: str, nbytes: int) -> None:
    assert row_bytes(row_format_for("vllm", name, backend)) == nbytes


def test_an_unknown_name_is_refused_whatever_the_backend() -> None:
    with pytest.raises(ConfigError, match="'nvfp4_ds_mla'"):
        row_format_for("vllm", "nvfp4_ds_mla", "FLASHMLA_SPARSE")


@pytest.mark.parametrize(
    ("engine", "platform", "capability", "scale"),
    [
        ("vllm", "cuda", (9, 0), "fp32"),  # H100 / H200
        ("vllm", "cuda", (10, 0), "ue8m0x4"),  # B200
        ("vllm", "cuda", (10, 3), "ue8m0x4"),  # B300: the SM10x family
        ("vllm", "cuda", (12, 0), "fp32"),  # SM120 is not in vLLM's MX-scale family
        ("vllm", "cpu", None, "fp32"),
        ("sglang", "cuda", (9, 0), "fp32"),
        ("sglang", "cuda", (10, 0), "fp32"),  # SGLang's indexer writers store fp32 on every SM
        ("sglang", "cuda", (12, 0), "fp32"),
        ("sglang", "cpu", None, "fp32"),
    ],
)
def test_indexer_scale_format_by_engine_and_device(engine: str, platform: str, capability, scale: str) -> None:
    assert indexer_scale_format(engine, platform, capability) == scale
    assert indexer_scale_format(engine, platform, capability, scale) == scale


@pytest.mark.parametrize(
    ("engine", "capability", "configured", "written"),
    [
        ("vllm", (9, 0), "ue8m0x4", "fp32"),
        ("vllm", (10, 0), "fp32", "ue8m0x4"),
        ("sglang", (10, 0), "ue8m0x4", "fp32"),
    ],
)
def test_a_configured_scale_format_the_device_contradicts_names_both(
    engine: str, capability, configured: str, written: str
) -> None:
    name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
    with pytest.raises(ConfigError, match=rf"configured '{configured}', but {name} writes '{written}'"):
        indexer_scale_format(engine, "cuda", capability, configured)


@pytest.mark.parametrize(
    ("engine", "platform", "capability", "needle"),
    [("vllm", "rocm", None, "'rocm'"), ("vllm", "cuda", None, "capability"), ("trtllm", "cuda", (9, 0), "'trtllm'")],
)
def test_unknown_devices_and_engines_are_refused(engine: str, platform: str, capability, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        indexer_scale_format(engine, platform, capability)

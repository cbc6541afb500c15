"""The vLLM adapter's cache spec: the main row vLLM allocates for each ``--kv-cache-dtype`` name under the
attention backend vLLM chose, and the indexer scale format vLLM writes on the device (FACTS.md §2, §8:
656 B fp8_ds_mla under FLASHMLA_SPARSE, 576 B plain fp8 under FLASHINFER_MLA_SPARSE, 1,152 B bf16; fp32
scales on SM90 and CPU, four UE8M0 bytes on SM10x). Then the tensors' refusals, named.

The vLLM configs are duck-typed namespaces holding only what the adapter reads; the attention layers in the
forward context are stand-ins carrying vLLM's real backend classes. The device is a test double: vLLM's
``current_platform.get_device_capability`` is patched to each capability (no GPU here).
"""

from types import SimpleNamespace

import pytest
import torch
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.geometry import PRESETS, ModelGeometry
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_vllm.caches import pages_per_block, regions_from_kv_caches
from glm_pd_vllm.config import GlmPdVllmConfig
from glm_pd_vllm.model import cache_spec

FP8_DS_MLA, RAW_FP8, BF16, INDEXER_ROW = 656, 576, 1152, 132
TINY = {**PRESETS["glm-5"], "num_hidden_layers": 2, "num_nextn_predict_layers": 0}  # layers 0 and 1, both full


def vllm_config(name: str, *, layers: str | None = None, selected: str | None = None, device: str = "cpu"):
    context = {}
    if layers is not None:
        backend = AttentionBackendEnum[layers].get_class()
        context = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(attn_backend=backend) for i in range(3)}
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=PRESETS["glm-5.3"]),
        cache_config=SimpleNamespace(cache_dtype=name),
        compilation_config=SimpleNamespace(static_forward_context=context),
        attention_config=SimpleNamespace(backend=AttentionBackendEnum[selected] if selected else None),
        device_config=SimpleNamespace(device_type=device),
    )


def extra(**values) -> GlmPdVllmConfig:
    return GlmPdVllmConfig.from_extra(values)


@pytest.fixture
def on_capability(monkeypatch):
    def set_capability(major: int, minor: int) -> None:
        capability = DeviceCapability(major, minor)
        monkeypatch.setattr(
            type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: capability)
        )

    return set_capability


@pytest.mark.parametrize(
    ("name", "nbytes"),
    [("auto", BF16), ("bfloat16", BF16), ("fp8", FP8_DS_MLA), ("fp8_e4m3", FP8_DS_MLA), ("fp8_ds_mla", FP8_DS_MLA)],
)
def test_without_a_known_backend_the_spec_is_vllms_default_row(name: str, nbytes: int) -> None:
    assert cache_spec(vllm_config(name), extra()).row.row_bytes == nbytes


@pytest.mark.parametrize(
    ("backend", "name", "nbytes"),
    [
        ("FLASHINFER_MLA_SPARSE", "fp8_e4m3", RAW_FP8),  # B200's default: auto became fp8_e4m3
        ("FLASHINFER_MLA_SPARSE", "fp8", RAW_FP8),
        ("FLASHINFER_MLA_SPARSE", "bfloat16", BF16),
        ("FLASHINFER_MLA_SPARSE_SM90", "fp8_e4m3", RAW_FP8),
        ("FLASHMLA_SPARSE", "fp8_ds_mla", FP8_DS_MLA),  # FLASHMLA_SPARSE renames every fp8 dtype to this
        ("FLASHMLA_SPARSE", "auto", BF16),
    ],
)
def test_the_backend_of_the_built_layers_decides_the_row(backend: str, name: str, nbytes: int) -> None:
    spec = cache_spec(vllm_config(name, layers=backend), extra())
    assert spec.row.row_bytes == nbytes
    assert backend in spec.origin and repr(name) in spec.origin


def test_the_selected_backend_decides_where_no_layers_were_built() -> None:
    """The engine-core process under a multiprocess executor builds no layers; --attention-backend still says."""
    spec = cache_spec(vllm_config("fp8_e4m3", selected="FLASHINFER_MLA_SPARSE"), extra())
    assert spec.row.row_bytes == RAW_FP8


def test_layers_on_two_backends_are_refused() -> None:
    config = vllm_config("fp8_e4m3", layers="FLASHINFER_MLA_SPARSE")
    config.compilation_config.static_forward_context["model.layers.9.self_attn.attn"] = SimpleNamespace(
        attn_backend=AttentionBackendEnum["FLASHMLA_SPARSE"].get_class()
    )
    with pytest.raises(ConfigError, match=r"several attention backends \['FLASHINFER_MLA_SPARSE', 'FLASHMLA_SPARSE'\]"):
        cache_spec(config, extra())


@pytest.mark.parametrize(
    ("capability", "scale"),
    [((9, 0), "fp32"), ((10, 0), "ue8m0x4"), ((10, 3), "ue8m0x4"), ((12, 0), "fp32"), ((8, 9), "fp32")],
)
def test_the_scale_format_is_what_vllm_writes_on_the_device(on_capability, capability, scale) -> None:
    on_capability(*capability)
    assert cache_spec(vllm_config("fp8", device="cuda"), extra()).indexer.scale_format == scale
    assert (
        cache_spec(vllm_config("fp8", device="cuda"), extra(indexer_scale_format=scale)).indexer.scale_format == scale
    )


def test_cpu_caches_hold_fp32_scales() -> None:
    assert cache_spec(vllm_config("fp8"), extra()).indexer.scale_format == "fp32"


@pytest.mark.parametrize(
    ("capability", "configured", "written"), [((9, 0), "ue8m0x4", "fp32"), ((10, 0), "fp32", "ue8m0x4")]
)
def test_a_configured_scale_format_the_device_contradicts_is_refused(on_capability, capability, configured, written):
    on_capability(*capability)
    with pytest.raises(
        ConfigError, match=rf"configured '{configured}', but vLLM writes '{written}'.*SM{capability[0]}"
    ):
        cache_spec(vllm_config("fp8", device="cuda"), extra(indexer_scale_format=configured))


def test_a_configured_ue8m0x4_on_cpu_caches_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"configured 'ue8m0x4', but vLLM writes 'fp32'.*CPU"):
        cache_spec(vllm_config("fp8"), extra(indexer_scale_format="ue8m0x4"))


def test_rocm_is_refused_naming_it(monkeypatch) -> None:
    monkeypatch.setattr(type(current_platform), "is_rocm", classmethod(lambda cls: True))
    with pytest.raises(ConfigError, match="not on 'rocm'"):
        cache_spec(vllm_config("fp8", device="cuda"), extra())


def test_an_unknown_scale_format_name_is_refused_in_the_config() -> None:
    with pytest.raises(ConfigError, match=r"indexer_scale_format'\] must be one of .*got 'bf16'"):
        extra(indexer_scale_format="bf16")


# -- the cache tensors against the spec ---------------------------------------------------------------------
def caches(row: int, *, pages: int = 8, page_tokens: int = 64, dtype=torch.uint8) -> dict[str, torch.Tensor]:
    """vLLM's names, views [pages, 1, page_tokens, row] over one buffer per layer (row in bytes)."""
    width = row // torch.empty(0, dtype=dtype).element_size()
    out = {}
    for layer in (0, 1):
        out[f"model.layers.{layer}.self_attn.attn"] = torch.zeros(pages, 1, page_tokens, width, dtype=dtype)
        out[f"model.layers.{layer}.self_attn.indexer.k_cache"] = torch.zeros(
            pages, 1, page_tokens, INDEXER_ROW, dtype=torch.uint8
        )
    return out


def spec(row_format: str, origin: str = "") -> CacheSpec:
    return CacheSpec.create(ModelGeometry.from_config(TINY), row_format, origin=origin)


def test_rows_of_another_size_are_refused_naming_both_and_what_chose_the_spec() -> None:
    with pytest.raises(ConfigError) as err:
        regions_from_kv_caches(caches(RAW_FP8), spec("fp8_ds_mla", origin="vLLM cache dtype 'fp8'"), 64)
    text = str(err.value)
    assert "576 B rows (fp8_raw)" in text and "656 B rows (fp8_ds_mla)" in text and "vLLM cache dtype 'fp8'" in text


def test_float16_rows_are_not_bf16_rows() -> None:
    with pytest.raises(ConfigError, match=r"torch.float16 rows"):
        regions_from_kv_caches(caches(BF16, dtype=torch.float16), spec("bf16"), 64)
    assert regions_from_kv_caches(caches(BF16, dtype=torch.bfloat16), spec("bf16"), 64)


def test_kernel_block_views_of_128_token_blocks_register_as_64_token_pages() -> None:
    regions = regions_from_kv_caches(caches(FP8_DS_MLA, pages=8), spec("fp8_ds_mla"), 128)
    assert {(r.page_tokens, r.num_pages) for r in regions} == {(64, 8)}
    assert pages_per_block(regions, 128) == 2


def test_pages_that_do_not_fill_whole_scheduler_blocks_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"7 pages of 64 tokens.*scheduler blocks of 128"):
        regions_from_kv_caches(caches(FP8_DS_MLA, pages=7), spec("fp8_ds_mla"), 128)
    with pytest.raises(ConfigError, match=r"pages of 64 tokens.*blocks of 96"):
        regions_from_kv_caches(caches(FP8_DS_MLA), spec("fp8_ds_mla"), 96)

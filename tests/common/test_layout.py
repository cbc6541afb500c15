import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.formats import IndexerFormat, main_row_format


def test_fp8_ds_mla_row_is_656_with_named_ranges():
    row = main_row_format("fp8_ds_mla")
    assert row.row_bytes == 656
    assert row.field_range("latent_fp8") == (0, 512)
    assert row.field_range("latent_scales_fp32") == (512, 528)
    assert row.field_range("rope_bf16") == (528, 656)
    assert row.row_bytes * 64 == 41_984


@pytest.mark.parametrize(("dtype", "nbytes"), [("auto", 1152), ("bf16", 1152), ("fp8", 576), ("fp8_e4m3", 576)])
def test_other_row_formats(dtype, nbytes):
    assert main_row_format(dtype).row_bytes == nbytes


def test_unknown_dtype_is_refused():
    with pytest.raises(ConfigError, match="fp16"):
        main_row_format("fp16")


def test_indexer_page_keys_then_scales():
    idx = IndexerFormat()
    assert idx.row_bytes == 132
    assert idx.page_format.page_bytes(64) == 8_448
    assert idx.key_range(0, 64) == (0, 128)
    assert idx.key_range(5, 64) == (640, 768)
    assert idx.scale_range(0, 64) == (8192, 8196)
    assert idx.scale_range(63, 64) == (8192 + 252, 8448)
    assert idx.scale_range(3, 16) == (16 * 128 + 12, 16 * 128 + 16)


def test_scale_format_is_checked():
    assert IndexerFormat(scale_format="ue8m0x4").row_bytes == 132
    with pytest.raises(ConfigError, match="scale format"):
        IndexerFormat(scale_format="bf16")


def test_token_outside_page_is_refused():
    with pytest.raises(ValueError):
        IndexerFormat().key_range(64, 64)

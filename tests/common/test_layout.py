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


def test_raw_fp8_and_bf16_rows():
    raw = main_row_format("fp8_raw")
    assert raw.row_bytes == 576 and raw.field_range("rope_fp8") == (512, 576)
    bf16 = main_row_format("bf16")
    assert bf16.row_bytes == 1152 and bf16.field_range("rope_bf16") == (1024, 1152)


@pytest.mark.parametrize("name", ["fp16", "fp8", "auto"])
def test_unknown_row_format_is_refused(name):
    with pytest.raises(ConfigError, match=f"'{name}'.*fp8_ds_mla, fp8_raw, bf16"):
        main_row_format(name)


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

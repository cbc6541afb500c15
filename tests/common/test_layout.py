import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm_pd_common.errors import ConfigError, PageOutOfRange, PlanError
from glm_pd_common.layout.formats import IndexerFormat, main_row_format
from glm_pd_common.layout.pages import INT64_MAX, MAX_PAGES_PER_BLOCK, block_pages


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


# -- scheduler blocks of several kernel pages (vLLM's --block-size 128 over 64-token kernel blocks) ----------
ids_and_ratio = st.tuples(st.lists(st.integers(0, 1 << 40), max_size=40), st.integers(1, MAX_PAGES_PER_BLOCK))


@given(ids_and_ratio)
def test_block_pages_lists_each_blocks_kernel_pages_in_order(case):
    ids, ratio = case
    pages = block_pages(ids, ratio)
    assert pages.dtype == np.int64 and pages.size == len(ids) * ratio
    assert np.array_equal(pages // ratio, np.repeat(np.asarray(ids, dtype=np.int64), ratio))
    assert np.array_equal(pages % ratio, np.tile(np.arange(ratio), len(ids)))


@pytest.mark.parametrize(
    ("ids", "ratio", "error", "needle"),
    [
        ([INT64_MAX // 2 + 1], 2, PageOutOfRange, "has no kernel pages"),  # its pages would pass int64
        ([3, -1], 2, PageOutOfRange, "block id -1"),
        ([1.5], 2, PageOutOfRange, "not integers"),
        ([[1, 2]], 2, PlanError, "one list"),
        ([1], 0, PlanError, "pages_per_block"),
        ([1], MAX_PAGES_PER_BLOCK + 1, PlanError, "pages_per_block"),
    ],
)
def test_block_pages_refuses_what_has_no_pages(ids, ratio, error, needle):
    with pytest.raises(error, match=needle):
        block_pages(ids, ratio)


def test_block_pages_of_nothing_is_an_empty_int64_list():
    assert block_pages([], 2).dtype == np.int64 and block_pages([], 1).size == 0


def _kernel_writer_offsets(block: int, token: int, kernel: int, ratio: int) -> tuple[int, int]:
    """Key and scale byte offsets of ``token`` of scheduler ``block``, where vLLM's indexer kernel writes them
    (kernel block ``block * ratio + token // kernel``; key at 128·t, scale at 128·K + 4·t inside it)."""
    page, t = block * ratio + token // kernel, token % kernel
    base = page * kernel * 132
    return base + 128 * t, base + 128 * kernel + 4 * t


def test_kernel_pages_are_exact_where_one_128_token_page_is_not():
    """A 128-token scheduler block holds two 64-token kernel pages, keys then scales in each: reading it as
    one 128-token page (all keys, then all scales) misplaces the first half's scales and the second half's keys."""
    idx, page_bytes = IndexerFormat(), IndexerFormat().page_format.page_bytes
    wrong = 0
    for token in range(128):
        written = _kernel_writer_offsets(block=3, token=token, kernel=64, ratio=2)
        page = int(block_pages([3], 2)[token // 64])
        start = page * page_bytes(64)
        assert (start + idx.key_range(token % 64, 64)[0], start + idx.scale_range(token % 64, 64)[0]) == written
        whole = 3 * page_bytes(128)
        wrong += (whole + idx.key_range(token, 128)[0], whole + idx.scale_range(token, 128)[0]) != written
    assert wrong == 128

"""SGLang's KVArgs -> regions: the DSA pool's positional lists, zero-length shared layers, and refusals."""

import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVArgs, StateType

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_sglang.config import GlmPdSglangConfig
from glm_pd_sglang.kvargs import rank_caches

PAGE = 64


def make_args(geometry: ModelGeometry, *, row: int = 656, draft: int = 1, shared_rows: int = 0) -> tuple[KVArgs, list]:
    keep = []
    layers = geometry.num_layers + draft
    main = [torch.zeros((8 * PAGE + PAGE, 1, row), dtype=torch.uint8) for _ in range(layers)]
    index = [
        torch.zeros((9 if (i in geometry.full_indexer_layers or i >= geometry.num_layers) else shared_rows, PAGE * 132),
                    dtype=torch.uint8)
        for i in range(layers)
    ]  # fmt: skip
    keep += main + index
    args = KVArgs()
    args.page_size = PAGE
    args.kv_data_ptrs = [t.data_ptr() for t in main]
    args.kv_data_lens = [t.nbytes for t in main]
    args.kv_item_lens = [t[0].nbytes * PAGE for t in main]
    args.num_draft_entries = draft
    args.kv_cache_dtype_str = "fp8_e4m3" if row != 1152 else "auto"
    args.state_types = [StateType.DSA]
    args.state_data_ptrs = [[t.data_ptr() for t in index]]
    args.state_data_lens = [[t.nbytes for t in index]]
    args.state_item_lens = [[t[0].nbytes if t.shape[0] else 0 for t in index]]
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    return args, keep


@pytest.fixture
def geometry(tiny_model: str) -> ModelGeometry:
    return ModelGeometry.from_config(tiny_model)


def caches(args: KVArgs, geometry: ModelGeometry):
    return rank_caches(args, geometry, scale_format="fp32", mem_kind="DRAM", device_id=0)


def test_dsa_pool_maps_to_main_and_indexer_regions(geometry: ModelGeometry) -> None:
    args, _keep = make_args(geometry)
    out = caches(args, geometry)
    kinds = [(r.kind, r.layer_id) for r in out.regions]
    assert [lay for k, lay in kinds if k == "main"] == list(range(7))  # 6 target + MTP layer 6
    assert [lay for k, lay in kinds if k == "indexer"] == [0, 1, 2, 6]  # shared layers 3-5 skipped
    assert out.spec.row.row_bytes == 656 and out.spec.fingerprint().main_row_format == "fp8_ds_mla"
    mtp_index = out.regions[-1]
    assert mtp_index.kind == "indexer" and mtp_index.is_mtp and mtp_index.page_bytes == PAGE * 132
    assert mtp_index.base_addr == args.state_data_ptrs[0][6] and mtp_index.num_pages == 9


def test_without_speculative_decoding_there_is_no_mtp_layer(geometry: ModelGeometry) -> None:
    args, _keep = make_args(geometry, draft=0)
    out = caches(args, geometry)
    assert out.spec.geometry.mtp_layers == () and max(r.layer_id for r in out.regions) == 5


@pytest.mark.parametrize(("row", "name"), [(576, "fp8_raw"), (1152, "bf16")])
def test_row_bytes_pick_the_row_format(geometry: ModelGeometry, row: int, name: str) -> None:
    args, _keep = make_args(geometry, row=row)
    assert caches(args, geometry).spec.row.name == name


def test_an_indexer_on_a_shared_layer_is_refused(geometry: ModelGeometry) -> None:
    args, _keep = make_args(geometry, shared_rows=9)
    with pytest.raises(ConfigError, match=r"differ on \[3, 4, 5\]"):
        caches(args, geometry)


def test_unknown_row_and_mismatched_dtype_are_refused(geometry: ModelGeometry) -> None:
    args, _keep = make_args(geometry, row=600)
    with pytest.raises(ConfigError, match="600 B"):
        caches(args, geometry)
    args, _keep = make_args(geometry, row=1152)
    args.kv_cache_dtype_str = "fp8_e4m3"
    with pytest.raises(ConfigError, match="do not fit kv_cache_dtype"):
        caches(args, geometry)


def test_a_layer_split_rank_maps_only_its_layers(geometry: ModelGeometry) -> None:
    """CP layer split, shard 1 of 2 (layers 3-5 and the MTP layer): SGLang lists those layers only."""
    args, _keep = make_args(geometry)
    for field in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens"):
        setattr(args, field, getattr(args, field)[3:])
    for field in ("state_data_ptrs", "state_data_lens", "state_item_lens"):
        getattr(args, field)[0] = getattr(args, field)[0][3:]
    args.prefill_start_layer = 3
    held = (3, 4, 5, 6)
    out = rank_caches(args, geometry, scale_format="fp32", mem_kind="DRAM", device_id=0, held=held)
    assert [(r.kind, r.layer_id) for r in out.regions] == [("main", 3), ("main", 4), ("main", 5), ("main", 6),
                                                           ("indexer", 6)]  # fmt: skip
    assert out.spec.geometry == geometry  # the MTP layer stays in the fingerprint on every shard
    with pytest.raises(ConfigError, match=r"holds layers \[4, 5, 6\]"):  # a list that is not the announced shard
        rank_caches(args, geometry, scale_format="fp32", mem_kind="DRAM", device_id=0, held=(4, 5, 6))
    args.prefill_start_layer = 4
    with pytest.raises(ConfigError, match="this rank holds 2 of"):
        rank_caches(args, geometry, scale_format="fp32", mem_kind="DRAM", device_id=0, held=(4, 5, 6))


def test_short_state_lists_and_extra_state_are_refused(geometry: ModelGeometry) -> None:
    args, _keep = make_args(geometry)
    for field in ("state_data_ptrs", "state_data_lens", "state_item_lens"):
        getattr(args, field)[0].pop(3)  # a layer missing from the DSA state: positions no longer pair
    with pytest.raises(ConfigError, match="need one each"):
        caches(args, geometry)
    args, _keep = make_args(geometry)
    args.state_types = [StateType.DSA, StateType.DSA_TAIL]
    with pytest.raises(ConfigError, match="dsa_tail"):
        caches(args, geometry)


def test_settings_are_parsed_strictly() -> None:
    assert GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_TRANSPORT": "nixl"}).transport == "nixl"
    assert GlmPdSglangConfig.from_env({}).transport == "mooncake"
    with pytest.raises(ConfigError, match="SGLANG_GLM_PD_ALOW_TCP"):
        GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_ALOW_TCP": "1"})
    with pytest.raises(ConfigError, match="boolean"):
        GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_ALLOW_TCP": "maybe"})
    with pytest.raises(ConfigError, match="one of"):
        GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_TRANSPORT": "tcp"})

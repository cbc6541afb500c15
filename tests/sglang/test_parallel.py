"""glm-pd's pairing against SGLang's own rank mapping (``CommonKVManager._resolve_rank_mapping``), and the CP
modes glm-pd refuses."""

from types import SimpleNamespace

import pytest
from sglang.srt.disaggregation.common.conn import CommonKVManager, PrefillServerInfo

from glm_pd_common.errors import ConfigError
from glm_pd_sglang.parallel import check_routing, refuse_unsupported
from tests.support.sglang_checks import GEOMETRY


def sglang_mapping(decode_rank: int, decode_tp: int, prefill_tp: int, prefill_cp: int, split: bool, **extra: bool):
    """What SGLang's decode computes for one prefill instance (its own method on a stand-in manager)."""
    info = PrefillServerInfo(
        attn_tp_size=prefill_tp, attn_cp_size=prefill_cp, dp_size=1, pp_size=1, page_size=64,
        kv_cache_dtype="fp8_e4m3", follow_bootstrap_room=True, enable_dsa_cache_layer_split=split, **extra,
    )  # fmt: skip
    decode = SimpleNamespace(
        attn_tp_size=decode_tp, attn_cp_size=1, attn_cp_rank=0, pp_size=1, pp_rank=0, is_mla_backend=True,
        is_hybrid_mla_backend=False, enable_all_cp_ranks_for_transfer=False,
        kv_args=SimpleNamespace(engine_rank=decode_rank),
    )  # fmt: skip
    CommonKVManager._resolve_rank_mapping(decode, info)
    return info


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("prefill_cp", [1, 2, 4])
@pytest.mark.parametrize("prefill_tp", [1, 2, 4])
@pytest.mark.parametrize("decode_tp", [1, 2, 4, 8])
def test_sglang_reads_each_layer_from_the_rank_glm_pd_picks(
    decode_tp: int, prefill_tp: int, prefill_cp: int, split: bool
) -> None:
    for rank in range(decode_tp):
        check_routing(sglang_mapping(rank, decode_tp, prefill_tp, prefill_cp, split), rank, decode_tp, GEOMETRY)


def test_a_mapping_glm_pd_would_not_read_is_refused() -> None:
    info = sglang_mapping(0, 2, 2, 2, True)
    info.target_tp_rank = 1  # another rank of each shard than the pairing's
    with pytest.raises(ConfigError, match=r"SGLang pairs decode rank 0/2 with prefill ranks \[1, 3\].*from \[0, 2\]"):
        check_routing(info, 0, 2, GEOMETRY)
    info = sglang_mapping(0, 2, 2, 2, True)
    info.required_prefill_response_num = 1  # decode would report Success after one shard
    with pytest.raises(ConfigError, match="1 responses"):
        check_routing(info, 0, 2, GEOMETRY)


def test_kv_cache_sharding_and_all_cp_ranks_transfer_are_refused() -> None:
    with pytest.raises(ConfigError, match="--enable-kv-cache-sharding yet: each rank keeps only its logical pages"):
        refuse_unsupported(SimpleNamespace(enable_kv_cache_sharding=True), False)
    with pytest.raises(ConfigError, match="SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"):
        refuse_unsupported(SimpleNamespace(enable_kv_cache_sharding=False, enable_dsa_cache_layer_split=False), True)
    refuse_unsupported(SimpleNamespace(enable_kv_cache_sharding=False, enable_dsa_cache_layer_split=True), True)
    info = sglang_mapping(0, 2, 2, 1, False, enable_kv_cache_sharding=True)
    with pytest.raises(ConfigError, match="prefill runs --enable-kv-cache-sharding"):
        check_routing(info, 0, 2, GEOMETRY)

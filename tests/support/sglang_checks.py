"""What every SGLang handoff test checks once its rooms end (shared by test_handoff, test_fault_matrix and
test_layer_split)."""

from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.shards import REPLICATED
from glm_pd_common.layout.tp import SideLayout, sources
from glm_pd_sglang.parallel import AttentionRanks
from tests.support.tiny_glm import TINY_GLM

SUCCESS, FAILED = 4, 0  # KVPoll.Success, KVPoll.Failed
GEOMETRY = ModelGeometry.from_config(TINY_GLM)

# both sides through staging slots of 64 KiB (tens per request, cutting runs mid-page; 8 pairs a rank); on host
# memory ``auto`` pushes directly, so staged cases say ``always``
STAGED = {"SGLANG_GLM_PD_STAGING": "always", "SGLANG_GLM_PD_STAGING_MIB": "1", "SGLANG_GLM_PD_STAGING_SLOT_KIB": "64"}


def assert_clean(prefill: dict | None, decode: dict) -> None:
    """Nothing is held once every room ended: no per-room state on either side, every page back."""
    for report in [decode] + ([prefill] if prefill else []):
        for held in report["leftovers"]:
            assert not any(held.values()), held
        assert all(n == report["pool_pages"] for n in report["free_pages"])


def expected_sources(
    decode_rank: int, ranks: AttentionRanks, decode_tp: int, geometry: ModelGeometry = GEOMETRY
) -> dict[str, int]:
    """Region name -> the prefill rank (its index in the prefill report) whose bytes decode must hold there."""
    out = {}
    for source in sources(decode_rank, ranks.layout(geometry), SideLayout.of(decode_tp, REPLICATED, geometry)):
        for layer in source.layers:
            out[f"main {layer}"] = source.rank
            if layer in geometry.indexer_layers:
                out[f"indexer {layer}"] = source.rank
    return out


def assert_exact(
    prefill: dict,
    decode: dict,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    *,
    prefill_cp: int = 1,
    layer_split: bool = False,
    geometry: ModelGeometry = GEOMETRY,
) -> None:
    """Every decode rank holds, in every region, the suffix bytes of the prefill rank glm-pd's pairing picks for it
    (the prefill report lists ranks in pairing order: CP rank 0's attention-TP ranks first)."""
    ranks = AttentionRanks(prefill_tp, prefill_cp, layer_split)
    for p, d in zip(prefill["results"], decode["results"], strict=True):
        assert d["states"] == [SUCCESS] * decode_tp, d["reasons"]
        assert p["states"] == [SUCCESS] * ranks.num_ranks, p["reasons"]
        for rank in range(decode_tp):
            landed = d["dst_digests"][rank]
            want = expected_sources(rank, ranks, decode_tp, geometry)
            assert sorted(landed) == sorted(want), f"decode rank {rank} holds regions {sorted(landed)}"
            for name, src in want.items():
                assert landed[name] == p["src_digests"][src][name], f"room {d['room']} decode rank {rank} {name}"
            assert d["prefix_after"][rank] == d["prefix_before"][rank]  # decode's own prefix pages untouched
            assert d["aux_room"][rank] == d["room"]  # the metadata row landed before Success

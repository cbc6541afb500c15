import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm_pd_common.errors import ConfigError, LayoutMismatch
from glm_pd_common.layout.fingerprint import Fingerprint, PeerShape, diff, require_convertible, require_match
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.spec import CacheSpec

BASE = CacheSpec.create(ModelGeometry.preset("glm-5.3")).fingerprint()
ALTERNATIVES = {
    "model_type": "deepseek_v32",
    "num_layers": 61,
    "full_indexer_layers": (0, 1, 2),
    "mtp_layers": (),
    "kv_lora_rank": 256,
    "qk_rope_head_dim": 32,
    "cache_dtype": "fp8",
    "main_row_format": "fp8",
    "main_row_bytes": 576,
    "indexer_head_dim": 64,
    "indexer_row_bytes": 68,
    "indexer_scale_format": "ue8m0x4",
    "layout_version": 2,
}


def test_every_field_is_covered_by_the_alternatives():
    assert set(ALTERNATIVES) | {"model_revision"} == set(Fingerprint.__struct_fields__)


@given(st.sets(st.sampled_from(sorted(ALTERNATIVES)), min_size=1))
def test_diff_names_exactly_the_changed_fields(fields):
    other = msgspec.structs.replace(BASE, **{f: ALTERNATIVES[f] for f in fields})
    found = diff(BASE, other)
    assert {name for name, _, _ in found} == fields
    assert all(a == getattr(BASE, n) and b == ALTERNATIVES[n] for n, a, b in found)
    assert other.digest() != BASE.digest()
    with pytest.raises(LayoutMismatch) as err:
        require_match(BASE, other, remote_name="prefill")
    for f in fields:
        assert f in str(err.value)


def test_same_facts_same_digest_and_no_diff():
    again = CacheSpec.create(ModelGeometry.preset("glm-5.3")).fingerprint()
    assert again.digest() == BASE.digest()
    assert diff(BASE, again) == []


def test_main_row_656_vs_576_is_a_mismatch():
    raw = CacheSpec.create(ModelGeometry.preset("glm-5.3"), "fp8_raw").fingerprint()
    names = {n for n, _, _ in diff(BASE, raw)}
    assert {"main_row_bytes", "main_row_format", "cache_dtype"} <= names


def test_revision_compared_only_when_both_known():
    a = msgspec.structs.replace(BASE, model_revision="abc")
    assert diff(a, BASE) == []
    assert diff(a, msgspec.structs.replace(BASE, model_revision="def")) == [("model_revision", "abc", "def")]


def test_shapes_convertible_or_refused():
    require_convertible(PeerShape(64, 8, 3), PeerShape(16, 2, 1))
    with pytest.raises(ConfigError, match="decode page_tokens"):
        require_convertible(PeerShape(64, 8, 0), PeerShape(48, 2, 0))
    with pytest.raises(ConfigError, match="prefill tp_size"):
        require_convertible(PeerShape(64, 3, 0), PeerShape(64, 2, 0))
    with pytest.raises(ConfigError, match="tp_rank 2"):
        require_convertible(PeerShape(64, 2, 2), PeerShape(64, 2, 0))


def test_raw_fp8_and_fp8_ds_mla_peers_refuse_each_other_naming_both_rows():
    """A B200 on FLASHINFER_MLA_SPARSE (576 B) and an H200 on FLASHMLA_SPARSE (656 B): FACTS.md §2, §8."""
    raw = CacheSpec.create(ModelGeometry.preset("glm-5.3"), "fp8_raw", "ue8m0x4").fingerprint()
    with pytest.raises(LayoutMismatch) as err:
        require_match(raw, BASE, local_name="decode", remote_name="prefill")
    for needle in (
        "main_row_format: decode='fp8_raw' prefill='fp8_ds_mla'",
        "main_row_bytes: decode=576 prefill=656",
        "indexer_scale_format: decode='ue8m0x4' prefill='fp32'",
    ):
        assert needle in str(err.value)


def test_pages_per_block_is_exchanged_and_bounded():
    assert PeerShape(64, 1, 0).pages_per_block == 1  # what an engine without kernel blocks announces
    require_convertible(PeerShape(64, 1, 0, pages_per_block=2), PeerShape(64, 1, 0))
    for bad in (0, 257):
        with pytest.raises(ConfigError, match=f"prefill pages_per_block must be in 1..256, got {bad}"):
            require_convertible(PeerShape(64, 1, 0, pages_per_block=bad), PeerShape(64, 1, 0))

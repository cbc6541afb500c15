import json

import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.geometry import PRESETS, ModelGeometry

GLM53_FULL = {0, 1, 2, *range(6, 75, 4)}


def test_glm53_full_layers_are_the_published_21_plus_mtp():
    g = ModelGeometry.preset("glm-5.3")
    assert set(g.full_indexer_layers) == GLM53_FULL
    assert len(g.full_indexer_layers) == 21
    assert g.mtp_layers == (78,)
    assert g.indexer_layers[-1] == 78
    assert not g.is_full(3) and g.is_full(74) and not g.is_full(77)


def test_glm5_all_full_and_deepseek_all_61_full():
    assert ModelGeometry.preset("glm-5").full_indexer_layers == tuple(range(78))
    ds = ModelGeometry.preset("deepseek-v3.2")
    assert ds.full_indexer_layers == tuple(range(61))
    assert ds.model_type == "deepseek_v32"


def test_config_from_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["glm-5.3"]))
    assert ModelGeometry.from_config(tmp_path) == ModelGeometry.preset("glm-5.3")
    assert ModelGeometry.from_config(tmp_path / "config.json").num_layers == 78


def _cfg(**kw):
    base = dict(PRESETS["glm-5"])
    base.update(kw)
    return base


def test_freq_without_offset_uses_vllm_default_two():
    g = ModelGeometry.from_config(_cfg(index_topk_freq=4))
    # offset 2: layer l full iff max(l - 1, 0) % 4 == 0
    assert g.full_indexer_layers[:4] == (0, 1, 5, 9)


def test_pattern_string_and_list():
    pattern = "FS" * 39
    g = ModelGeometry.from_config(_cfg(index_topk_pattern=pattern))
    assert g.full_indexer_layers == tuple(range(0, 78, 2))
    assert ModelGeometry.from_config(_cfg(index_topk_pattern=list(pattern))) == g


def test_indexer_types_alone_disagrees_with_vllm_reading():
    types = ["full" if i % 2 == 0 else "shared" for i in range(78)]
    with pytest.raises(ConfigError) as err:
        ModelGeometry.from_config(_cfg(indexer_types=types))
    msg = str(err.value)
    assert "indexer_types" in msg and "vllm_default" in msg and "ignored by vLLM" in msg
    assert "[1, 3, 5" in msg


def test_disagreeing_rules_list_the_layers():
    types = ["full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(78)]
    types[10] = "shared"
    with pytest.raises(ConfigError, match=r"differ on layers \[10\]"):
        ModelGeometry.from_config(_cfg(indexer_types=types, index_topk_freq=4, index_skip_topk_offset=3))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "llama"}, "model_type"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"index_topk_pattern": "FS"}, "index_topk_pattern"),
        ({"index_topk_pattern": "F" * 77 + "X"}, "index_topk_pattern"),
        ({"index_topk_freq": 4, "index_skip_topk_offset": 0}, "index_skip_topk_offset"),
        ({"index_topk_freq": 0}, "index_topk_freq"),
        ({"indexer_types": ["full"] * 3}, "indexer_types"),
    ],
)
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelGeometry.from_config(_cfg(**change))


def test_missing_field_is_named():
    cfg = _cfg()
    del cfg["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelGeometry.from_config(cfg)


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match=r"glm-5\.3"):
        ModelGeometry.preset("glm-9")


def test_dense_mla_models_have_no_indexer() -> None:
    """DeepSeek-V2/V3 keep the MLA latent rows without a lightning indexer (what vLLM's CPU build can run)."""
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "num_nextn_predict_layers": 1}  # fmt: skip
    g = ModelGeometry.from_config(config)
    assert g.indexer_layers == () and g.all_layers == (0, 1, 2, 3, 4)
    dsa = ModelGeometry.from_config({**config, "model_type": "deepseek_v32", "index_head_dim": 128})
    assert dsa.indexer_layers == (0, 1, 2, 3, 4)

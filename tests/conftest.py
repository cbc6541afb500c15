import pytest

from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.spec import CacheSpec


@pytest.fixture
def small_spec() -> CacheSpec:
    """A 6-layer GLM-shaped model (full layers 0 and 3, one MTP layer) so tests touch real memory quickly."""
    geometry = ModelGeometry.from_config(
        {
            "model_type": "glm_moe_dsa",
            "num_hidden_layers": 6,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "index_head_dim": 128,
            "num_nextn_predict_layers": 1,
            "index_topk_pattern": "FSSFSS",
        }
    )
    return CacheSpec.create(geometry)

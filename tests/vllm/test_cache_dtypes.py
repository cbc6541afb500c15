"""The vLLM adapter builds the main row vLLM allocates for each ``--kv-cache-dtype`` name (FACTS.md §2, §8:
656 B fp8_ds_mla, 1,152 B bf16 under FLASHMLA_SPARSE), through the one table the CLI reads as well."""

from types import SimpleNamespace

import pytest

from glm_pd_common.layout.geometry import PRESETS
from glm_pd_vllm.params import cache_spec

FP8_DS_MLA, BF16 = 656, 1152


@pytest.mark.parametrize(
    ("name", "nbytes"),
    [("auto", BF16), ("bfloat16", BF16), ("fp8", FP8_DS_MLA), ("fp8_e4m3", FP8_DS_MLA), ("fp8_ds_mla", FP8_DS_MLA)],
)
def test_vllm_adapter_builds_the_row_vllm_allocates(name: str, nbytes: int) -> None:
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=PRESETS["glm-5.3"]),
        cache_config=SimpleNamespace(cache_dtype=name),
    )
    config = SimpleNamespace(model_revision="", indexer_scale_format="fp32")
    assert cache_spec(vllm_config, config).row.row_bytes == nbytes  # duck-typed config

"""Whether a request fits a rank's GPU memory (issue 16's account), checked against numbers worked out here from
FACTS.md: GLM-5.3 fp8_ds_mla carries 54,728 B per token per rank with its MTP layer; its FP8 checkpoint is ~89 GB
per GPU at TP 8; an H200 has 141 GB, a B200 180 GB."""

import json
import re
from dataclasses import replace

import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.hbm import HbmInputs, checkpoint_bytes, hbm_account, min_shards
from glm_pd_common.tools.cli import main

MILLION = 1_048_576
PER_TOKEN = 78 * 656 + 21 * 132 + (656 + 132)  # main, full indexer layers, the MTP layer's both


def inputs(hbm_gb: float, tp: int = 8, tokens: int = MILLION, reserve_gb: float = 4.0) -> HbmInputs:
    return HbmInputs(PER_TOKEN, tokens, tp, hbm_gb * 1e9, 0.9, 712e9 / tp, reserve_gb * 1e9)


def test_a_million_tokens_replicated_do_not_fit_an_h200_and_dcp_2_does() -> None:
    free = 0.9 * 141e9 - 89e9 - 4e9  # 33.9 GB
    replicated = hbm_account(inputs(141), 1)
    assert replicated["kv_free_bytes"] == pytest.approx(free)
    assert replicated["kv_per_rank_bytes"] == PER_TOKEN * MILLION  # 57.4 GB on every rank
    assert replicated["fits"] is False
    assert replicated["min_context_parallel"] == 2  # 28.7 GB per rank
    assert hbm_account(inputs(141), 2)["min_context_parallel"] == 2
    assert hbm_account(inputs(141), 2)["fits"] is True
    assert hbm_account(inputs(141), 2)["kv_per_rank_bytes"] == PER_TOKEN * MILLION // 2


def test_a_b200_holds_a_million_tokens_replicated() -> None:
    assert PER_TOKEN * MILLION < 0.9 * 180e9 - 89e9 - 4e9
    assert hbm_account(inputs(180), 1)["fits"] is True
    assert min_shards(inputs(180)) == 1


def test_shards_must_divide_tp_and_may_not_suffice() -> None:
    with pytest.raises(ConfigError, match="context parallel size 4 must divide TP 6"):
        hbm_account(inputs(141, tp=6), 4)
    tiny = inputs(80, tp=2, tokens=8 * MILLION)  # 0.9 x 80 - 356 < 0: the weights alone do not fit
    assert min_shards(tiny) is None


def test_the_checkpoint_size_comes_from_the_safetensors_index(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 123_000}}))
    assert checkpoint_bytes(str(tmp_path / "config.json"), None) == 123_000
    assert checkpoint_bytes(str(tmp_path), None) == 123_000
    (tmp_path / "model.safetensors.index.json").unlink()
    assert checkpoint_bytes(str(tmp_path), None) is None
    assert checkpoint_bytes(None, "glm-5.3") == 712e9


def test_plan_prints_each_sides_verdict(capsys) -> None:
    assert main(["plan", "--prefill-tp", "8", "--decode-tp", "8", "--decode-dcp", "2", "--json"]) == 0
    hbm = json.loads(capsys.readouterr().out)["hbm"]
    assert hbm["gpu"] == "h200"
    assert hbm["prefill"]["fits"] is False and hbm["prefill"]["min_context_parallel"] == 2
    assert hbm["decode"]["fits"] is True and hbm["decode"]["context_parallel"] == 2
    assert main(["plan", "--prefill-tp", "8", "--decode-tp", "8", "--gpu", "b200"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"prefill request KV +57.39 GB per rank \(replicated\): fits", out)
    assert main(["plan", "--prefill-tp", "8", "--decode-tp", "8", "--hbm-gb", "141"]) == 0
    assert "does not fit; needs DCP >= 2" in capsys.readouterr().out


def test_the_staging_buffer_is_counted_against_the_headroom_the_engine_leaves() -> None:
    """Staging is allocated after the engine sized its KV cache: it never shrinks the KV budget, and must fit the
    (1 - utilization) the engine leaves."""
    base = inputs(141.0)
    staged = replace(base, staging_bytes=256 * 2**20)
    assert hbm_account(staged, 2)["kv_free_bytes"] == hbm_account(base, 2)["kv_free_bytes"]
    account = hbm_account(staged, 2)
    assert account["headroom_bytes"] == pytest.approx(0.1 * 141e9) and account["staging_fits"]
    assert not hbm_account(replace(base, staging_bytes=20e9), 2)["staging_fits"]  # more than 14.1 GB left

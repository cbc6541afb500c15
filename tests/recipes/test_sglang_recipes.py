"""recipes/sglang: each launch command through SGLang 0.5.23's own server-argument parser, plugin loaded."""

import json

import pytest
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.disaggregation.utils import TransferBackend  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from glm_pd_common.layout.geometry import PRESETS  # noqa: E402
from glm_pd_sglang.config import GlmPdSglangConfig  # noqa: E402


@pytest.fixture(scope="module")
def glm53(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GLM-5.3's cache geometry as a local config (no hub here); the scripts take MODEL from the environment."""
    path = tmp_path_factory.mktemp("glm-5.3")
    (path / "config.json").write_text(json.dumps({"architectures": ["GlmMoeDsaForCausalLM"], **PRESETS["glm-5.3"]}))
    return str(path)


@pytest.mark.parametrize(("script", "mode"), [("sglang/prefill.sh", "prefill"), ("sglang/decode.sh", "decode")])
def test_launch_commands_parse(run_recipe, glm53: str, script: str, mode: str) -> None:
    argv, env = run_recipe(script, MODEL=glm53)
    assert argv[:2] == ["-m", "sglang.launch_server"]
    args = prepare_server_args(argv[2:])
    assert args.disaggregation_mode == mode
    assert TransferBackend(args.disaggregation_transfer_backend) is TransferBackend.GLM_PD
    assert args.page_size == 64 and args.tp_size == 8 and args.kv_cache_dtype == "fp8_e4m3"
    assert args.disaggregation_ib_device.split(",")[0] == "mlx5_0" and args.context_length == 1048576
    settings = {k: v for k, v in env.items() if k.startswith("SGLANG_GLM_PD_")}
    config = GlmPdSglangConfig.from_env(settings)
    assert config.transport == "mooncake"
    assert config.credential == env["GLM_PD_CREDENTIAL"]  # every rank authenticates with the deployment's key


@pytest.mark.parametrize("script", ["sglang/prefill.sh", "sglang/decode.sh"])
def test_every_rank_needs_the_deployment_key(run_recipe, glm53: str, script: str) -> None:
    with pytest.raises(AssertionError, match="GLM_PD_CREDENTIAL: the deployment key file"):
        run_recipe(script, MODEL=glm53, GLM_PD_CREDENTIAL="")


def test_tp_16_spans_two_nodes(run_recipe, glm53: str) -> None:
    """The H200 layout for 1M tokens: TP 16 over two nodes per instance, each node given its rank."""
    env = {"MODEL": glm53, "TP": "16", "NNODES": "2", "NODE_RANK": "1", "DIST_INIT_ADDR": "10.0.0.1:5000"}
    argv, _ = run_recipe("sglang/decode.sh", **env)
    args = prepare_server_args(argv[2:])
    assert (args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr) == (16, 2, 1, "10.0.0.1:5000")
    with pytest.raises(AssertionError, match="NODE_RANK: the rank of this node"):
        run_recipe("sglang/decode.sh", MODEL=glm53, TP="16", NNODES="2")


def test_default_model_is_glm53(run_recipe) -> None:
    argv, _ = run_recipe("sglang/prefill.sh")
    assert argv[argv.index("--model-path") + 1] == "zai-org/GLM-5.3-FP8"

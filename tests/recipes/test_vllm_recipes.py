"""recipes/vllm: each script's command line through vLLM 0.33's own `vllm serve` parser and config classes."""

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CUDA build infers a device for its defaults

from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

from glm_pd_vllm.config import GlmPdVllmConfig


def parse_serve(argv: list[str]):
    parser = FlexibleArgumentParser()
    cmd = ServeSubcommand()
    cmd.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    cmd.validate(args)
    AsyncEngineArgs.from_cli_args(args)  # every field lands in vLLM's engine arguments
    return args


@pytest.mark.parametrize(("script", "role"), [("vllm/prefill.sh", "kv_producer"), ("vllm/decode.sh", "kv_consumer")])
def test_serve_commands_parse(run_recipe, script: str, role: str) -> None:
    argv, env = run_recipe(script, NODE_IP="10.0.0.1")
    assert argv[:2] == ["serve", "zai-org/GLM-5.3-FP8"]
    args = parse_serve(argv)
    kv: KVTransferConfig = args.kv_transfer_config
    assert isinstance(kv, KVTransferConfig)
    assert (kv.kv_connector, kv.kv_connector_module_path, kv.kv_role) == (
        "GlmPdConnector",
        "glm_pd_vllm.connector",
        role,
    )
    config = GlmPdVllmConfig.from_extra(kv.kv_connector_extra_config)  # unknown keys or bad types would raise
    if role == "kv_producer":
        assert config.side_channel_host == "10.0.0.1" and config.side_channel_port == 5710
    assert args.tensor_parallel_size == 8 and args.block_size == 64 and args.kv_cache_dtype == "fp8"
    assert args.max_model_len == 1048576 and args.speculative_config["method"] == "mtp"
    assert env["UCX_TLS"] == "rc,cuda_ipc,cuda_copy" and env["UCX_NET_DEVICES"].startswith("mlx5_0:1")


def test_prefill_needs_its_address(run_recipe) -> None:
    with pytest.raises(AssertionError, match="NODE_IP: the address of this node"):
        run_recipe("vllm/prefill.sh", NODE_IP="")

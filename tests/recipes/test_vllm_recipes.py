"""recipes/vllm: each script's command line through vLLM 0.33's own `vllm serve` parser and config classes."""

import json
import os
import subprocess
import sys

import pytest

from glm_pd_vllm.config import GlmPdVllmConfig

# In a fresh process: the CUDA build picks its platform once, at first import, and needs to be told "cpu"
# for the defaults the parser computes (another test module may already have imported vLLM here).
PARSE = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
cmd = ServeSubcommand()
cmd.subparser_init(parser.add_subparsers(dest="subparser"))
args = parser.parse_args(json.loads(sys.argv[1]))
cmd.validate(args)
AsyncEngineArgs.from_cli_args(args)
kv = args.kv_transfer_config
print("PARSED " + json.dumps({
    "kv_type": type(kv).__name__, "kv_connector": kv.kv_connector, "module_path": kv.kv_connector_module_path,
    "kv_role": kv.kv_role, "extra": kv.kv_connector_extra_config, "tp": args.tensor_parallel_size,
    "dcp": args.decode_context_parallel_size,
    "block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len,
    "speculative_config": args.speculative_config, "model_tag": args.model_tag,
    "nnodes": args.nnodes, "node_rank": args.node_rank, "master_addr": args.master_addr, "headless": args.headless,
}))
"""


def parse_serve(argv: list[str]) -> dict:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", PARSE, json.dumps(argv)], env=env, capture_output=True, text=True, timeout=180
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PARSED ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][7:])


@pytest.mark.parametrize(("script", "role"), [("vllm/prefill.sh", "kv_producer"), ("vllm/decode.sh", "kv_consumer")])
def test_serve_commands_parse(run_recipe, script: str, role: str) -> None:
    argv, env = run_recipe(script, NODE_IP="10.0.0.1")
    assert argv[:2] == ["serve", "zai-org/GLM-5.3-FP8"]
    args = parse_serve(argv)
    assert args["kv_type"] == "KVTransferConfig" and args["model_tag"] == "zai-org/GLM-5.3-FP8"
    assert (args["kv_connector"], args["module_path"], args["kv_role"]) == (
        "GlmPdConnector",
        "glm_pd_vllm.connector",
        role,
    )
    config = GlmPdVllmConfig.from_extra(args["extra"])  # unknown keys or bad types would raise
    assert config.credential == env["GLM_PD_CREDENTIAL"]  # every node authenticates with the deployment's key
    if role == "kv_producer":
        assert config.side_channel_host == "10.0.0.1" and config.side_channel_port == 5710
    assert args["tp"] == 8 and args["dcp"] == 8 and args["block_size"] == 64 and args["kv_cache_dtype"] == "fp8"
    assert args["max_model_len"] == 1048576 and args["speculative_config"]["method"] == "mtp"
    assert env["UCX_TLS"] == "rc,cuda_ipc,cuda_copy" and env["UCX_NET_DEVICES"].startswith("mlx5_0:1")


@pytest.mark.parametrize("script", ["vllm/prefill.sh", "vllm/decode.sh"])
@pytest.mark.parametrize("node_rank", [0, 1])
def test_an_instance_spans_two_h100_nodes(run_recipe, script: str, node_rank: int) -> None:
    """TP 16 over two nodes (GLM-5.3-FP8's weights exceed 8 x H100): each node runs the script with its own rank;
    node 1 is headless, and each node's prefill ranks publish that node's own address."""
    node_ip = f"10.0.0.{11 + node_rank}"
    argv, env = run_recipe(script, NODE_IP=node_ip, NNODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="10.0.0.11")
    args = parse_serve(argv)
    assert (args["tp"], args["nnodes"], args["node_rank"], args["master_addr"]) == (16, 2, node_rank, "10.0.0.11")
    assert args["headless"] == (node_rank == 1)
    if script == "vllm/prefill.sh":
        assert GlmPdVllmConfig.from_extra(args["extra"], env).side_channel_host == node_ip


def test_a_two_node_instance_needs_node_0s_address(run_recipe) -> None:
    with pytest.raises(AssertionError, match="MASTER_ADDR: the address of node 0"):
        run_recipe("vllm/prefill.sh", NODE_IP="10.0.0.11", NNODES="2", NODE_RANK="1")


def test_dcp_1_runs_replicated(run_recipe) -> None:
    """The B200 variant: DCP=1 (a 1M-token request replicated fits its 180 GB)."""
    argv, _ = run_recipe("vllm/decode.sh", DCP="1")
    assert parse_serve(argv)["dcp"] == 1


def test_a_bad_flag_is_refused_by_vllm(run_recipe) -> None:
    argv, _ = run_recipe("vllm/decode.sh")
    argv[argv.index("--block-size") + 1] = "sixty-four"
    with pytest.raises(AssertionError, match="invalid int value"):
        parse_serve(argv)


def test_prefill_needs_its_address(run_recipe) -> None:
    with pytest.raises(AssertionError, match="NODE_IP: the address of this node"):
        run_recipe("vllm/prefill.sh", NODE_IP="")


@pytest.mark.parametrize("script", ["vllm/prefill.sh", "vllm/decode.sh"])
def test_every_node_needs_the_deployment_key(run_recipe, script: str) -> None:
    with pytest.raises(AssertionError, match="GLM_PD_CREDENTIAL: the deployment key file"):
        run_recipe(script, NODE_IP="10.0.0.1", GLM_PD_CREDENTIAL="")

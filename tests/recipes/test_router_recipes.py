"""recipes/sglang/router.sh and recipes/vllm/proxy.sh through sglang-router's and the proxy's own parsers."""

import sys
from pathlib import Path

from sglang_router.launch_router import parse_router_args

sys.path.insert(0, str(Path(__file__).parents[2] / "recipes" / "router"))
import pd_proxy


def test_sglang_router_pd_mode(run_recipe) -> None:
    argv, _ = run_recipe(
        "sglang/router.sh", PREFILLS="http://10.0.0.1:30000 http://10.0.0.3:30000", DECODES="http://10.0.0.2:30001"
    )
    assert argv[:2] == ["-m", "sglang_router.launch_router"]
    args = parse_router_args(argv[2:])
    assert args.pd_disaggregation
    assert args.prefill_urls == [("http://10.0.0.1:30000", 8998), ("http://10.0.0.3:30000", 8998)]
    assert args.decode_urls == ["http://10.0.0.2:30001"]


def test_vllm_proxy_lists(run_recipe) -> None:
    argv, _ = run_recipe(
        "vllm/proxy.sh", PREFILL_URLS="http://10.0.0.1:8100 http://10.0.0.3:8100", DECODE_URLS="http://10.0.0.2:8200"
    )
    assert argv[0].endswith("recipes/router/pd_proxy.py")
    args = pd_proxy.parse_args(argv[1:])
    assert args.prefill == ["http://10.0.0.1:8100", "http://10.0.0.3:8100"] and args.decode == ["http://10.0.0.2:8200"]
    assert args.host == "0.0.0.0" and args.timeout_s == 600

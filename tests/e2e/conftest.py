import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.scenarios import MAX_TOKENS, RUNS
from tests.support.tiny_mla_model import make_model
from tests.support.vllm_faults import CHUNK_TOKENS, FAULT_RUNS, FaultPair
from tests.support.vllm_harness import STAGED
from tests.support.vllm_servers import CORE, NO_AMX, START_S, Server, disaggregated, glm_pd_config


def _reference_runs(model: Path, logs: Path) -> dict[str, list[int]]:
    """Every prompt first through a pair over vLLM's own NixlConnector, which then stops: name -> tokens.
    The fault cases' prompts too, in the pass that runs them (the native one: test_engine_faults.py), through a
    second pair whose prefill chunks prompts as the fault pair's does: how a prompt is cut into steps changes
    the bf16 rounding of its KV, and this random-weight model's greedy tokens then part after ~100 steps.

    Running it beside the glm-pd pair starved them: on two cores, vLLM's processes spin (the worker busy-loops
    for 1 s after each message, the engine steps while a connector request is pending), and the connector's
    service threads then waited tens of seconds for CPU and GIL, so first handshakes outlived the lease."""
    out = _pair_runs(model, logs, [(name, prompt, MAX_TOKENS) for name, prompt in RUNS], {})
    if not NO_AMX:
        chunks = ("--max-num-batched-tokens", str(CHUNK_TOKENS))
        out |= _pair_runs(model, logs, FAULT_RUNS, {"ignore_eos": True}, *chunks)
    return out


def _pair_runs(
    model: Path, logs: Path, runs: list[tuple[str, list[int], int]], sampling: dict, *prefill_args: str
) -> dict[str, list[int]]:
    """``runs`` (name, prompt, max_tokens), greedy with ``sampling``, through a NixlConnector pair whose prefill
    also takes ``prefill_args``."""
    pair = {}
    for role, core in (("kv_producer", CORE["prefill"]), ("kv_consumer", CORE["decode"])):
        kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        env = {"VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        extra = prefill_args if role == "kv_producer" else ()
        name = f"vllm-nixl-{role}" + ("-chunked" if prefill_args else "")
        pair[role] = Server(name, model, logs, "--kv-transfer-config", json.dumps(kv), *extra, env=env)
    try:
        deadline = time.monotonic() + START_S
        for server in pair.values():
            server.wait_ready(deadline)
        out = {}
        for name, prompt, max_tokens in runs:
            tokens = disaggregated(pair["kv_producer"], pair["kv_consumer"], str(model), prompt, max_tokens, **sampling)
            out[name] = tokens["choices"][0]["token_ids"]
        return out
    finally:
        for server in pair.values():
            server.stop()


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The reference pair's runs, then a prefill and a decode server with GlmPdConnector between them."""
    model = make_model(tmp_path_factory.mktemp("tiny-mla"))
    logs = tmp_path_factory.mktemp("engine-logs")
    reference = _reference_runs(model, logs)
    kv = ("127.0.0.1", free_port())  # prefill's side channel: a streamed request's decode leg names it
    # prefill holds a staging buffer (it gathers slots only for a decode that asks: test_vllm_engine's staged one)
    producer = glm_pd_config("kv_producer", side_channel_host=kv[0], side_channel_port=kv[1], streamed=True, **STAGED)
    servers = {
        "prefill": Server(
            "prefill", model, logs, "--kv-transfer-config", producer, env={"VLLM_CPU_OMP_THREADS_BIND": CORE["prefill"]}
        ),
        "decode": Server(
            "decode",
            model,
            logs,
            "--kv-transfer-config",
            glm_pd_config("kv_consumer", streamed=True),
            "--enable-prompt-tokens-details",
            env={"VLLM_CPU_OMP_THREADS_BIND": CORE["decode"]},
        ),
    }
    try:
        deadline = time.monotonic() + START_S
        for server in servers.values():
            server.wait_ready(deadline)
        configured = {name: server.configured() for name, server in servers.items()}
        yield {
            **servers,
            "reference": reference,
            "model": str(model),
            "configured": configured,
            "logs": logs,
            "prefill_kv": kv,
        }
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="session")
def fault_pair(engines: dict) -> Iterator[FaultPair]:
    """The fault cases' own prefill and decode (tests/support/vllm_faults.py says which flags differ), started
    once the session pair serves, so the two starts do not share the two cores."""
    pair = FaultPair(Path(engines["model"]), engines["logs"])
    try:
        yield pair
    finally:
        pair.stop()

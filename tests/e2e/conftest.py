import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.scenarios import RUNS
from tests.support.tiny_mla_model import make_model
from tests.support.vllm_faults import FAULT_RUNS, FaultPair
from tests.support.vllm_servers import CORE, NO_AMX, START_S, Server, disaggregated, glm_pd_config


def _reference_runs(model: Path, logs: Path) -> dict[str, list[int]]:
    """Every prompt first through a pair over vLLM's own NixlConnector, which then stops: name -> tokens.
    The fault cases' prompts too, in the pass that runs them (the native one: test_engine_faults.py).

    Running it beside the glm-pd pair starved them: on two cores, vLLM's processes spin (the worker busy-loops
    for 1 s after each message, the engine steps while a connector request is pending), and the connector's
    service threads then waited tens of seconds for CPU and GIL, so first handshakes outlived the lease."""
    pair = {}
    for role, core in (("kv_producer", CORE["prefill"]), ("kv_consumer", CORE["decode"])):
        kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        env = {"VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        pair[role] = Server(f"vllm-nixl-{role}", model, logs, "--kv-transfer-config", json.dumps(kv), env=env)
    try:
        deadline = time.monotonic() + START_S
        for server in pair.values():
            server.wait_ready(deadline)
        out = {}
        for name, prompt in RUNS:
            tokens = disaggregated(pair["kv_producer"], pair["kv_consumer"], str(model), prompt)
            out[name] = tokens["choices"][0]["token_ids"]
        for name, prompt, max_tokens in [] if NO_AMX else FAULT_RUNS:
            tokens = disaggregated(
                pair["kv_producer"], pair["kv_consumer"], str(model), prompt, max_tokens, ignore_eos=True
            )
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
    producer = glm_pd_config("kv_producer", side_channel_host=kv[0], side_channel_port=kv[1], streamed=True)
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

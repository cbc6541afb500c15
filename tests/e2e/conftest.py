import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.scenarios import PLAIN_RUNS
from tests.support.tiny_mla_model import make_model

BLOCK = 32  # AMX_MLA takes block sizes that are multiples of 32
START_S = 300  # two servers starting at once on two cores
MAX_TOKENS = 12
# Each server's worker on a core of its own. With vLLM's default binding ("auto") both workers bound their
# OpenMP threads to both cores, and spinning OpenMP and shared-memory-queue threads (vLLM notes that
# os.sched_yield does not release the GIL) starved glm-pd's service threads: glm-pd's per-load phase log
# showed loads queued 1.3-1.6 s between vLLM's scheduler and the decode service, a release answered after
# 5 s, and first handshakes outliving the 30 s lease. One core each: queued ~2 ms, a handshake in ~6 ms.
CORE = {"prefill": "0", "decode": "1"}
TRANSPORT = os.environ.get("GLM_PD_E2E_TRANSPORT", "nixl")  # or mooncake


class Server:
    """One `python -m vllm.entrypoints.openai.api_server` (the `vllm` script looks up the name `vllm`)."""

    def __init__(self, name: str, model: Path, log_dir: Path, *extra: str, env: dict | None = None) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
            "--enforce-eager", "--block-size", str(BLOCK), "--port", str(self.port), "--host", "127.0.0.1",
            "--max-model-len", "2048", "--max-num-seqs", "4", *extra,
        ]  # fmt: skip
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOG_STATS_INTERVAL": "1", **(env or {})}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {START_S} s: {self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def complete(self, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def transfer_metrics(self, offset: int, loads: int, timeout_s: float = 20) -> dict[str, float]:
        """Sum GlmPdConnector's per-load log lines (``glm-pd decode: <id> loaded: main N B, ...``) written
        after ``offset``. vLLM's own "KV Transfer metrics" lines carry the same counts, but in one run the first
        load's line never came (its stats were not logged), so the connector's own line is what is counted."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log.read_text(errors="replace")[offset:]
            total: dict[str, float] = {"bytes_main": 0, "bytes_indexer": 0}
            for outcome, moved in re.findall(r"glm-pd decode: \S+ (loaded|failed): ([^;]*);", text):
                key = "loads_ok" if outcome == "loaded" else "loads_failed"
                total[key] = total.get(key, 0) + 1
                for kind, n in re.findall(r"(\w+) (\d+) B", moved):
                    total[f"bytes_{kind}"] = total.get(f"bytes_{kind}", 0) + int(n)
            if total.get("loads_ok", 0) + total.get("loads_failed", 0) >= loads or time.monotonic() > deadline:
                return total
            time.sleep(0.5)

    def log_size(self) -> int:
        return len(self.log.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _plain_runs(model: Path, logs: Path) -> dict[tuple[str, tuple[int, ...]], tuple[list[int], list[int]]]:
    """Every comparison run first, on a plain server alone, which then stops.

    Running it beside the PD pair starved them: on two cores, vLLM's processes spin (the worker busy-loops
    for 1 s after each message, the engine steps while a connector request is pending), and the connector's
    service threads then waited tens of seconds for CPU and GIL, so first handshakes outlived the lease."""
    plain = Server("plain", model, logs)
    try:
        plain.wait_ready(time.monotonic() + START_S)
        out = {}
        for salt, prompt in PLAIN_RUNS:
            body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "return_token_ids": True, "cache_salt": salt}  # fmt: skip
            cold = plain.complete(body)["choices"][0]["token_ids"]
            warm = plain.complete(body)["choices"][0]["token_ids"]
            out[salt, tuple(prompt)] = (cold, warm)
        return out
    finally:
        plain.stop()


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Plain runs, then a prefill and a decode server with GlmPdConnector between them, started once."""
    model = make_model(tmp_path_factory.mktemp("tiny-mla"))
    logs = tmp_path_factory.mktemp("engine-logs")
    plain = _plain_runs(model, logs)
    side = free_port()
    producer = {
        "kv_connector": "GlmPdConnector", "kv_connector_module_path": "glm_pd_vllm.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": side,
                                      "allow_tcp": True, "verify_checksums": True, "transport": TRANSPORT},
    }  # fmt: skip
    consumer = {**producer, "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"allow_tcp": True, "verify_checksums": True,
                                              "transport": TRANSPORT}}  # fmt: skip
    servers = {
        "prefill": Server(
            "prefill",
            model,
            logs,
            "--kv-transfer-config",
            json.dumps(producer),
            env={"VLLM_CPU_OMP_THREADS_BIND": CORE["prefill"]},
        ),
        "decode": Server(
            "decode",
            model,
            logs,
            "--kv-transfer-config",
            json.dumps(consumer),
            "--enable-prompt-tokens-details",
            env={"VLLM_CPU_OMP_THREADS_BIND": CORE["decode"]},
        ),
    }
    try:
        deadline = time.monotonic() + START_S
        for server in servers.values():
            server.wait_ready(deadline)
        yield {**servers, "plain": plain, "model": str(model)}
    finally:
        for server in servers.values():
            server.stop()

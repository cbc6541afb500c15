"""Real vLLM servers for the engine tests: one ``vllm.entrypoints.openai.api_server`` process per ``Server``, and
the router's flow between a prefill and a decode server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil

from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from tests.support.credential import suite_credential
from tests.support.ports import free_port
from tests.support.scenarios import MAX_TOKENS

BLOCK = 32  # asked for; AMX_MLA takes multiples of 32, and without AMX vLLM forces 16: read what it chose
START_S = 300  # two servers starting at once on two cores
# Each server's worker on a core of its own. With vLLM's default binding ("auto") both workers bound their
# OpenMP threads to both cores, and spinning OpenMP and shared-memory-queue threads (vLLM notes that
# os.sched_yield does not release the GIL) starved glm-pd's service threads: glm-pd's per-load phase log
# showed loads queued 1.3-1.6 s between vLLM's scheduler and the decode service, a release answered after
# 5 s, and first handshakes outliving the 30 s lease. One core each: queued ~2 ms, a handshake in ~6 ms.
CORE = {"prefill": "0", "decode": "1"}
TRANSPORT = os.environ.get("GLM_PD_E2E_TRANSPORT", "nixl")  # or mooncake
# GLM_PD_E2E_CPU=no-amx: every server sees a CPU without AMX (tests/support/no_amx), as CI's host may be.
NO_AMX = os.environ.get("GLM_PD_E2E_CPU", "") == "no-amx"
_NO_AMX_PATH = str(Path(__file__).parent / "no_amx")


class Server:
    """One `python -m vllm.entrypoints.openai.api_server` (the `vllm` script looks up the name `vllm`)."""

    def __init__(
        self,
        name: str,
        model: Path,
        log_dir: Path,
        *extra: str,
        env: dict | None = None,
        kv_cache_bytes: int | None = None,
    ) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
            "--enforce-eager", "--block-size", str(BLOCK), "--port", str(self.port), "--host", "127.0.0.1",
            "--max-model-len", "2048", "--max-num-seqs", "4", *extra,
        ]  # fmt: skip
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOG_STATS_INTERVAL": "1", **(env or {})}
        if kv_cache_bytes is not None:  # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (whole GiB) override it
            del full_env["VLLM_CPU_KVCACHE_SPACE"]
            cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        if NO_AMX:
            full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [_NO_AMX_PATH, os.environ.get("PYTHONPATH")]))
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
        """Sum GlmPdConnector's per-load log lines (``glm-pd decode: <id> loaded: main N B, ..., of which staged
        N B``) written after ``offset``. vLLM's own "KV Transfer metrics" lines carry the same counts, but in one
        run the first load's line never came (its stats were not logged), so the connector's own line is what is
        counted."""
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

    def configured(self) -> dict[str, int | bool]:
        """What this engine actually configured, from its own start-up log: vLLM's config line
        (``enable_prefix_caching=``) and GlmPdConnector's worker line (the page size it registered)."""
        text = self.log.read_text(errors="replace")
        caching = re.findall(r"enable_prefix_caching=(True|False)", text)
        out: dict[str, int | bool] = {"prefix_caching": caching[-1] == "True"}
        pages = re.findall(r"GlmPdConnector worker \S+: \d+ regions of (\d+)-token pages", text)
        if pages:
            out["block_size"] = int(pages[-1])
        capacity = re.findall(r"KV cache size: ([\d,]+) tokens", text)
        if capacity:
            out["kv_cache_tokens"] = int(capacity[-1].replace(",", ""))
        return out

    def scheduler_state(self) -> dict[str, float]:
        """vLLM's own scheduler gauges from ``/metrics``: ``running``, ``waiting``, ``waiting_capacity`` (no
        blocks or slots yet), ``waiting_deferred`` (e.g. loads in flight), ``kv_cache_usage`` (0..1), and its
        counter of tokens found in the local prefix cache, ``prefix_cache_hits``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        names = {
            "vllm:num_requests_running": "running",
            "vllm:num_requests_waiting": "waiting",
            "vllm:kv_cache_usage_perc": "kv_cache_usage",
            "vllm:prefix_cache_hits_total": "prefix_cache_hits",
        }
        out: dict[str, float] = {}
        for name, labels, value in re.findall(r"^(vllm:\w+)\{([^}]*)\} (\S+)$", text, re.M):
            reason = re.search(r'reason="(\w+)"', labels)
            if name == "vllm:num_requests_waiting_by_reason" and reason:
                out[f"waiting_{reason.group(1)}"] = float(value)
            elif name in names:
                out[names[name]] = float(value)
        return out

    def engine_alive(self) -> bool:
        """The API server runs, answers ``/health``, and its EngineCore process is among its children."""
        if self.proc.poll() is not None:
            return False
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
            core = any(" ".join(c.cmdline()).startswith("VLLM::EngineCore") for c in children)
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return core and r.status == 200
        except (psutil.Error, urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def connector_lines(self, offset: int, last: int = 40) -> str:
        """The last ``last`` lines glm-pd logged after ``offset`` (loads, refusals, handshakes): failure messages."""
        text = self.log.read_text(errors="replace")[offset:]
        lines = [line for line in text.splitlines() if re.search(r"glm-pd|GlmPdConnector|ERROR", line)]
        return "\n".join(lines[-last:])

    def engine_errors(self, offset: int) -> list[str]:
        """Log lines after ``offset`` that say the engine died or one of its assertions failed."""
        text = self.log.read_text(errors="replace")[offset:]
        return [line for line in text.splitlines() if re.search(r"EngineDeadError|AssertionError|^\s*assert ", line)]

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every process of this server (API server, EngineCore, workers): SIGSTOP freezes
        it as a host that stops answering would, SIGKILL takes it away."""
        os.killpg(self.proc.pid, sig)

    def log_size(self) -> int:
        return len(self.log.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a frozen server must be able to act on SIGTERM
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def glm_pd_config(role: str, **extra: object) -> str:
    """``--kv-transfer-config`` for GlmPdConnector in ``role`` (kv_producer | kv_consumer): TCP allowed, digests
    verified, the suite's transport and deployment key, and ``extra`` in ``kv_connector_extra_config``."""
    return json.dumps({
        "kv_connector": "GlmPdConnector", "kv_connector_module_path": "glm_pd_vllm.connector", "kv_role": role,
        "kv_connector_extra_config": {"allow_tcp": True, "verify_checksums": True, "transport": TRANSPORT,
                                      "credential": suite_credential(), **extra},
    })  # fmt: skip


def request(model: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **sampling: object) -> dict:
    """A greedy completion body that returns token ids."""
    return {"model": model, "prompt": prompt, "temperature": 0, "return_token_ids": True,
            "max_tokens": max_tokens, **sampling}  # fmt: skip


def prefill_leg(prefill: Server, body: dict) -> dict:
    """The router's first leg: prefill with ``do_remote_decode`` and ``max_tokens 1``; the params for decode."""
    first = prefill.complete({**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = first["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and first["choices"][0]["prompt_token_ids"] == body["prompt"]
    return params


def streamed(
    prefill: Server,
    kv: tuple[str, int],
    decode: Server,
    model: str,
    prompt: list[int],
    max_tokens: int = MAX_TOKENS,
    **sampling: object,
) -> dict:
    """The streamed router flow (recipes/router/pd_proxy.py --prefill-kv): both legs at once under one transfer
    id, decode's naming prefill's side channel ``kv``; decode's whole completion, once prefill's leg answered."""
    body = request(model, prompt, max_tokens, **sampling)
    transfer = uuid.uuid4().hex
    first: dict = {}
    leg = threading.Thread(
        target=lambda: first.update(
            prefill.complete(
                {
                    **body,
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "glm_pd_transfer_id": transfer},
                }
            )
        )
    )
    leg.start()
    params = {"do_remote_prefill": True, "glm_pd_protocol": PROTOCOL_VERSION, "glm_pd_transfer_id": transfer,
              "remote_host": kv[0], "remote_port": kv[1]}  # fmt: skip
    try:
        return decode.complete({**body, "kv_transfer_params": params})
    finally:
        leg.join(120)
        assert first.get("choices"), f"prefill's leg did not answer: {first}"


def disaggregated(
    prefill: Server, decode: Server, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **sampling: object
) -> dict:
    """The router's flow: prefill with ``do_remote_decode`` and ``max_tokens 1``, then decode with the returned
    ``kv_transfer_params``; decode's whole completion."""
    body = request(model, prompt, max_tokens, **sampling)
    return decode.complete({**body, "kv_transfer_params": prefill_leg(prefill, body)})

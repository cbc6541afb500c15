import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROC = Path(__file__).with_name("pd_proc.py")
_ports = itertools.count(20000 + (os.getpid() % 2000) * 10, 10)


def make_tiny_model(path: Path, **overrides) -> str:
    """A GLM-5.x-style config (6 layers, full layers 0-2 by index_topk_freq 4 / offset 3, one MTP layer)."""
    from transformers import AutoConfig

    fields = {
        "num_hidden_layers": 6,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "index_head_dim": 128,
        "index_n_heads": 2,
        "index_topk": 64,
        "index_topk_freq": 4,
        "index_skip_topk_offset": 3,
        "num_nextn_predict_layers": 1,
        "vocab_size": 512,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
    }
    fields.update(overrides)
    AutoConfig.for_model("glm_moe_dsa", **fields).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("glm5-tiny"))


@pytest.fixture(scope="session")
def tiny_model_other_layers(tmp_path_factory) -> str:
    """The same model with every layer full: a different indexer layer set, a byte-relevant difference."""
    return make_tiny_model(tmp_path_factory.mktemp("glm5-tiny-all-full"), index_topk_freq=1)


class Proc:
    def __init__(self, job: dict, stdin_line: str | None = None, log_dir: Path | None = None) -> None:
        self.log = (log_dir or Path("/tmp")) / f"{job['role']}-{job['port']}-{time.monotonic_ns()}.log"
        self.p = subprocess.Popen(
            [sys.executable, str(PROC), json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        if stdin_line is not None:
            self.p.stdin.write(stdin_line + "\n")
            self.p.stdin.flush()

    def read(self, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        for line in self.p.stdout:
            if line.startswith("PD "):
                return json.loads(line[3:])
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"pd_proc ended without a report (rc {self.p.poll()}): {self.log_tail()}")

    def log_tail(self) -> str:
        """glm-pd's own log lines (the engines' noise filtered out), for failure messages."""
        lines = [ln for ln in self.log.read_text().splitlines() if "glm" in ln.lower() or "Error" in ln]
        return "\n".join(lines[-40:])

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture
def pd(tiny_model, tmp_path):
    """Start instances of a prefill/decode pair; every process is killed at the end."""
    procs = []
    port = next(_ports)

    def start(role: str, stdin_line: str | None = None, **kw) -> Proc:
        job = {
            "role": role,
            "engine_id": "P" if role == "kv_producer" else "D",
            "model": tiny_model,
            "block_size": 64,
            "tp": 1,
            "num_blocks": 48,
            "port": port,
            "lease_s": 90.0,
            "wait_s": 150.0,
            "tokens": 1000,
            "prefix_tokens": 0,
            "requests": ["req-1"],
            "module_path": "glm_pd_vllm.connector",
            **kw,
        }
        proc = Proc(job, stdin_line, tmp_path)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.close()

"""What the vLLM suites and benchmarks share: the tiny GLM-5.x config and a handle on one ``vllm_pd_proc`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.lines import LineReader

REPO = Path(__file__).parents[2]


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


class Proc:
    """One vllm_pd_proc process (prefill or decode) given a JSON job; its reports are read with a deadline."""

    def __init__(self, job: dict, stdin_line: str | None = None, log_dir: Path | None = None) -> None:
        self.log = (log_dir or Path("/tmp")) / f"{job['role']}-{job['port']}-{time.monotonic_ns()}.log"
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.support.vllm_pd_proc", json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            cwd=REPO,
        )
        self.lines = LineReader(self.p.stdout)
        if stdin_line is not None:
            self.p.stdin.write(stdin_line + "\n")
            self.p.stdin.flush()

    def read(self, timeout: float = 180) -> dict:
        """The next ``PD {json}`` report line, waiting at most ``timeout`` seconds."""
        try:
            line = self.lines.next_matching(lambda ln: ln.startswith("PD "), timeout)
        except TimeoutError:
            line = None
        if line is None:
            raise RuntimeError(f"vllm_pd_proc gave no report (rc {self.p.poll()}): {self.log_tail()}")
        return json.loads(line[3:])

    def log_tail(self) -> str:
        """glm-pd's own log lines (the engines' noise filtered out), for failure messages."""
        lines = [ln for ln in self.log.read_text().splitlines() if "glm" in ln.lower() or "Error" in ln]
        return "\n".join(lines[-40:])

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()

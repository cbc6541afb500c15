"""What the vLLM suites and benchmarks share: the tiny GLM-5.x config and a handle on one ``vllm_pd_proc`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.lines import LineReader
from tests.support.tiny_glm import TINY_GLM

REPO = Path(__file__).parents[2]
# The connector's extra config that sends every transfer through staging slots of 64 KiB (tens per request,
# cutting runs mid-page); on host memory ``auto`` posts directly, so the staged cases say ``always``.
STAGED = {"staging": "always", "staging_mib": 1, "staging_slot_kib": 64}


def make_tiny_model(path: Path, **overrides) -> str:
    """A GLM-5.x-style config (6 layers, full layers 0-2 by index_topk_freq 4 / offset 3, one MTP layer)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in TINY_GLM.items() if k not in ("architectures", "model_type")}
    fields.update(overrides)
    AutoConfig.for_model("glm_moe_dsa", **fields).save_pretrained(path)
    return str(path)


class Proc:
    """One vllm_pd_proc process (prefill or decode) given a JSON job; its reports are read with a deadline."""

    def __init__(self, job: dict, log_dir: Path | None = None) -> None:
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

    def send(self, line: str) -> None:
        """One line on the process's stdin: decode's relay of prefill's params."""
        self.p.stdin.write(line + "\n")
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

"""The parent's end of the prefill process (``prefill``): started as ``python -m benchmarks.gpu_bench --child``,
spoken to by JSON lines, killed if it does not leave when told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.gpu.prefill import CHILD_TAG
from benchmarks.gpu.ranks import REPO, TIMEOUT_S


class Child:
    """The prefill process; ``hello`` is its first answer (its port, raw agent and reported path)."""

    def __init__(self, job: dict[str, Any]) -> None:
        from tests.support.lines import LineReader

        cmd = [sys.executable, "-m", "benchmarks.gpu_bench", "--child", json.dumps(job)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.lines = LineReader(self.proc.stdout)  # type: ignore[arg-type]  # a PIPE: never None
        self.hello = self._read(300, None)

    def _read(self, timeout_s: float, progress: Callable[[], object] | None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            wait_s = 0.002 if progress is not None else timeout_s
            try:
                line = self.lines.next_matching(lambda ln: ln.startswith(CHILD_TAG), wait_s)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the prefill process did not answer within {timeout_s:.0f} s") from None
                if progress is not None:
                    progress()
        if line is None:
            raise RuntimeError(f"the prefill process exited (rc {self.proc.wait()})")
        answer: dict[str, Any] = json.loads(line[len(CHILD_TAG) :])
        if "error" in answer:
            raise RuntimeError(f"prefill: {answer['error']}")
        return answer

    def _say(self, obj: dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def ask(
        self,
        cmd: dict[str, Any],
        progress: Callable[[], object] | None = None,
        landed: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """``cmd``'s answer; ``progress`` runs while waiting (decode's agent, when prefill WRITEs into it);
        ``landed`` answers each slot a staged push says it wrote, until the push's own answer comes."""
        self._say(cmd)
        while True:
            answer = self._read(TIMEOUT_S * 2, progress)
            if landed is None or "landed" not in answer:
                return answer
            self._say(landed(answer))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self._say({"op": "exit"})
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

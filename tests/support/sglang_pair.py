"""What the SGLang suites and benchmarks share: the tiny GLM-5.x config and a prefill/decode pair of processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from glm_pd_common.layout.geometry import ModelGeometry
from tests.support.credential import suite_credential
from tests.support.ports import free_port_range

REPO = Path(__file__).parents[2]


def full_layers(model: str) -> list[int]:
    return list(ModelGeometry.from_config(model, include_mtp=False).full_indexer_layers)


class Pair:
    """A prefill process and a decode process running one scenario against each other."""

    def __init__(self, tmp: Path, model: str) -> None:
        self.tmp, self.model = tmp, model

    def run(
        self,
        requests: list[dict],
        *,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        prefill_cp: int = 1,
        layer_split: bool = False,
        prefill_env: dict | None = None,
        decode_env: dict | None = None,
        decode_row_bytes: int = 656,
        env: dict | None = None,
        timeout_s: float = 240,
        room_timeout_s: float = 20.0,
        linger_s: float = 2.0,
        prefill_exits: bool = False,
        pool_pages: int = 48,
        e2e: dict | None = None,
        more_decodes: tuple[list[dict], ...] = (),
        draft: bool = True,
        device: int | None = None,
        prefill_hosts: list[str] | None = None,
    ) -> tuple[dict | None, dict]:
        """Prefill serves ``requests``; each of ``more_decodes`` is another decode engine with its own rooms
        (their reports land in ``self.more``), and the first decode engine takes the remaining rooms."""
        port = free_port_range(8)
        common = {
            "model": self.model,
            "full_layers": full_layers(self.model),
            "bootstrap_port": port,
            "page_size": 64,
            "requests": requests,
            "timeout_s": room_timeout_s,  # decode's wait for one room
            "pool_pages": pool_pages,
            "e2e": e2e,
            "draft": draft,  # both sides run a drafter (the MTP layer's caches)
            "device": device,  # glm-pd's threads set up as if the ranks' caches sat on this CUDA device
        }
        base_env = {"SGLANG_GLM_PD_ALLOW_TCP": "1", "SGLANG_GLM_PD_TRANSPORT": "nixl",
                    "SGLANG_GLM_PD_CREDENTIAL": suite_credential(), **(env or {})}  # fmt: skip
        configs = {
            "prefill": {**common, "role": "prefill", "tp": prefill_tp, "env": {**base_env, **(prefill_env or {})},
                        "linger_s": linger_s, "cp": prefill_cp, "layer_split": layer_split,
                        "rank_hosts": prefill_hosts},
            "decode": {**common, "role": "decode", "tp": decode_tp, "env": {**base_env, **(decode_env or {})},
                       "row_bytes": decode_row_bytes},
        }  # fmt: skip
        others = {r["room"] for more in more_decodes for r in more}
        configs["decode"]["requests"] = [r for r in requests if r["room"] not in others]
        for i, more in enumerate(more_decodes, start=1):
            configs[f"decode{i}"] = {**configs["decode"], "requests": more, "seed": i}
        procs = {}
        for role, cfg in configs.items():
            cfg["out"] = str(self.tmp / f"{role}-{port}.json")
            path = self.tmp / f"{role}-{port}-config.json"
            path.write_text(json.dumps(cfg))
            log = open(self.tmp / f"{role}-{port}.log", "w")  # noqa: SIM115 (closed below, after the process)
            procs[role] = (
                subprocess.Popen(
                    [sys.executable, "-m", "tests.support.sglang_proc", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                ),
                log,
            )
        try:
            for proc, _ in procs.values():
                proc.wait(timeout=timeout_s)
        finally:
            for proc, log in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        reports: list[dict | None] = []
        for role in configs:
            out = Path(configs[role]["out"])
            if role == "prefill" and prefill_exits:
                assert not out.exists(), "prefill was to exit mid-handoff but finished"
                reports.append(None)
                continue
            if not out.exists():
                logs = (self.tmp / f"{role}-{port}.log").read_text()[-6000:]
                raise AssertionError(f"{role} wrote no report; its log ends:\n{logs}")
            reports.append(json.loads(out.read_text()))
        self.more = reports[2:]
        return reports[0], reports[1]

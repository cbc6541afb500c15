"""A process that exits with glm-pd services still open exits cleanly: its services are closed first.

Python cuts daemon threads off as they take the GIL back after finalization began; one inside a NIXL call
then unwinds through C++ frames that may not throw, and the process aborts (seen at the end of a test run whose
refused start-up left a prefill service polling NIXL). The child below leaves a prefill and a decode service open
and, in a handler registered before theirs (``atexit`` runs last-registered first), reports which glm-pd threads
still run once the services' own handlers ran: none may.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import atexit, json, threading
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.spec import CacheSpec

def report():
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("glm-pd") and t.is_alive())
    print("ALIVE " + json.dumps(names), flush=True)

atexit.register(report)  # before the services register theirs: runs after them
from tests.support.services import Decode, Prefill
spec = CacheSpec.create(ModelGeometry.from_config({
    "model_type": "glm_moe_dsa", "num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "index_head_dim": 128, "num_nextn_predict_layers": 0, "index_topk_pattern": "FS"}))
prefill, decode = Prefill(spec), Decode(spec)
result = decode.load(prefill, "left-open", 100)
assert result.ok, result
names = sorted(t.name for t in threading.enumerate() if t.name.startswith("glm-pd"))
print("RUNNING " + json.dumps(names), flush=True)
"""


def test_services_left_open_are_closed_before_the_interpreter_finalizes() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'common'}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    lines = {ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1]) for ln in out.stdout.splitlines() if " [" in ln}
    assert out.returncode == 0, out.stderr[-2000:]
    assert "terminate called" not in out.stderr
    running = lines["RUNNING"]
    assert any(n.startswith("glm-pd-prefill") for n in running) and any(n.startswith("glm-pd-decode") for n in running)
    assert lines["ALIVE"] == [], lines["ALIVE"]

"""On two GPUs: glm-pd's threads open no CUDA context on GPU 0 for a rank whose caches sit on GPU 1.

A child process puts its caches on GPU 1, then starts a lane (``LanePool``, as decode's loads and SGLang's
transfers run) with the setup ``thread_device`` derives from the regions; the lane queries a CUDA event and pins
a staging buffer, as the services do. The driver then says whether GPU 0's primary context was brought up
(``cuDevicePrimaryCtxGetState``). The control runs the same lane without the setup, and must open it.
Skipped without CUDA, and on one GPU (there is no other device to stray to).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2,
        reason="needs two GPUs: on one, every thread's default device is the rank's own",
    ),
]

CHILD = """
import ctypes, dataclasses, sys, threading
import torch
from glm_pd_common.handoff.lanes import LanePool
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.devices import thread_device

torch.cuda.set_device(1)
cache = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:1")
spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
regions = [dataclasses.replace(r, base_addr=cache.data_ptr(), mem_kind="VRAM", device_id=1)
           for r in HostCaches(spec, page_tokens=64, num_pages=1).regions[:1]]
event = torch.cuda.Event()
event.record()
done = threading.Event()

def job(_):
    event.query()
    torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    done.set()

start = thread_device(regions, torch) if sys.argv[1] == "setup" else None
pool = LanePool("glm-pd-test", job, count=1, start=start)
pool.submit("k", 0)
assert done.wait(60)
pool.close(5)
cuda = ctypes.CDLL("libcuda.so.1")
dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
print("GPU0_ACTIVE", active.value)
"""


def _gpu0_opened(mode: str) -> bool:
    repo = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, cwd=repo, check=False
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("GPU0_ACTIVE")), None)
    assert line is not None, done.stderr[-3000:]
    return line.split()[1] == "1"


def test_a_lane_on_the_rank_device_leaves_gpu0_alone() -> None:
    assert not _gpu0_opened("setup")


def test_control_a_lane_without_the_setup_opens_gpu0() -> None:
    assert _gpu0_opened("bare")

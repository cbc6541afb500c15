"""On a GPU: a glm-pd thread's staging copies and digests do not queue behind the engine's forward steps.

The engine queues its steps on the device's default stream. Here that stream is held by construction: a host
function queued on it (``cuLaunchHostFunc``) does not return until the test lets it, so nothing queued there
after it can run, however loaded the machine. Then a lane started with ``thread_device``'s setup (as every thread
glm-pd starts) gathers a slot and digests it with the kernel's reader: it must finish, byte-exact, while the
stream is still held. The control runs the same lane without the setup: on the default stream it cannot finish
until the hold is let go (checked for 2 s, then let go, then it finishes), which shows the default stream orders
work behind the engine's here. Skipped without CUDA.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
CONTROL_WAIT_S = 2.0  # the control's lane must not finish while the stream is held (it cannot, however long)


def _hold_default_stream(release: threading.Event) -> object:
    """Queues on the current device's default (legacy) stream a host function that returns once ``release`` is
    set; returns the callback, to be kept alive until then."""
    cuda = ctypes.CDLL("libcuda.so.1")
    held = HOST_FN(lambda _: release.wait(120) and None)
    status = cuda.cuLaunchHostFunc(ctypes.c_void_p(0), held, None)  # stream 0: the legacy default stream
    assert status == 0, f"cuLaunchHostFunc: CUDA error {status}"
    return held


def _lane_work(with_setup: bool) -> tuple[bool, bool, bool]:
    """(the lane's work returned while the default stream was held, the slot is byte-exact, the digest is right)."""
    from glm_pd_common.handoff.lanes import LanePool
    from glm_pd_common.layout.digest_words import digest_bytes
    from glm_pd_common.tools.flat import flat_span
    from glm_pd_common.transport.base import Span
    from glm_pd_common.transport.devices import thread_device
    from glm_pd_common.transport.staging import TorchMover
    from glm_pd_common.transport.torch_memory import TorchMemory, digest_kernel

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(11)
    cache = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device=device, generator=gen)
    slot = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    region = flat_span(cache.data_ptr(), cache.numel(), "VRAM", device.index)
    spans = [Span("cache", cache.data_ptr(), cache.numel(), "VRAM", device.index),
             Span("slot", slot.data_ptr(), slot.numel(), "VRAM", device.index)]  # fmt: skip
    starts = np.random.default_rng(5).permutation(np.arange(0, 4 << 20, 8448))[:100]
    starts = starts[starts + 8448 <= cache.numel()]
    addrs, lengths = cache.data_ptr() + starts.astype(np.int64), np.full(starts.size, 8448, dtype=np.int64)
    expected = torch.cat([cache[s : s + 8448] for s in starts.tolist()])
    want = digest_bytes(expected.cpu().numpy())
    mover, reader = TorchMover(torch, spans), TorchMemory(torch, kernel=digest_kernel())
    reader.check_kernel(device)  # built before the stream is held
    torch.cuda.synchronize(device)

    release, finished = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def job(_: object) -> None:
        mover.gather(addrs, lengths, slot.data_ptr())
        outcome["digest"] = reader.digest(region, starts.astype(np.int64), lengths)
        finished.set()

    held = _hold_default_stream(release)  # the engine's queued forward, held until let go
    pool = LanePool("glm-pd-stream-test", job, count=1, start=thread_device([region], torch) if with_setup else None)
    try:
        pool.submit("k", 0)
        beside = finished.wait(60 if with_setup else CONTROL_WAIT_S)
        release.set()
        assert finished.wait(60), "the lane's work did not return once the default stream was let go"
    finally:
        release.set()
        pool.close(5)
    torch.cuda.synchronize(device)
    del held
    exact = torch.equal(slot[: expected.numel()], expected)
    return beside, exact, outcome["digest"] == want


def test_a_glm_pd_thread_gathers_and_digests_beside_the_engine_stream() -> None:
    beside, exact, digest_ok = _lane_work(with_setup=True)
    assert exact and digest_ok
    assert beside, "the gather and digest waited for the work held on the default stream"


def test_control_on_the_default_stream_the_gather_waits_for_the_engine() -> None:
    beside, exact, digest_ok = _lane_work(with_setup=False)
    assert exact and digest_ok
    assert not beside, "the lane finished while the default stream was held: the premise does not hold here"

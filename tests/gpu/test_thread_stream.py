"""On a GPU: a glm-pd thread's staging copies and digests do not queue behind the engine's forward steps.

The engine queues its steps on the device's default stream. A long kernel stands in for them there (a GPU sleep
of a few seconds, recorded by an event); then a lane started with ``thread_device``'s setup (as every thread
glm-pd starts) gathers a slot and digests it with the kernel's reader. Both must return, byte-exact, while the
sleep is still running. The control runs the same lane without the setup: on the default stream its gather
waits for the sleep, which shows the premise (the default stream orders work behind the engine's) holds here.
Skipped without CUDA.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLEEP_CYCLES = 10_000_000_000  # about 5 s at an H100/H200 clock: far longer than a 1 MiB gather and digest


def _lane_work(with_setup: bool) -> tuple[bool, bool, bool]:
    """(the engine's sleep still ran when the lane's work returned, the slot is byte-exact, the digest is right)."""
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
    reader.check_kernel(device)  # built before the sleep is queued (a build waits for nothing on the device)
    torch.cuda.synchronize(device)

    torch.cuda._sleep(SLEEP_CYCLES)  # the engine's queued forward
    engine = torch.cuda.Event()
    engine.record()
    outcome: dict[str, object] = {}
    finished = threading.Event()

    def job(_: object) -> None:
        mover.gather(addrs, lengths, slot.data_ptr())
        outcome["digest"] = reader.digest(region, starts.astype(np.int64), lengths)
        outcome["sleeping"] = not engine.query()
        finished.set()

    pool = LanePool("glm-pd-stream-test", job, count=1, start=thread_device([region], torch) if with_setup else None)
    try:
        pool.submit("k", 0)
        assert finished.wait(60), "the lane's work did not return"
    finally:
        pool.close(5)
    torch.cuda.synchronize(device)
    exact = torch.equal(slot[: expected.numel()], expected)
    return bool(outcome["sleeping"]), exact, outcome["digest"] == want


def test_a_glm_pd_thread_gathers_and_digests_beside_the_engine_stream() -> None:
    sleeping, exact, digest_ok = _lane_work(with_setup=True)
    assert exact and digest_ok
    assert sleeping, "the gather and digest waited for the kernel queued on the default stream"


def test_control_on_the_default_stream_the_gather_waits_for_the_engine() -> None:
    sleeping, exact, digest_ok = _lane_work(with_setup=False)
    assert exact and digest_ok
    assert not sleeping

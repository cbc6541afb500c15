"""The demo's GPU staging mover (``tools.devicemem.DriverMover``) on host memory: a test double stands in for the
CUDA driver (no GPU here), copying with ``ctypes.memmove`` and recording each call, so what the mover asks the
driver for is checked against numpy's gather (``HostMover``) byte for byte. On a GPU, ``tests/gpu/test_demo_device``
runs the same mover through the real driver."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from glm_pd_common.tools.devicemem import DriverMover
from glm_pd_common.transport.base import Span
from glm_pd_common.transport.staging import HostMover


class MemmoveDevice:
    """Test double of ``CudaDevice``'s copy calls over host addresses (a copy lands when queued)."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int, int]] = []
        self.synced: list[int] = []
        self.streams = 0
        self.current: set[int] = set()
        self._lock = threading.Lock()

    def make_current(self) -> None:
        self.current.add(threading.get_ident())

    def new_stream(self) -> int:
        with self._lock:
            self.streams += 1
            return self.streams

    def copy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        assert threading.get_ident() in self.current, "a copy from a thread the device was not made current on"
        ctypes.memmove(dst, src, size)
        with self._lock:
            self.copies.append((dst, src, size, stream))

    def synchronize(self, stream: int) -> None:
        with self._lock:
            self.synced.append(stream)


def _setup(seed: int, size: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, MemmoveDevice, DriverMover]:
    """Random bytes, ``count`` disjoint 64-byte runs over them in random order, about a third of them right after
    the run before them (joinable), and a mover over the test double."""
    rng = np.random.default_rng(seed)
    space = rng.integers(0, 256, size=size, dtype=np.uint8)
    rows: list[int] = []
    for start in (rng.choice(space.size // 128, size=count, replace=False) * 2).tolist():
        rows.append(start)
        if rng.random() < 0.35:
            rows.append(start + 1)  # starts are even: an odd row is only ever its start's follower
    addrs = space.ctypes.data + np.array(rows, dtype=np.int64) * 64
    device = MemmoveDevice()
    return space, addrs, np.full(len(rows), 64, dtype=np.int64), device, DriverMover(device)  # type: ignore[arg-type]


def test_driver_gather_and_scatter_equal_numpys_with_adjacent_runs_joined():
    space, addrs, lengths, device, mover = _setup(7, 1 << 16, 300)
    slot, expected = np.zeros(int(lengths.sum()), np.uint8), np.zeros(int(lengths.sum()), np.uint8)
    HostMover([Span("space", space.ctypes.data, space.size), Span("s", expected.ctypes.data, expected.size)]).gather(
        addrs, lengths, expected.ctypes.data
    )
    mover.gather(addrs, lengths, slot.ctypes.data)
    assert np.array_equal(slot, expected)
    # a run joins the one before it when both its page and its slot place follow on: count those by hand
    follows = np.count_nonzero(addrs[1:] == addrs[:-1] + 64)
    assert follows > 0 and len(device.copies) == addrs.size - follows
    assert device.synced == [1] and {c[3] for c in device.copies} == {1}

    target = np.zeros_like(space)
    mover.scatter(slot.ctypes.data, addrs - space.ctypes.data + target.ctypes.data, lengths)
    written = np.zeros(space.size, dtype=bool)
    for a in (addrs - space.ctypes.data).tolist():
        written[a : a + 64] = True
    assert np.array_equal(target[written], space[written]) and not target[~written].any()


def test_each_thread_copies_on_a_stream_of_its_own_made_current_first():
    _space, addrs, lengths, device, mover = _setup(8, 1 << 14, 40)  # _space: held while its addresses are read
    slots = [np.zeros(int(lengths.sum()), np.uint8) for _ in range(2)]
    threads = [threading.Thread(target=mover.gather, args=(addrs, lengths, s.ctypes.data)) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mover.gather(addrs, lengths, slots[0].ctypes.data)  # this thread's own, then reused
    mover.gather(addrs, lengths, slots[0].ctypes.data)
    assert sorted(device.synced) == [1, 2, 3, 3] and device.streams == 3
    assert all(np.array_equal(s, slots[0]) for s in slots)

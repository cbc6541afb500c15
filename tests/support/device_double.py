"""Test doubles for torch's CUDA device selection and events (no GPU here), to see which device each call ran on.

CUDA's runtime starts every thread on device 0, and a call there opens GPU 0's context; so each double notes,
per call, the calling thread and the device that thread had selected (0 until it calls ``set_device``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from glm_pd_common.layout.regions import Region
from glm_pd_common.transport.devices import ThreadSetup, thread_device
from glm_pd_common.transport.memory import HOST


@dataclass
class DeviceDouble:
    calls: list[tuple[str, str, int]] = field(default_factory=list)  # (thread name, call, device selected)
    _here: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def torch(self) -> Any:
        """What ``thread_device`` takes for the engine's ``torch`` module."""
        cuda = SimpleNamespace(set_device=self.set_device, current_device=self.current_device)
        cuda.Stream, cuda.set_stream = Stream, self.set_stream
        return SimpleNamespace(cuda=cuda)

    def set_device(self, device: int) -> None:
        self._here.device = int(device)
        self.note("set_device")

    def current_device(self) -> int:
        return int(getattr(self._here, "device", 0))

    def set_stream(self, stream: Stream) -> None:
        """Notes the stream's device (it must be the thread's) and keeps the stream as the thread's current one."""
        self._here.stream = stream
        with self._lock:
            self.calls.append((threading.current_thread().name, "set_stream", stream.device))

    def current_stream(self) -> Stream | None:
        """The stream this thread set (None: the device's default stream)."""
        return getattr(self._here, "stream", None)

    def note(self, call: str) -> None:
        with self._lock:
            self.calls.append((threading.current_thread().name, call, self.current_device()))

    def event(self) -> Event:
        return Event(self)

    def setup_for(self, regions: list[Region], device_id: int) -> ThreadSetup:
        """The core's setup for these regions as if they lived in VRAM on ``device_id``."""
        vram = [replace(r, mem_kind="VRAM", device_id=device_id) for r in regions]
        return thread_device(vram, self.torch)

    def off_main(self, call: str) -> list[tuple[str, int]]:
        """(thread, device) of every ``call`` made on a thread other than the caller's main thread."""
        main = threading.main_thread().name
        return [(name, dev) for name, what, dev in self.calls if what == call and name != main]


@dataclass(eq=False)
class Stream:
    """A new stream from torch's pool on ``device`` (a distinct object each time, as torch's pool hands them out)."""

    device: int


class Event:
    """A completed CUDA event that notes every query and synchronize."""

    def __init__(self, devices: DeviceDouble) -> None:
        self.devices = devices

    def query(self) -> bool:
        self.devices.note("event.query")
        return True

    def synchronize(self) -> None:
        self.devices.note("event.synchronize")


class NotingReader:
    """The host reader, noting each digest where a device's digest kernels would run (a test double for it)."""

    def __init__(self, devices: DeviceDouble) -> None:
        self.devices = devices

    def digest(self, region: Region, offsets: np.ndarray, lengths: np.ndarray) -> int:
        self.devices.note("copy")
        return HOST.digest(region, offsets, lengths)

    def word_sum(self, region: Region, offsets: np.ndarray, lengths: np.ndarray, first_byte: int) -> int:
        self.devices.note("copy")
        return HOST.word_sum(region, offsets, lengths, first_byte)


def concurrent_misses(digest: Callable[[int], int], expected: list[int], rounds: int = 40) -> list[int]:
    """Run ``digest(i)`` ``rounds`` times on one thread per lane ``i`` (all at once); the lanes whose result
    differed from ``expected[i]``, once per miss."""
    wrong: list[int] = []

    def lane(i: int) -> None:
        for _ in range(rounds):
            if digest(i) != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(len(expected))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wrong

"""The demo's caches in GPU memory (``glm-pd demo --device cuda[:N]``): the content math of ``HostCaches`` over a
host mirror, copied to the device after each write and back before each check, so the bytes that move between
the two processes are VRAM's. Digests read it through the driver into a buffer of the reading thread's own, and
staging slots are gathered and scattered by driver copies (the core imports no torch)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from glm_pd_common.layout.pages import coalesce
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.cuda_driver import CudaDevice
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.base import Span, Transport
from glm_pd_common.transport.memory import Copier
from glm_pd_common.transport.staging import StageMode, Staging


class DeviceCaches(HostCaches):
    """One rank's caches on ``device``; ``regions`` describe the device buffers (VRAM, the device's index)."""

    def __init__(self, spec: CacheSpec, *, page_tokens: int, num_pages: int, device: CudaDevice) -> None:
        super().__init__(spec, page_tokens=page_tokens, num_pages=num_pages)
        self.device = device
        self.pointers = {key: device.alloc(buf.nbytes) for key, buf in self.buffers.items()}
        self.regions = [
            dataclasses.replace(r, base_addr=self.pointers[r.key], mem_kind="VRAM", device_id=device.index)
            for r in self.regions
        ]
        self.upload()

    def upload(self) -> None:
        for key, buf in self.buffers.items():
            self.device.upload(self.pointers[key], buf)

    def download(self) -> None:
        for key, buf in self.buffers.items():
            self.device.download(buf, self.pointers[key])

    def write_tokens(self, page_table: np.ndarray, start: int, end: int, *, seed: int) -> None:
        super().write_tokens(page_table, start, end, seed=seed)
        self.upload()

    def flip(self, region: Region, offset: int) -> None:
        self.download()
        super().flip(region, offset)
        self.upload()

    def mismatched_tokens(self, page_table: np.ndarray, start: int, end: int, *, seed: int) -> list[str]:
        self.download()
        return super().mismatched_tokens(page_table, start, end, seed=seed)

    def equal_bytes(self, page_table: np.ndarray, start: int, end: int, *, seed: int) -> int:
        self.download()
        return super().equal_bytes(page_table, start, end, seed=seed)


def driver_copier(device: CudaDevice) -> Copier:
    """A ``Copier`` for ``StagedMemory`` over ``device``: one device-to-host copy per run, into a host buffer of
    the calling thread's own (threads digesting at once never share one)."""
    mine = threading.local()

    def copy(region: Region, offsets: np.ndarray, lengths: np.ndarray) -> memoryview:
        device.make_current()
        total = int(lengths.sum())
        host: np.ndarray | None = getattr(mine, "buffer", None)
        if host is None or host.size < total:
            host = mine.buffer = np.empty(total, dtype=np.uint8)
        at = 0
        for off, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
            device.download(host[at : at + n], region.base_addr + off)
            at += n
        return host[:total].data

    return copy


class DriverMover:
    """A staging ``Mover`` over one GPU's memory through the driver: a slot's runs, those adjacent on both sides
    joined, queued as device-to-device copies on a stream of the calling thread's own and waited for before the
    call returns. One driver call per run (a few µs): an engine's torch mover gathers a slot with one kernel; this
    one gives the demo, which has no torch, the engines' staged protocol on a GPU, not their speed."""

    def __init__(self, device: CudaDevice) -> None:
        self._device = device
        self._mine = threading.local()  # .stream: this thread's

    def _copy(self, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
        device = self._device
        device.make_current()
        stream: int | None = getattr(self._mine, "stream", None)
        if stream is None:
            stream = self._mine.stream = device.new_stream()
        src, dst, lengths = coalesce(src, dst, lengths)
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
            device.copy_async(d, s, n, stream)
        device.synchronize(stream)

    def gather(self, addrs: np.ndarray, lengths: np.ndarray, into: int) -> None:
        self._copy(into + np.cumsum(lengths) - lengths, addrs, lengths)

    def scatter(self, source: int, addrs: np.ndarray, lengths: np.ndarray) -> None:
        self._copy(addrs, source + np.cumsum(lengths) - lengths, lengths)


def device_staging(
    device: CudaDevice, transport: Transport, *, slot_bytes: int, pairs: int, mode: StageMode
) -> Staging:
    """A staging buffer on ``device`` (held until the process exits, as the demo's caches are), registered with
    ``transport``; its slots moved by ``DriverMover``."""
    size = 2 * slot_bytes * pairs
    span = Span("staging", device.alloc(size), size, "VRAM", device.index)
    transport.register([span])
    return Staging(span, slot_bytes, DriverMover(device), mode)

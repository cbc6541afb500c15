"""How digests read the bytes of a region: host memory through a view, device memory staged to the host.

A digest must never dereference a device address from the CPU (on VRAM that is a segfault, not an error).
``HostMemory`` reads DRAM and refuses anything else by name; ``StagedMemory`` copies device runs into a host
buffer, many runs per copy, and hashes them there, so a digest of a region is the same number whichever
memory holds it and whichever peer computes it. The copy itself comes from the engine's process: the core
never imports torch, so an adapter hands its ``torch`` module to ``cuda_copier``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.slots import pack_runs

# copy(region, byte_offsets, lengths) -> the runs' bytes concatenated in order, in host memory (valid until the
# next call); the runs of one call add up to at most the reader's staging size
Copier = Callable[[Region, np.ndarray, np.ndarray], memoryview]
STAGING_BYTES = 64 << 20


class MemoryReader(Protocol):
    """Reads registered memory for digests."""

    def chunks(self, region: Region, offsets: np.ndarray, lengths: np.ndarray) -> Iterator[memoryview]:
        """The bytes of ``region``'s runs, concatenated in run order, as one or more host buffers."""
        ...

    def can_read(self, mem_kind: str) -> bool: ...


def _host_view(addr: int, length: int) -> memoryview:
    """A zero-copy view of host memory; the caller guarantees the range lies in a registered region."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


class HostMemory:
    """DRAM only: anything else is refused, naming the region and its memory."""

    def can_read(self, mem_kind: str) -> bool:
        return mem_kind == "DRAM"

    def _check(self, region: Region) -> None:
        if region.mem_kind != "DRAM":
            raise ConfigError(
                f"region {region.name} is {region.mem_kind} on device {region.device_id}: its digest cannot be read "
                "through a host pointer, and this rank has no device reader (the adapter passes one when it runs "
                "with torch on CUDA)"
            )

    def chunks(self, region: Region, offsets: np.ndarray, lengths: np.ndarray) -> Iterator[memoryview]:
        self._check(region)
        for off, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
            yield _host_view(region.base_addr + off, n)


HOST = HostMemory()


class StagedMemory(HostMemory):
    """DRAM as ``HostMemory``; device memory copied to the host (``copy``) one slot of ``staging_bytes`` at a time
    (``layout.slots``), so a region's digest costs one device-to-host copy per ``staging_bytes``."""

    def __init__(self, copy: Copier, *, staging_bytes: int = STAGING_BYTES) -> None:
        self._copy = copy
        self.staging_bytes = staging_bytes

    def can_read(self, mem_kind: str) -> bool:
        return True

    def chunks(self, region: Region, offsets: np.ndarray, lengths: np.ndarray) -> Iterator[memoryview]:
        if region.mem_kind == "DRAM":
            yield from super().chunks(region, offsets, lengths)
            return
        packed = pack_runs(offsets, lengths, self.staging_bytes)
        for k in range(packed.num_slots):
            yield self._copy(region, packed.offsets[packed.slot(k)], packed.lengths[packed.slot(k)])


class DeviceBytes:
    """A raw device range as the CUDA array interface describes it, so torch wraps it without a copy."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (addr, False), "version": 3}


def cuda_copier(torch: Any) -> Copier:
    """A ``Copier`` over CUDA memory, built from the engine's ``torch`` module (the core imports no torch).

    Each run is wrapped in place (no device copy) and copied into a pinned host buffer of the calling thread's on
    the current stream of the region's device; the stream is waited for before the bytes are handed out. One buffer
    per thread: lanes digesting at once through one shared buffer overwrote each other's bytes (70 of 80 digests
    wrong on an H200)."""
    mine = threading.local()  # .buffer: this thread's pinned buffer, grown to the largest batch it asked for

    def copy(region: Region, offsets: np.ndarray, lengths: np.ndarray) -> memoryview:
        total = int(lengths.sum())
        device = torch.device("cuda", region.device_id)
        with torch.cuda.device(device):  # pinning, too, is a CUDA call: never on the thread's default device
            host = getattr(mine, "buffer", None)
            if host is None or host.numel() < total:
                host = mine.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            at = 0
            for off, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
                src = torch.as_tensor(DeviceBytes(region.base_addr + off, n), device=device)
                host[at : at + n].copy_(src, non_blocking=True)
                at += n
            torch.cuda.current_stream(device).synchronize()
        return memoryview(host[:total].numpy())

    return copy


def reader_for(mem_kinds: Iterable[str], torch: Any) -> MemoryReader:
    """What an adapter gives its endpoint: host reads when every region is DRAM, else device staging through
    the engine's ``torch`` (called only when ``torch`` has CUDA: a CPU engine's regions are DRAM)."""
    return HOST if all(kind == "DRAM" for kind in mem_kinds) else StagedMemory(cuda_copier(torch))

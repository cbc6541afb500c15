"""How digests read the bytes of a region: host memory through a view, device memory on its device or staged.

A digest must never dereference a device address from the CPU (on VRAM that is a segfault, not an error).
``HostMemory`` digests DRAM and refuses anything else by name; ``StagedMemory`` copies device runs into a host
buffer of the calling thread's, many runs per copy, and digests them there (the host fallback, for a process
with no torch: the demo's driver copies). A GPU engine's rank digests on the device with its own torch
(``transport.torch_memory``). Every reader computes ``layout.digest_words``' number, so a region's digest is
the same whichever memory holds it and whichever peer computes it.
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import numpy as np

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.digest_words import BLOCK_BYTES, WordSum, finish
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.slots import pack_runs

# copy(region, byte_offsets, lengths) -> the runs' bytes concatenated in order, in host memory of the calling
# thread's own (valid until its next call); the runs of one call add up to at most the reader's staging size
Copier = Callable[[Region, np.ndarray, np.ndarray], memoryview]
STAGING_BYTES = 64 << 20
HOST_SLOT_BYTES = 8 * BLOCK_BYTES  # short runs are packed into a slot this size before they are summed
SHORT_RUN_BYTES = BLOCK_BYTES  # runs shorter than this are packed; longer ones are summed in place


class MemoryReader(Protocol):
    """Digests registered memory."""

    def digest(self, region: Region, offsets: np.ndarray, lengths: np.ndarray) -> int:
        """The digest (``layout.digest_words``) of ``region``'s runs, concatenated in run order."""
        ...

    def word_sum(self, region: Region, offsets: np.ndarray, lengths: np.ndarray, first_byte: int) -> int:
        """The word sum ``h`` (``layout.digest_words``) of ``region``'s runs concatenated, as the bytes of a stream
        from its byte ``first_byte`` on (a multiple of ``BLOCK_BYTES``): the sums of a stream's consecutive parts
        add up (mod 2^64) to the whole's, which ``finish`` makes its digest. So a stream can be summed in parts
        as its bytes land."""
        ...


class SummingReader(ABC):
    """A reader's digest, from its ``word_sum`` over the whole stream (one home for the step every reader shares)."""

    @abstractmethod
    def word_sum(self, region: Region, offsets: np.ndarray, lengths: np.ndarray, first_byte: int) -> int: ...

    def digest(self, region: Region, offsets: np.ndarray, lengths: np.ndarray) -> int:
        return finish(self.word_sum(region, offsets, lengths, 0), int(lengths.sum()))


def check_start(first_byte: int) -> None:
    """A part of a stream summed on its own starts at a whole block (where a device reader's blocks start)."""
    if first_byte < 0 or first_byte % BLOCK_BYTES:
        raise ValueError(f"a stream is summed in parts from whole blocks of {BLOCK_BYTES} B, not from {first_byte}")


def host_view(addr: int, length: int) -> memoryview:
    """A zero-copy view of host memory; the caller guarantees the range lies in a registered region."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


class HostMemory(SummingReader):
    """DRAM only: anything else is refused, naming the region and its memory. Long runs are summed in place;
    short ones are first packed into a slot of the calling thread's own, so ~10^5 short runs cost ~10^5 copies
    and a few sums, not ~10^5 sums."""

    def __init__(self) -> None:
        self._mine = threading.local()  # .slot: this thread's host slot

    def _check(self, region: Region) -> None:
        if region.mem_kind != "DRAM":
            raise ConfigError(
                f"region {region.name} is {region.mem_kind} on device {region.device_id}: its digest cannot be read "
                "through a host pointer, and this rank has no device reader (the adapter passes one when it runs "
                "with torch on CUDA)"
            )

    def word_sum(self, region: Region, offsets: np.ndarray, lengths: np.ndarray, first_byte: int) -> int:
        self._check(region)
        check_start(first_byte)
        slot: np.ndarray | None = getattr(self._mine, "slot", None)
        if slot is None:
            slot = self._mine.slot = np.empty(HOST_SLOT_BYTES, dtype=np.uint8)
        total, filled = WordSum(first_byte), 0
        for off, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
            if filled and (n >= SHORT_RUN_BYTES or filled + n > slot.size):
                total.update(slot[:filled])
                filled = 0
            if n >= SHORT_RUN_BYTES:
                total.update(host_view(region.base_addr + off, n))
            else:
                ctypes.memmove(slot.ctypes.data + filled, region.base_addr + off, n)
                filled += n
        total.update(slot[:filled])
        return total.h()


HOST = HostMemory()


class StagedMemory(HostMemory):
    """DRAM as ``HostMemory``; device memory copied to the host (``copy``) one slot of ``staging_bytes`` at a time
    (``layout.slots``) and digested there, so a region's digest costs one device-to-host copy per slot."""

    def __init__(self, copy: Copier, *, staging_bytes: int = STAGING_BYTES) -> None:
        super().__init__()
        self._copy = copy
        self.staging_bytes = staging_bytes

    def word_sum(self, region: Region, offsets: np.ndarray, lengths: np.ndarray, first_byte: int) -> int:
        if region.mem_kind == "DRAM":
            return super().word_sum(region, offsets, lengths, first_byte)
        check_start(first_byte)
        total = WordSum(first_byte)
        packed = pack_runs(offsets, lengths, self.staging_bytes)
        for k in range(packed.num_slots):
            total.update(self._copy(region, packed.offsets[packed.slot(k)], packed.lengths[packed.slot(k)]))
        return total.h()


class DeviceBytes:
    """A raw device range as the CUDA array interface describes it, so torch wraps it without a copy."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (addr, False), "version": 3}

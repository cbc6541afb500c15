"""Digests computed where the memory is, with the engine's ``torch`` (the core imports no torch).

A GPU rank's regions are digested on their GPU: a region's runs are gathered, one slot at a time, into a scratch
tensor of the calling thread's own on that device (one ``index_select`` over rows of the largest size dividing
every run, as the staging mover does), and each slot's words are multiplied by the block keys and summed per
block there (``layout.digest_words``); only the per-block sums (8 bytes per 128 KiB) come to the host, where
they are folded into the digest. Nothing is staged in host memory, and no buffer is shared between threads
(two lanes sharing one pinned buffer got 70 of 80 digests wrong on an H200). DRAM regions are digested the same
way with torch's CPU ops. Where Triton is at hand (``digest_kernel``), runs of whole words are digested by one
kernel that reads each byte once instead: no gather, no products written; the ops above stay for the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from glm_pd_common.layout.digest_words import BLOCK_BYTES, BLOCK_WORDS, WORD_BYTES, block_keys, fold, words_sum
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.slots import pack_runs
from glm_pd_common.transport.memory import HOST, DeviceBytes, MemoryReader, SummingReader, check_start, host_view
from glm_pd_common.transport.staging import row_bytes, row_index

logger = logging.getLogger(__name__)

SCRATCH_BYTES = 128 * BLOCK_BYTES  # 16 MiB gathered at a time, plus 32 MiB of int64 products, per thread and device
# the kernel's check at start-up: runs of whole words over three blocks (of random bytes, made then), cut into
# pieces and tiles, with mid-tile ends
PROBE_BYTES = 3 * BLOCK_BYTES
PROBE_RUNS = (np.array([BLOCK_BYTES + 4, 0, 2 * BLOCK_BYTES + 64]), np.array([BLOCK_BYTES + 4092, 4100, 8]))


@dataclass
class _Scratch:
    """One thread's working tensors on one device."""

    slot: Any  # uint8, the gathered runs of one slot
    products: Any  # int64, a slot's words times their block keys


class TorchMemory(SummingReader):
    """``MemoryReader`` with the engine's ``torch``: each region digested on its own device (CUDA for VRAM, the
    CPU for DRAM), in slots of ``scratch_bytes`` (a multiple of ``BLOCK_BYTES``), or by ``kernel``
    (``digest_kernel``) where it runs on that device and the runs are whole words; the device's stream is waited
    for before a digest is returned. A kernel that fails (Triton cannot build it here) is named once and left."""

    def __init__(self, torch: Any, *, scratch_bytes: int = SCRATCH_BYTES, kernel: Any = None) -> None:
        if scratch_bytes <= 0 or scratch_bytes % BLOCK_BYTES:
            raise ValueError(f"scratch_bytes must be a positive multiple of {BLOCK_BYTES}, got {scratch_bytes}")
        self._torch = torch
        self.scratch_bytes = scratch_bytes
        self.kernel = kernel
        self._mine = threading.local()  # .scratch: {device: _Scratch}, .keys: {device: tensor} of this thread

    def check_kernel(self, device: Any) -> None:
        """Builds the kernel for ``device`` now (at start-up, not in a request's digest) and checks its word sum
        against the numpy definition over a probe: a kernel that fails or disagrees there (a compiler missing or
        wrong on this GPU) is named and left, so it never fails a healthy request's verification."""
        kernel, torch = self.kernel, self._torch
        if kernel is None or not kernel.supports(device):
            return
        probe = np.random.default_rng(28).integers(0, 256, PROBE_BYTES, dtype=np.uint8)
        offsets, lengths = PROBE_RUNS
        stream = np.concatenate([probe[o : o + n] for o, n in zip(offsets, lengths, strict=True)])
        want = words_sum(stream.view("<i4"), BLOCK_WORDS)
        try:
            with self._on(device):
                words = torch.from_numpy(probe).to(device).view(torch.int32)
                got = kernel.runs_word_sum(torch, words, offsets, lengths, 1, self._keys(device))
        except Exception as exc:  # e.g. no compiler for Triton here: the ops give the same sums
            self._leave_kernel(f"failed on {device} ({exc!r})")
            return
        if got != want:
            self._leave_kernel(f"gave {got:#x} on {device} where the definition gives {want:#x}")

    def _leave_kernel(self, why: str) -> None:
        """The one way the kernel is dropped: named, and the ops digest from then on."""
        logger.warning("glm-pd: the digest kernel %s; digesting with torch ops from now on", why)
        self.kernel = None

    def _on(self, device: Any) -> Any:
        """``device`` made current for the block (a CUDA device; nothing to select for the CPU)."""
        return self._torch.cuda.device(device) if device.type == "cuda" else nullcontext()

    def word_sum(self, region: Region, offsets: np.ndarray, lengths: np.ndarray, first_byte: int) -> int:
        check_start(first_byte)
        torch = self._torch
        device = torch.device("cuda", region.device_id) if region.mem_kind == "VRAM" else torch.device("cpu")
        kernel = self.kernel
        if kernel is not None and kernel.supports(device) and _whole_words(region, offsets, lengths):
            try:
                with self._on(device):
                    space = self._region_bytes(region, device)
                    words = space[: space.numel() // WORD_BYTES * WORD_BYTES].view(torch.int32)
                    keys = self._keys(device)
                    return kernel.runs_word_sum(torch, words, offsets, lengths, first_byte // BLOCK_BYTES, keys)
            except Exception as exc:  # e.g. no compiler for Triton here: the ops below give the same sum
                self._leave_kernel(f"failed ({exc!r})")
        packed = pack_runs(offsets, lengths, self.scratch_bytes)
        row = row_bytes(packed.offsets, packed.lengths, 0)  # divides every slot too: its pieces add up to it
        slot_rows = self.scratch_bytes // row
        # the rows' index goes to the device once per group of slots (a host-to-device copy waits for the stream),
        # a group's index at most the scratch's size (or one slot's, where rows are under 8 bytes)
        group = max(1, self.scratch_bytes // 8 // slot_rows)
        sums: list[Any] = []
        with self._on(device):
            scratch = self._scratch(device)
            space = self._region_bytes(region, device)
            rows = space[: space.numel() // row * row].view(-1, row)
            for first in range(0, packed.num_slots, group):
                last = min(first + group, packed.num_slots)
                pieces = slice(int(packed.slot_starts[first]), int(packed.slot_starts[last]))
                index = torch.from_numpy(row_index(packed.offsets[pieces], packed.lengths[pieces], 0, row))
                index = index.to(device)
                for k in range(first, last):
                    at = (k - first) * slot_rows
                    num_rows = int(packed.lengths[packed.slot(k)].sum()) // row
                    torch.index_select(
                        rows, 0, index[at : at + num_rows], out=scratch.slot[: num_rows * row].view(-1, row)
                    )
                    sums.extend(self._block_sums(scratch, num_rows * row, self._keys(device)))
            # the slots are whole blocks but the last, so these are the stream's blocks in order; .cpu() waits
            block_sums = torch.cat(sums).cpu().numpy() if sums else np.zeros(0, np.int64)
        return fold(block_sums, first_byte // BLOCK_BYTES)

    def _block_sums(self, scratch: _Scratch, num_bytes: int, keys: Any) -> list[Any]:
        """The per-block sums (int64 tensors) of the first ``num_bytes`` of ``scratch.slot``."""
        torch = self._torch
        num_words = -(-num_bytes // WORD_BYTES)
        scratch.slot[num_bytes : num_words * WORD_BYTES].zero_()  # the tail's word, zero-padded
        words = scratch.slot[: num_words * WORD_BYTES].view(torch.int32)
        full, rest = divmod(num_words, BLOCK_WORDS)
        out = []
        if full:
            products = scratch.products[: full * BLOCK_WORDS].view(full, BLOCK_WORDS)
            torch.mul(words[: full * BLOCK_WORDS].view(full, BLOCK_WORDS), keys, out=products)
            out.append(products.sum(dim=1))
        if rest:
            products = scratch.products[:rest]
            torch.mul(words[full * BLOCK_WORDS :], keys[:rest], out=products)
            out.append(products.sum().reshape(1))
        return out

    def _scratch(self, device: Any) -> _Scratch:
        mine: dict[Any, _Scratch] | None = getattr(self._mine, "scratch", None)
        if mine is None:
            mine = self._mine.scratch = {}
        if device not in mine:
            torch = self._torch
            mine[device] = _Scratch(
                slot=torch.empty(self.scratch_bytes, dtype=torch.uint8, device=device),
                products=torch.empty(self.scratch_bytes // WORD_BYTES, dtype=torch.int64, device=device),
            )
        return mine[device]

    def _keys(self, device: Any) -> Any:
        """``block_keys()`` as int64 on ``device``, this thread's copy (made on its stream, used there)."""
        mine: dict[Any, Any] | None = getattr(self._mine, "keys", None)
        if mine is None:
            mine = self._mine.keys = {}
        if device not in mine:
            mine[device] = self._torch.from_numpy(block_keys().view(np.int64).copy()).to(device)
        return mine[device]

    def _region_bytes(self, region: Region, device: Any) -> Any:
        """The region's whole byte range as a uint8 tensor on ``device``, without a copy."""
        if device.type == "cuda":
            return self._torch.as_tensor(DeviceBytes(region.base_addr, region.size_bytes), device=device)
        return self._torch.frombuffer(host_view(region.base_addr, region.size_bytes), dtype=self._torch.uint8)


def _whole_words(region: Region, offsets: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether every run starts and ends at a whole word of the region (the kernel reads words in place)."""
    return region.base_addr % WORD_BYTES == 0 and not (np.any(offsets % WORD_BYTES) or np.any(lengths % WORD_BYTES))


def digest_kernel() -> Any:
    """The one-pass digest kernel's module where Triton is installed (the engines' stacks), else None."""
    try:
        from glm_pd_common.transport import digest_kernel as kernel
    except ImportError:
        return None
    return kernel


def reader_for(regions: Iterable[Region], torch: Any) -> MemoryReader:
    """What an adapter gives its endpoint for its ``regions``: host reads when every region is DRAM, else digests
    on the device through the engine's ``torch`` (called only when ``torch`` has CUDA: a CPU engine's regions are
    DRAM), by the kernel where Triton is installed, checked on each of the regions' GPUs now."""
    regions = list(regions)
    if all(r.mem_kind == "DRAM" for r in regions):
        return HOST
    memory = TorchMemory(torch, kernel=digest_kernel())
    for device_id in sorted({r.device_id for r in regions if r.mem_kind == "VRAM"}):
        memory.check_kernel(torch.device("cuda", device_id))
    return memory

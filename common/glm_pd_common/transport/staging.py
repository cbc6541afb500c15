"""Staged transfers: a fragmented request moved as a few long descriptors through registered staging slots.

One descriptor per page costs ~7.5 µs to post on cuda_ipc: a 131k-token GLM-5.3 request in a fragmented pool
moves at ~5 GB/s where one descriptor reaches ~2 TB/s (FACTS §9). Staged, the source gathers a slot's runs
into a slot of its staging buffer (one indexed copy), the slot moves as one descriptor, and the destination
scatters it into its pages (one indexed copy). Both peers cut the runs into the same slots (``layout.slots``)
from the same plan, so where each byte sits in a slot needs no message.

The copies index this rank's registered memory as one flat byte view from its lowest to its highest address
(only rows inside runs the transport bounds-checked are touched), in rows of the largest size dividing every
run: one gather or scatter per slot, whatever the number of regions and runs. ``host_mover`` does it with numpy
on DRAM; ``torch_mover`` with the engine's torch on either memory (the core imports no torch).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.slots import Packed, pack_runs
from glm_pd_common.transport.base import Span, Transport
from glm_pd_common.transport.memory import DeviceBytes, host_view

StageMode = Literal["auto", "always", "never"]
STAGE_MODES: tuple[str, ...] = ("auto", "always", "never")
# Direct posting wins where runs are long: a descriptor costs ~7.5 µs on cuda_ipc, staging two extra passes
# over HBM (~1.8 TB/s each): equal at ~6.7 MB per run, so plans averaging this much or more post directly.
DIRECT_RUN_BYTES = 8 << 20
SLOT_BYTES = 64 << 20


class Mover(Protocol):
    """Copies between a rank's registered memory and one of its staging slots; complete when the call returns."""

    def gather(self, addrs: np.ndarray, lengths: np.ndarray, into: int) -> None:
        """The runs ``(addrs, lengths)`` concatenated in order into the slot at address ``into``."""
        ...

    def scatter(self, source: int, addrs: np.ndarray, lengths: np.ndarray) -> None:
        """The slot at ``source`` spread over the runs, in order (``gather``'s inverse)."""
        ...


def row_bytes(addrs: np.ndarray, lengths: np.ndarray, base: int) -> int:
    """The largest row size dividing every run's offset from ``base`` and every length (1 at worst)."""
    if addrs.size == 0:
        return 1
    return max(int(np.gcd.reduce(np.concatenate([addrs - base, lengths]).astype(np.int64))), 1)


def row_index(addrs: np.ndarray, lengths: np.ndarray, base: int, row: int) -> np.ndarray:
    """The rows of ``row`` bytes (counted from ``base``) that the runs cover, in run order."""
    counts = lengths // row
    firsts = (addrs - base) // row
    return np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _bounds(spans: Sequence[Span]) -> tuple[int, int]:
    if not spans:
        raise ConfigError("a staging mover needs the rank's registered spans")
    return min(s.base_addr for s in spans), max(s.base_addr + s.size_bytes for s in spans)


def _host_bytes(addr: int, length: int) -> np.ndarray:
    """Host memory as a writable uint8 array, without a copy (``memory.host_view``)."""
    return np.frombuffer(host_view(addr, length), dtype=np.uint8)


class HostMover:
    """``Mover`` over DRAM with numpy: one take (gather) or one indexed store (scatter) per slot."""

    def __init__(self, spans: Sequence[Span]) -> None:
        if any(s.mem_kind != "DRAM" for s in spans):
            raise ConfigError("the host mover reads DRAM only; a GPU rank stages through its engine's torch")
        self._base, end = _bounds(spans)
        self._space = _host_bytes(self._base, end - self._base)

    def gather(self, addrs: np.ndarray, lengths: np.ndarray, into: int) -> None:
        row = row_bytes(addrs, lengths, self._base)
        total = int(lengths.sum())
        rows = self._space[: self._space.size // row * row].reshape(-1, row)
        slot = _host_bytes(into, total).reshape(-1, row)
        np.take(rows, row_index(addrs, lengths, self._base, row), axis=0, out=slot)

    def scatter(self, source: int, addrs: np.ndarray, lengths: np.ndarray) -> None:
        row = row_bytes(addrs, lengths, self._base)
        rows = self._space[: self._space.size // row * row].reshape(-1, row)
        rows[row_index(addrs, lengths, self._base, row)] = _host_bytes(source, int(lengths.sum())).reshape(-1, row)


class TorchMover:
    """``Mover`` with the engine's ``torch`` over CPU or CUDA memory: one ``index_select`` (gather) or one
    ``index_copy_`` (scatter) per slot on the current stream of the memory's device, waited for before the call
    returns (a gathered slot may be read by the peer, a scattered one counted as loaded)."""

    def __init__(self, torch: Any, spans: Sequence[Span]) -> None:
        kinds = {(s.mem_kind, s.device_id if s.mem_kind == "VRAM" else 0) for s in spans}
        if len(kinds) != 1:
            raise ConfigError(f"a rank stages within one memory, its spans are in {sorted(kinds)}")
        ((kind, device_id),) = kinds
        self._torch = torch
        self._device = torch.device("cuda", device_id) if kind == "VRAM" else torch.device("cpu")
        self._base, end = _bounds(spans)
        self._space = self._bytes(self._base, end - self._base)

    def _bytes(self, addr: int, length: int) -> Any:
        if self._device.type == "cuda":
            return self._torch.as_tensor(DeviceBytes(addr, length), device=self._device)
        return self._torch.from_numpy(_host_bytes(addr, length))

    def _rows(self, addrs: np.ndarray, lengths: np.ndarray) -> tuple[Any, Any, int]:
        """The rows view and the row index of the runs, the index built on the device from one entry per run (a
        slot of 64 MiB in 256 B rows is 2 MiB of index: built on the host it would cost more than the copy)."""
        row = row_bytes(addrs, lengths, self._base)
        rows = self._space[: self._space.numel() // row * row].view(-1, row)
        counts = lengths // row
        firsts = (addrs - self._base) // row - (np.cumsum(counts) - counts)
        total = int(counts.sum())
        torch, device = self._torch, self._device
        repeats = torch.from_numpy(counts).to(device)
        index = torch.repeat_interleave(torch.from_numpy(firsts).to(device), repeats, output_size=total)
        return rows, index.add_(torch.arange(total, device=device)), row

    def _on_device(self) -> Any:
        return self._torch.cuda.device(self._device) if self._device.type == "cuda" else nullcontext()

    def _done(self) -> None:
        if self._device.type == "cuda":
            self._torch.cuda.current_stream(self._device).synchronize()

    def gather(self, addrs: np.ndarray, lengths: np.ndarray, into: int) -> None:
        with self._on_device():
            rows, index, row = self._rows(addrs, lengths)
            slot = self._bytes(into, int(lengths.sum())).view(-1, row)
            self._torch.index_select(rows, 0, index, out=slot)
            self._done()

    def scatter(self, source: int, addrs: np.ndarray, lengths: np.ndarray) -> None:
        with self._on_device():
            rows, index, row = self._rows(addrs, lengths)
            slot = self._bytes(source, int(lengths.sum())).view(-1, row)
            rows.index_copy_(0, index, slot)
            self._done()


class SlotPairs:
    """Pairs of slots lent to transfers, one pair each: slot ``k`` of a transfer uses the pair's ``k % 2``, so the
    gather of the next slot overlaps the move of this one. Thread-safe; ``take`` waits at most ``timeout_s``."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count))
        self._cond = threading.Condition()

    def take(self, timeout_s: float = 0.0) -> int | None:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout_s):
                return None
            return self._free.pop()

    def give(self, pair: int) -> None:
        with self._cond:
            self._free.append(pair)
            self._cond.notify()

    def lent(self) -> int:
        """Pairs out now (what a leak check counts)."""
        with self._cond:
            return self.count - len(self._free)


class Staging:
    """A rank's staging buffer (registered with its transport beside the caches), cut into pairs of slots."""

    def __init__(
        self, span: Span, slot_bytes: int, mover: Mover, mode: StageMode = "auto", backing: object = None
    ) -> None:
        if mode not in STAGE_MODES:
            raise ConfigError(f"staging mode must be one of {STAGE_MODES}, got {mode!r}")
        if slot_bytes <= 0 or slot_bytes % 4096 or 2 * slot_bytes > span.size_bytes:
            raise ConfigError(
                f"staging slots must be a positive multiple of 4096 B, two to a pair within the buffer: "
                f"{slot_bytes} B slots in {span.size_bytes} B"
            )
        self.span, self.slot_bytes, self.mover, self.mode = span, slot_bytes, mover, mode
        self.backing = backing  # what owns the buffer's memory (an array or tensor): alive as long as this is
        self.pairs = SlotPairs(span.size_bytes // (2 * slot_bytes))

    def slot_offset(self, pair: int, k: int) -> int:
        """Where slot ``k`` of the transfer holding ``pair`` sits in the buffer."""
        return (2 * pair + k % 2) * self.slot_bytes

    def slot_addr(self, pair: int, k: int) -> int:
        return self.span.base_addr + self.slot_offset(pair, k)


def settings_problem(mode: str, size_mib: int, slot_kib: int) -> str:
    """What is wrong with an engine's staging settings (mode, buffer MiB, slot KiB), or ""."""
    if mode not in STAGE_MODES:
        return f"staging mode must be one of {STAGE_MODES}, got {mode!r}"
    if mode != "never" and not (0 < 2 * slot_kib <= size_mib * 1024 and slot_kib % 4 == 0):
        return f"a staging buffer of {size_mib} MiB must hold two slots of {slot_kib} KiB (a positive multiple of 4)"
    return ""


def torch_staging(
    torch: Any, transport: Transport, regions: Sequence[Region], *, size_bytes: int, slot_bytes: int, mode: StageMode
) -> Staging | None:
    """A rank's staging buffer allocated once through its engine's ``torch`` on the caches' device, registered with
    ``transport``; None where the rank never stages (``never``, no size, or ``auto`` over host memory)."""
    kind = regions[0].mem_kind
    if mode == "never" or size_bytes <= 0 or (mode == "auto" and kind != "VRAM"):
        return None
    device = torch.device("cuda", regions[0].device_id) if kind == "VRAM" else torch.device("cpu")
    buffer = torch.empty(size_bytes // (2 * slot_bytes) * 2 * slot_bytes, dtype=torch.uint8, device=device)
    span = Span("staging", buffer.data_ptr(), buffer.numel(), kind, regions[0].device_id)
    transport.register([span])
    spans = [*(Span(r.name, r.base_addr, r.size_bytes, r.mem_kind, r.device_id) for r in regions), span]
    return Staging(span, slot_bytes, TorchMover(torch, spans), mode, backing=buffer)


def stages(plan: TransferPlan, mode: StageMode, mem_kind: str) -> bool:
    """Whether a plan moves staged: ``always``/``never`` as set; ``auto`` stages GPU memory whose runs are short
    (where descriptors, not bytes, decide the time; DRAM posts directly)."""
    if mode != "auto" or not plan.num_runs:
        return mode == "always" and plan.num_runs > 0
    return mem_kind == "VRAM" and plan.num_bytes < plan.num_runs * DIRECT_RUN_BYTES


@dataclass(frozen=True)
class StagedRuns:
    """A plan's runs cut into slots, both sides' addresses: piece ``i`` moves ``lengths[i]`` bytes from
    ``src[i]`` to ``dst[i]``; ``packed.slot(k)`` are slot ``k``'s pieces."""

    packed: Packed
    src: np.ndarray
    dst: np.ndarray

    @property
    def num_slots(self) -> int:
        return self.packed.num_slots

    def slot_bytes(self, k: int) -> int:
        return int(self.packed.lengths[self.packed.slot(k)].sum())

    def side(self, k: int, which: Literal["src", "dst"]) -> tuple[np.ndarray, np.ndarray]:
        part = self.packed.slot(k)
        return (self.src if which == "src" else self.dst)[part], self.packed.lengths[part]


def staged_runs(plan: TransferPlan, slot_bytes: int) -> StagedRuns:
    """The plan's absolute runs (every region pair, in plan order) in slots of ``slot_bytes``."""
    src, dst, lengths = plan.absolute_runs(list(plan.entries))
    packed = pack_runs(src, lengths, slot_bytes)
    into_run = packed.offsets - src[packed.run]
    return StagedRuns(packed, packed.offsets, dst[packed.run] + into_run)

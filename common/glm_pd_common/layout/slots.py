"""Runs packed into bounded slots: what a staging buffer holds at a time.

A fragmented page table leaves a request in ~10^5 short runs, and each run moved on its own costs a device
copy or a descriptor. Packing them, in order, into slots of at most ``slot_bytes`` lets one copy or one
descriptor move a whole slot: the runs' bytes are concatenated, a run longer than what is left of a slot is
cut at the slot's end and goes on in the next one. Both peers of a staged move compute the same slots from the
same runs, so where a byte sits in a slot needs no message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Packed:
    """Runs cut at slot boundaries. Pieces are in run order; ``slot_starts[k]`` is the first piece of slot ``k``
    (plus one past the last piece), and ``slot_offsets`` where each piece sits in its slot."""

    run: np.ndarray  # per piece: the index of the run it comes from
    offsets: np.ndarray  # per piece: the run's offset plus how far into the run the piece starts
    lengths: np.ndarray
    slot_offsets: np.ndarray
    slot_starts: np.ndarray

    @property
    def num_slots(self) -> int:
        return int(self.slot_starts.size - 1)

    def slot(self, k: int) -> slice:
        """The pieces of slot ``k``."""
        return slice(int(self.slot_starts[k]), int(self.slot_starts[k + 1]))


def pack_runs(offsets: np.ndarray, lengths: np.ndarray, slot_bytes: int) -> Packed:
    """``(offsets, lengths)`` packed in order into slots of ``slot_bytes`` (every slot full but the last)."""
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    offsets, lengths = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths  # each run's start in the packed stream
    ends = starts + lengths
    # a run spans the slots from its first byte's to its last byte's; an empty run is dropped
    first = starts // slot_bytes
    pieces = np.where(lengths > 0, (ends - 1) // slot_bytes - first + 1, 0)
    run = np.repeat(np.arange(lengths.size, dtype=np.int64), pieces)
    k = np.arange(run.size, dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    slot = first[run] + k
    piece_start = np.maximum(starts[run], slot * slot_bytes)
    piece_end = np.minimum(ends[run], (slot + 1) * slot_bytes)
    total = int(ends[-1]) if ends.size else 0
    num_slots = -(-total // slot_bytes)
    return Packed(
        run=run,
        offsets=offsets[run] + piece_start - starts[run],
        lengths=piece_end - piece_start,
        slot_offsets=piece_start - slot * slot_bytes,
        slot_starts=np.searchsorted(slot, np.arange(num_slots + 1), side="left").astype(np.int64),
    )


def runs_between(offsets: np.ndarray, lengths: np.ndarray, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces of ``(offsets, lengths)`` holding bytes ``first`` to ``last`` (exclusive) of the runs'
    concatenation, in order: a run straddling either end is cut there."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    keep = np.minimum(ends, last) > np.maximum(starts, first)  # a run with a byte in the range
    head = np.maximum(first - starts[keep], 0)
    return offsets[keep] + head, np.minimum(ends[keep], last) - starts[keep] - head

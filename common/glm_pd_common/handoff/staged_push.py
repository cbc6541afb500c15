"""Staged pushes, both ends' data plane: prefill WRITEs a plan into a pair of staging slots decode lent it, one
descriptor per slot, and decode scatters each slot into the request's pages (SGLang's push; the engine carries
the messages: which pair was lent, which slot landed, which is free again).

Prefill gathers slot ``k`` into its own pair while slot ``k - 1``'s WRITE is in flight and decode scatters slot
``k - 2``, so its gathers overlap both, as a staged pull's do. It says slot ``k`` landed only once that WRITE
completed, and writes slot ``k + 2`` (into the lent slot ``k % 2``) only once decode freed slot ``k``. Decode
checks that every run a landed slot names lies in the request's pages before a byte of it is scattered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Protocol

import numpy as np

from glm_pd_common.errors import ProtocolError, TransferFailed
from glm_pd_common.layout.landing import stray_run
from glm_pd_common.layout.regions import Region
from glm_pd_common.transport.base import Transfer, Transport
from glm_pd_common.transport.staging import StagedRuns, Staging

# How long decode rests a pair whose push it stopped (a refused slot, a cleared room), in its timeout_s: a WRITE
# prefill posted before it heard is released within timeout_s of its post, and it may post one more before it
# hears (a gather after decode stopped it), with a timeout_s of its own that need not be decode's.
REST_TIMEOUTS = 2


class SlotReplies(Protocol):
    """How prefill's push speaks to the decode rank, over the engine's wire."""

    def landed(self, k: int, last: bool, addrs: np.ndarray, lengths: np.ndarray) -> None:
        """Tell decode that slot ``k`` (in its lent slot ``k % 2``) holds these runs' bytes, in order."""
        ...

    def freed(self, k: int) -> None:
        """Return once decode scattered slot ``k``; raise ``TransferFailed`` where it refused it or never
        answered, ``ProtocolError`` where it answered out of turn."""
        ...


def lent_slots(offsets: Sequence[int], base_addr: int, size_bytes: int, slot_bytes: int) -> tuple[int, int]:
    """The two slots decode lent, as addresses in its staging buffer (``base_addr``, ``size_bytes``), each of
    ``slot_bytes`` within it; a pair that is not is refused before anything is written."""
    if len(offsets) != 2 or any(o < 0 or o + slot_bytes > size_bytes for o in offsets):
        raise ProtocolError(f"decode lent slots {list(offsets)[:4]} outside its {size_bytes} B buffer")
    return base_addr + offsets[0], base_addr + offsets[1]


def push_slots(
    transport: Transport,
    peer: str,
    mine: Staging,
    pair: int,
    there: tuple[int, int],
    runs: StagedRuns,
    timeout_s: float,
    replies: SlotReplies,
) -> None:
    """WRITE ``runs`` slot by slot through this rank's ``pair`` into decode's lent slots ``there``; returns once
    decode freed every slot. Each WRITE is done or released within ``timeout_s`` of its post, on failure too, and
    none is in flight when this returns, so the caller may hand ``pair`` to another push (decode rests a pair
    whose push it stopped: ``REST_TIMEOUTS``)."""
    inflight: tuple[int, Transfer, float] | None = None  # slot, its WRITE, when that WRITE is given up on

    def land(k: int, xfer: Transfer, deadline: float) -> None:
        _finish(transport, xfer, deadline)
        replies.landed(k, k == runs.num_slots - 1, *runs.side(k, "dst"))

    try:
        for k in range(runs.num_slots):
            here = mine.slot_addr(pair, k)  # free: its last WRITE (slot k - 2) was waited for
            mine.mover.gather(*runs.side(k, "src"), here)  # while slot k - 1 moves and decode scatters k - 2
            if k >= 2:
                replies.freed(k - 2)  # decode's slot k % 2 is free again
            local, remote, size = np.array([here]), np.array([there[k % 2]]), np.array([runs.slot_bytes(k)])
            xfer = transport.post(peer, "WRITE", local, remote, size, what=f"staged slot {k}")
            previous, inflight = inflight, (k, xfer, time.monotonic() + timeout_s)
            if previous is not None:
                land(*previous)
        if inflight is not None:
            last, inflight = inflight, None
            land(*last)
        for k in range(max(runs.num_slots - 2, 0), runs.num_slots):
            replies.freed(k)
    finally:
        if inflight is not None:  # a failed push's WRITE: done or given up on before its slot is written again
            with suppress(TransferFailed):  # the push already failed for its own reason
                _finish(transport, inflight[1], inflight[2])


def _finish(transport: Transport, xfer: Transfer, deadline: float) -> None:
    """Wait for a WRITE until ``deadline`` (past it, a moment, so one that completed meanwhile still counts), and
    release it whatever the wait gave."""
    try:
        transport.wait(xfer, max(deadline - time.monotonic(), 1e-3))
    finally:
        transport.release(xfer)


def land_slot(
    staging: Staging,
    regions: Sequence[Region],
    pages: np.ndarray,
    pair: int,
    slot: int,
    addrs: np.ndarray,
    lengths: np.ndarray,
) -> str:
    """Decode: scatter slot ``slot`` of the lent ``pair`` over the runs prefill named, each checked first to lie
    in the request's ``pages`` of ``regions``; why not ("" once scattered)."""
    if addrs.shape != lengths.shape or (lengths > staging.slot_bytes).any() or lengths.sum() > staging.slot_bytes:
        return f"{addrs.size} runs, {lengths.size} lengths, {int(lengths.sum())} B for a {staging.slot_bytes} B slot"
    if error := stray_run(regions, pages, addrs, lengths):
        return error
    try:
        staging.mover.scatter(staging.slot_addr(pair, slot), addrs, lengths)
    except Exception as exc:  # the push fails by name; the engine keeps serving
        return f"scatter failed: {exc!r}"
    return ""

"""The fault injector every fault matrix hands to a service (glm_pd_common.handoff.faults.HandoffFaults), and the
transport that wraps the real one to fail, hang or lose what a faulted handoff posts.

One ``Injector`` per service (per rank; the ranks of one engine may share ``kinds``), which maps a request id
(SGLang: a room) to the fault it gets; each rank applies a once-only fault (corrupt, transport_*) once per key:
  corrupt                 one landed byte inverted before the check (DRAM through ctypes, VRAM through torch)
  stall_before_claim:N    N s after the handshake, before the claim
  stall_mid:N             N s after the first batch is posted, before the others
  stall_before_release:N  N s after the read (and its check), before the confirmation
  transport_error         the first batch fails as a backend error would (``FaultyTransport``)
  transport_hang          the first batch never completes (``FaultyTransport``)
  drop_indexer            every batch posted without its indexer runs, completing as if whole (``FaultyTransport``)
  lose_release            the confirmation is never sent; its answer is still awaited
  duplicate_release       the confirmation is sent twice
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any

from glm_pd_common.errors import TransferFailed
from glm_pd_common.handoff.faults import FaultPoint
from glm_pd_common.layout.regions import Region
from glm_pd_common.transport.base import Transfer, Transport

logger = logging.getLogger(__name__)

STALLS: dict[FaultPoint, str] = {
    "before_claim": "stall_before_claim",
    "mid_transfer": "stall_mid",
    "before_release": "stall_before_release",
    "verifying": "stall_verify",
}
TRANSPORT_FAULTS = {"transport_error": "error", "transport_hang": "hang", "drop_indexer": "drop_indexer"}


class Injector:
    """Faults by request id (or room), applied on the thread that runs the handoff."""

    def __init__(self, kinds: dict[str, str] | None = None) -> None:
        self.kinds: dict[str, str] = {} if kinds is None else kinds
        self._spent: set[str] = set()  # keys whose once-only fault this rank has applied
        self.flipped: list[tuple[str, int]] = []  # (region, offset) of every byte ``corrupt`` inverted
        self._armed = threading.local()  # the transport fault the next post on this thread gets

    def at(self, key: str, point: FaultPoint) -> None:
        name, _, seconds = self.kinds.get(key, "").partition(":")
        if point in STALLS and name == STALLS[point]:
            logger.warning("fault injector: %s stalls %s s (%s)", key, seconds, name)
            time.sleep(float(seconds))
        elif point == "posting" and name in TRANSPORT_FAULTS and key not in self._spent:
            self._armed.fault = TRANSPORT_FAULTS[name]
            if name != "drop_indexer":  # a failed or hung batch is the handoff's first; a dropped indexer, every one
                self._spent.add(key)

    def landed(self, key: str, region: Region, offset: int) -> None:
        if self.kinds.get(key) == "corrupt" and key not in self._spent:
            self._spent.add(key)
            flip(region, offset)
            self.flipped.append((region.name, offset))

    def confirmations(self, key: str) -> int:
        return {"lose_release": 0, "duplicate_release": 2}.get(self.kinds.get(key, ""), 1)

    def take_armed(self) -> str:
        """The fault armed for this thread's next post (once)."""
        fault: str = getattr(self._armed, "fault", "")
        self._armed.fault = ""
        return fault


def flip(region: Region, offset: int) -> None:
    """Invert one byte of registered memory: host memory in place, device memory through the engine's torch."""
    if region.mem_kind == "DRAM":
        byte = ctypes.c_uint8.from_address(region.base_addr + offset)
        byte.value ^= 0xFF
        return
    import torch

    device = torch.device("cuda", region.device_id)
    with torch.cuda.device(device):
        view = torch.as_tensor(_DeviceByte(region.base_addr + offset), device=device)
        view.bitwise_not_()
        torch.cuda.current_stream(device).synchronize()


class _DeviceByte:
    """One device byte as the CUDA array interface describes it, so torch wraps it without a copy."""

    def __init__(self, addr: int) -> None:
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "|u1", "data": (addr, False), "version": 3}


class FaultyTransport:
    """A real transport whose posts an ``Injector`` may arm: the armed batch fails at its first poll, never
    completes (a bounded wait then fails it as a backend's would), or goes without its indexer runs. Everything
    else is the wrapped transport's."""

    def __init__(self, inner: Transport, injector: Injector) -> None:
        self.inner = inner
        self.injector = injector
        self._faults: dict[int, str] = {}  # id(transfer) -> its fault

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def post_plan(self, peer: str, plan: Any, op: Any, *, entries: Any = None, notif: bytes | None = None) -> Transfer:
        fault = self.injector.take_armed()
        if fault == "drop_indexer":
            kept = [e for e in (plan.entries if entries is None else entries) if e.dst.kind != "indexer"]
            if not kept:  # nothing left to post: as if the whole batch went and came back done
                return Transfer(peer, op, 0, 0, "dropped indexer runs", completed=True)
            return self.inner.post_plan(peer, plan, op, entries=kept, notif=notif)
        xfer = self.inner.post_plan(peer, plan, op, entries=entries, notif=notif)
        if fault:
            self._faults[id(xfer)] = fault
        return xfer

    def post(self, peer: str, op: Any, *args: Any, **kwargs: Any) -> Transfer:
        """A batch posted as runs (a staged slot): an armed error or hang applies as to a plan's batch."""
        fault = self.injector.take_armed()
        xfer = self.inner.post(peer, op, *args, **kwargs)
        if fault in ("error", "hang"):
            self._faults[id(xfer)] = fault
        return xfer

    def poll(self, xfer: Transfer) -> bool:
        fault = self._faults.get(id(xfer))
        if fault == "error":
            where = f"{self.inner.backend} {xfer.op} of {xfer.what} with peer {xfer.peer}"
            raise TransferFailed(f"{where} failed (injected)")
        return fault != "hang" and self.inner.poll(xfer)  # a hung batch never reports, so it never completes

    wait = Transport.wait  # the real bounded wait, over this wrapper's poll and release

    def release(self, xfer: Transfer) -> None:
        self._faults.pop(id(xfer), None)
        self.inner.release(xfer)

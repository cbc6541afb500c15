"""Decode's check of what landed in a room: glm-pd's per-region digests of its pages against prefill's.

Digesting a room's pages reads every byte of them (on the GPU now; it took ~0.7 s per 32k tokens when they were
staged to the host), so it runs on a verifier thread of its own, never on SGLang's scheduler thread (which only
polls for the answer). Prefill computes the same digests
(``_region_digests``) over what it sent.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from glm_pd_common.handoff.faults import HandoffFaults
from glm_pd_common.transport.digests import region_pages_digest
from glm_pd_sglang import wire


class RoomVerification:
    """The digest half of ``GlmPdKVManager`` (mixed in ahead of SGLang's ``CommonKVManager``)."""

    # Set by the manager.
    caches: Any
    endpoint: Any
    faults: HandoffFaults | None
    _lock: threading.Lock
    _digests: dict[int, list[wire.Digests]]
    _verifier: ThreadPoolExecutor

    def verify_later(self, room: int, pages: np.ndarray) -> Future[str | None]:
        """``verify_room`` on the verifier thread; its problem (or None) once done. A failure to read the pages
        is the room's problem, never an exception in the receiver's poll."""

        def verify() -> str | None:
            try:
                return self.verify_room(room, pages)
            except Exception as exc:
                return f"glm-pd could not verify what landed: {exc}"

        return self._verifier.submit(verify)

    def verify_room(self, room: int, pages: np.ndarray) -> str | None:
        """Compare what landed with prefill's digests; returns the problem, or None when every region matches."""
        with self._lock:  # against the listener adding a rank's digests and the receiver's clear
            sent = self._digests.pop(room, None)
        if self.faults is not None:
            self.faults.at(str(room), "verifying")
        if self.faults is not None and pages.size:
            region = self.caches.regions[-1]  # the room's last page of one region: bytes its digests compare
            self.faults.landed(str(room), region, int(pages[-1]) * region.page_stride)
        if not sent:
            return "glm-pd checksum verification is on, but prefill sent no digests (is it verifying too?)"
        theirs: dict[str, int] = {}
        for digests in sent:
            for name, value in zip(digests.regions, digests.digests, strict=True):
                if theirs.setdefault(name, value) != value:
                    return f"prefill ranks sent different digests for the {name} region"
        mine = self._region_digests(pages)
        missing = [name for name, _ in mine if name not in theirs]
        if missing or len(theirs) != len(mine):
            return f"prefill sent no digest for regions {missing} ({len(theirs)} digested; decode has {len(mine)})"
        for name, got in mine:
            if got != theirs[name]:
                return f"checksum mismatch in {name} region: decode {got:#018x}, prefill {theirs[name]:#018x}"
        return None

    def _region_digests(self, pages: np.ndarray) -> list[tuple[str, int]]:
        return [(r.name, region_pages_digest(r, pages, self.endpoint.memory)) for r in self.caches.regions]

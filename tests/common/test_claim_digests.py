"""A claim's digests are computed off prefill's service thread (issue 28, item 2): a long request's digests read
gigabytes (seconds on the host), and the service thread answers every other decode.

The slow read is a test double (``HeldMemory``: host reads whose first digest waits until the test lets it go),
so the premise, one claim's digests still running while another decode claims, holds by construction."""

from __future__ import annotations

import threading

import numpy as np

from glm_pd_common.handoff.decode.service import LoadResult
from glm_pd_common.layout.regions import Region
from glm_pd_common.transport.memory import HostMemory
from tests.support.services import Decode, Prefill

HOLD_S = 30.0  # the held digest lets go by itself after this (the old code's service thread was stuck that long)


class HeldMemory(HostMemory):
    """Host reads; the first digest's read waits for ``release`` (a stand-in for a long request's digest)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: set[str] = set()

    def digest(self, region: Region, offsets: np.ndarray, lengths: np.ndarray) -> int:
        self.threads.add(threading.current_thread().name)
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(HOLD_S)
        return super().digest(region, offsets, lengths)


def test_a_claim_being_digested_holds_up_no_other_decode(small_spec) -> None:
    held = HeldMemory()
    prefill = Prefill(small_spec, memory=held)
    verifying, plain = Decode(small_spec, "decode-a"), Decode(small_spec, "decode-b", verify=False)
    first: dict[str, LoadResult] = {}
    try:
        reader = threading.Thread(target=lambda: first.update(a=verifying.load(prefill, "A", 300)))
        reader.start()
        assert held.entered.wait(30), "A's claim never asked for digests"
        # A's digests are held: B's handshake, claim and release are answered meanwhile
        b = plain.load(prefill, "B", 200)
        assert b.ok and not held.release.is_set(), b
        held.release.set()
        reader.join(30)
        assert first["a"].ok, first["a"]  # A's digests arrived, and matched what landed
        assert prefill.finished("A", 10) is not None and prefill.finished("B", 10) is not None
        assert held.threads and not any(name.startswith("glm-pd-prefill") for name in held.threads), held.threads
    finally:
        held.release.set()
        for side in (verifying, plain, prefill):
            side.close()

"""A claim's digests, and the per-page digests decode asks for after a mismatch, are computed off prefill's service
thread (issue 28, item 2): a long request's digests read gigabytes (seconds on the host), and the service thread
answers every other decode. A claim is answered at once, so decode reads while prefill digests.

The slow read is a test double (``HeldMemory``: host reads one of whose digests waits until the test lets it
go), so the premise, one digest still running while another decode claims, holds by construction."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import numpy as np

from glm_pd_common.handoff.decode.service import LoadResult
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION as V
from glm_pd_common.layout.regions import Region
from glm_pd_common.transport.memory import HostMemory
from tests.support.services import NUM_PAGES, PAGE_TOKENS, SEED, Decode, Prefill, rivals, wait_for

PAGES = 5  # of A's request
HOLD_S = 30.0  # the held digest lets go by itself after this (the old code's service thread was stuck that long)


class HeldMemory(HostMemory):
    """Host reads; the first digest that ``holds`` picks (by its runs' offsets; default the first of all) waits
    for ``release`` (a stand-in for a long request's digest). ``threads``: where every digest ran."""

    def __init__(self, holds: Callable[[np.ndarray], bool] = lambda _: True) -> None:
        super().__init__()
        self.holds = holds
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: set[str] = set()

    def digest(self, region: Region, offsets: np.ndarray, lengths: np.ndarray) -> int:
        self.threads.add(threading.current_thread().name)
        if not self.entered.is_set() and self.holds(offsets):
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


def test_a_page_digest_query_being_answered_holds_up_no_other_decode(small_spec) -> None:
    """A's read lands corrupted; its check asks prefill for per-page digests, which are held: B's whole load is
    served meanwhile, then A fails naming the page."""
    # a page of a page-digest query: one or two runs; a region digest covers every page, and no two of prefill's
    # pages are adjacent
    held = HeldMemory(holds=lambda offsets: offsets.size < PAGES)
    prefill = Prefill(small_spec, memory=held)
    verifying, plain = Decode(small_spec, "decode-a"), Decode(small_spec, "decode-b", verify=False)
    first: dict[str, LoadResult] = {}
    try:
        load = partial(verifying.load, prefill, "A", PAGES * PAGE_TOKENS, fault="corrupt")
        reader = threading.Thread(target=lambda: first.update(a=load()))
        reader.start()
        assert held.entered.wait(30), "A's check never asked for per-page digests"
        b = plain.load(prefill, "B", 200)
        assert b.ok and not held.release.is_set(), b
        held.release.set()
        reader.join(30)
        a = first["a"]
        assert not a.ok and a.code == "digest" and "destination page" in a.reason, a
        assert held.threads and not any(name.startswith("glm-pd-prefill") for name in held.threads), held.threads
    finally:
        held.release.set()
        for side in (verifying, plain, prefill):
            side.close()


def test_a_decode_has_one_page_digest_query_of_a_request_answered_at_a_time(small_spec) -> None:
    """A hostile decode cannot queue up reads of prefill's memory: a second query of the same request while the
    first is being answered is refused by name; once answered, it may ask again."""
    armed = threading.Event()
    held = HeldMemory(holds=lambda _: armed.is_set())
    with rivals(small_spec, memory=held) as (prefill, owner, _):
        table = [int(p) for p in prefill.table[:4]]
        prefill.service.grant("r", prefill.table[:4])
        owner.send(protocol.TransferRequest(v=V, request_id="r", num_tokens=4 * PAGE_TOKENS, prefix_tokens=0,
                                            src_pages=table, dst_pages=[0, 1, 2, 3], verify=True))  # fmt: skip
        assert isinstance(owner.recv(10.0), protocol.Claimed)
        assert isinstance(owner.recv(10.0), protocol.SourceDigests)  # the claim's digests, before any is held
        armed.set()
        query = protocol.DigestQuery(v=V, request_id="r", region_indices=[0])
        owner.send(query)
        assert held.entered.wait(10.0), "the query was never answered"
        owner.send(query)
        again = owner.recv(10.0)
        assert isinstance(again, protocol.Failed) and "still being answered" in again.reason, again
        held.release.set()
        pages = owner.recv(10.0)
        assert isinstance(pages, protocol.PageDigests) and len(pages.pages[0]) == 4, pages
        owner.send(query)
        assert isinstance(owner.recv(10.0), protocol.PageDigests)


def test_decode_reads_while_prefill_digests_its_claim(small_spec) -> None:
    """Prefill answers a verifying claim at once and digests meanwhile: A's bytes land in decode's memory while
    prefill's digest of them is still held, and the load ends, verified, only once the digests come."""
    held = HeldMemory()
    prefill, decode = Prefill(small_spec, memory=held), Decode(small_spec, "decode-a")
    first: dict[str, LoadResult] = {}
    pages, n = np.arange(NUM_PAGES, dtype=np.int64), PAGES * PAGE_TOKENS
    try:
        reader = threading.Thread(target=lambda: first.update(a=decode.load(prefill, "A", n)))
        reader.start()
        assert held.entered.wait(30), "A's claim never asked for digests"
        landed = wait_for(lambda: decode.caches.mismatched_tokens(pages, 0, n, seed=SEED), lambda bad: not bad, 20.0)
        assert landed == [] and not held.release.is_set(), landed
        assert "a" not in first, "the load ended before prefill's digests came"
        held.release.set()
        reader.join(30)
        assert first["a"].ok, first["a"]
    finally:
        held.release.set()
        for side in (decode, prefill):
            side.close()

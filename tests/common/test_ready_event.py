"""GPU ordering, on CPU: a grant's pages may still be being written when the engine grants them, so prefill
answers no claim (``Claimed`` is what lets decode read) until the grant's ready event has completed.

``Gate`` stands in for the ``torch.cuda.Event`` recorded after the forward (and the MTP drafter's last step):
it stays incomplete until the test sets it, and the test writes the pages' final bytes just before, as the
GPU would. Real PrefillService and DecodeService over real NIXL agents on loopback.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from glm_pd_common.handoff.decode.service import LoadJob, LoadResult
from glm_pd_common.handoff.wire import protocol
from tests.support.services import PAGE_TOKENS, SEED, Decode, Prefill, wait_for

STALE, FINAL = SEED + 1, SEED + 2  # what the pages hold before the GPU's writes, and after
NUM_TOKENS = 3 * PAGE_TOKENS - 11
PAGES = -(-NUM_TOKENS // PAGE_TOKENS)


class Gate:
    """A ready event the test completes by hand (the ``ReadyEvent`` shape: ``query`` and ``synchronize``)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def set(self) -> None:
        self._done.set()


def _record_sends(prefill: Prefill) -> list[object]:
    """Every message prefill's service sends, in order (the test appends its own markers between them)."""
    sent: list[object] = []
    send = prefill.service.server.send

    def recording(identity: bytes, message: protocol.Message) -> None:
        sent.append(message)
        send(identity, message)

    prefill.service.server.send = recording
    return sent


def _submit(decode: Decode, prefill: Prefill, request_id: str) -> None:
    table = prefill.table[:PAGES]
    decode.service.submit(LoadJob(request_id, prefill.remote, table, np.arange(PAGES), NUM_TOKENS, 0))


def _result(decode: Decode, timeout_s: float = 30.0) -> LoadResult:
    results = wait_for(decode.service.results, bool, timeout_s)
    assert results, "no load result"
    return results[0]


def test_a_claim_waits_for_the_gpu_work_that_writes_the_pages(small_spec) -> None:
    """Decode's claim arrives while the pages hold stale bytes and the event is pending: no ``Claimed`` goes
    out, nothing lands in decode's caches, and meanwhile prefill serves another decode's request. Once the
    final bytes are written and the event completes, the claim is answered and decode gets the final bytes."""
    prefill = Prefill(small_spec)
    decode, other = Decode(small_spec, "decode-0"), Decode(small_spec, "decode-1")
    sent = _record_sends(prefill)
    gate = Gate()
    try:
        table = prefill.table[:PAGES]
        prefill.caches.write_tokens(table, 0, PAGES * PAGE_TOKENS, seed=STALE)
        before = {key: buf.copy() for key, buf in decode.caches.buffers.items()}
        prefill.service.grant("gated", table, ready=gate)
        _submit(decode, prefill, "gated")
        held = wait_for(prefill.service.leftovers, lambda h: h["early_claims"] == 1, 10.0)
        assert held["early_claims"] == 1 and held["unready"] == 1, held
        # another request is served while this one waits (different pages, no event)
        assert other.load(prefill, "ungated", PAGE_TOKENS).ok
        time.sleep(0.3)  # time enough for a service that ignored the event to have answered
        assert not [m for m in sent if isinstance(m, protocol.Claimed) and m.request_id == "gated"]
        assert decode.service.results() == []
        assert all(np.array_equal(before[key], buf) for key, buf in decode.caches.buffers.items())

        prefill.caches.write_tokens(table, 0, PAGES * PAGE_TOKENS, seed=FINAL)  # the forward and the drafter
        sent.append("event completed")
        gate.set()
        result = _result(decode)
        assert result.ok, result.reason
        claimed = next(i for i, m in enumerate(sent) if isinstance(m, protocol.Claimed) and m.request_id == "gated")
        assert claimed > sent.index("event completed")
        assert not decode.caches.mismatched_tokens(np.arange(PAGES), 0, NUM_TOKENS, seed=FINAL)
        assert prefill.finished("gated", 5.0).outcome == "released"
        assert wait_for(prefill.service.leftovers, lambda h: h["leases"] == 0, 5.0)["unready"] == 0
    finally:
        other.close()
        decode.close()
        prefill.close()


def test_the_lease_clock_starts_when_the_pages_are_ready(small_spec) -> None:
    """Granted at t0 with a 3 s lease, ready at t0 + 1.5 s, claimed at t0 + 3.4 s: past a lease counted from
    the grant, inside one counted from readiness (until t0 + 4.5 s). The load succeeds."""
    lease_s = 3.0
    prefill, decode = Prefill(small_spec, lease_s=lease_s), Decode(small_spec)
    gate = Gate()
    try:
        assert decode.load(prefill, "warm-up", PAGE_TOKENS).ok  # the handshake is done before the clock matters
        t0 = time.monotonic()
        prefill.service.grant("slow-gpu", prefill.table[:PAGES], ready=gate)
        time.sleep(1.5)
        gate.set()
        wait_for(prefill.service.leftovers, lambda h: h["unready"] == 0, 5.0)
        time.sleep(max(t0 + lease_s + 0.4 - time.monotonic(), 0.0))
        _submit(decode, prefill, "slow-gpu")
        result = _result(decode)
        assert result.ok, f"{result.code}: {result.reason}"
        assert not decode.caches.mismatched_tokens(np.arange(PAGES), 0, NUM_TOKENS, seed=SEED)
        assert prefill.finished("slow-gpu", 5.0).outcome == "released"
    finally:
        decode.close()
        prefill.close()


def test_a_grant_whose_event_never_completes_ends_within_a_lease(small_spec) -> None:
    """A hung GPU must not hold pages forever: the waiting claim is refused as ``lease_expired`` naming why,
    prefill ends the grant as expired, and nothing is left held on either side."""
    prefill, decode = Prefill(small_spec, lease_s=0.5, timeout_s=5.0), Decode(small_spec, timeout_s=5.0)
    try:
        prefill.service.grant("hung", prefill.table[:PAGES], ready=Gate())
        _submit(decode, prefill, "hung")
        result = _result(decode)
        assert (result.ok, result.code) == (False, "lease_expired"), result.reason
        assert "not ready" in result.reason
        ended = prefill.finished("hung", 5.0)
        assert ended is not None and ended.outcome == "expired" and "not ready" in ended.detail
        held = wait_for(prefill.service.leftovers, lambda h: h["unready"] + h["early_claims"] + h["leases"] == 0, 5.0)
        assert (held["unready"], held["early_claims"], held["leases"]) == (0, 0, 0)
    finally:
        decode.close()
        prefill.close()


def test_decode_giving_up_on_an_unready_grant_frees_it(small_spec) -> None:
    """Decode's claim times out while the event is pending: decode aborts, and prefill frees the pages now
    (an abort), not a lease later."""
    prefill, decode = Prefill(small_spec, lease_s=60.0), Decode(small_spec, timeout_s=0.5)
    try:
        prefill.service.grant("abandoned", prefill.table[:PAGES], ready=Gate())
        _submit(decode, prefill, "abandoned")
        result = _result(decode)
        assert (result.ok, result.code) == (False, "timeout"), result.reason
        ended = prefill.finished("abandoned", 5.0)
        assert ended is not None and ended.outcome == "aborted"
        assert prefill.service.leftovers()["unready"] == 0
    finally:
        decode.close()
        prefill.close()

"""Lease renewal between the real services (PrefillService, DecodeService, real NIXL agents on loopback).

A decode request may wait in its engine's queue (no free blocks yet) longer than prefill's lease. The engine's
scheduler then calls ``DecodeService.renew`` every ``renew_interval(lease_s)``, as ``_renew_while_waiting``
does here; the load that follows must find the pages still held, and a lease nobody renewed must fail as
``lease_expired``, never be revived.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from glm_pd_common.handoff.decode import renewals
from glm_pd_common.handoff.decode.service import DecodeService, LoadJob, LoadResult, RemotePrefill
from glm_pd_common.handoff.prefill.lease import Finished
from glm_pd_common.handoff.prefill.service import PrefillService
from glm_pd_common.handoff.wire.protocol import renew_interval
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.spec import CacheSpec
from tests.support.ports import free_port, free_port_range
from tests.support.services import PAGE_TOKENS, SEED, Decode, Prefill, endpoint, wait_for

LEASE_S = 1.0
WAIT_S = 2.5 * LEASE_S  # the queue wait: well past one lease
NUM_TOKENS = 2 * PAGE_TOKENS - 9


def _renew_while_waiting(service: DecodeService, remote: RemotePrefill, ids: list[str]) -> float:
    """What the engine's scheduler does for requests waiting in its queue; returns the slowest call (s)."""
    slowest, end = 0.0, time.monotonic() + WAIT_S
    while time.monotonic() < end:
        t0 = time.perf_counter()
        service.renew(remote, ids)
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(renew_interval(LEASE_S))
    return slowest


def _load(service: DecodeService, remote: RemotePrefill, table: np.ndarray, request_id: str) -> LoadResult:
    """Load what prefill granted earlier (no new grant: the lease must have lasted)."""
    n = -(-NUM_TOKENS // PAGE_TOKENS)
    service.submit(LoadJob(request_id, remote, table[:n], np.arange(n), NUM_TOKENS, 0))
    results = wait_for(service.results, bool, 30.0)
    assert results, f"no result for {request_id} within 30 s"
    return results[0]


def test_renewals_keep_a_waiting_request_past_its_lease(small_spec, monkeypatch, caplog) -> None:
    """Three requests renewed (split over two messages), one not: after 2.5 leases the renewed ones are still
    held and load byte-exactly; the other expired and its load fails as ``lease_expired`` even though it was
    renewed after expiring; a renewal of an id prefill never granted is ignored."""
    monkeypatch.setattr(renewals, "MAX_RENEW_IDS", 2)
    caplog.set_level(logging.DEBUG, logger="glm_pd_common.handoff.prefill.renewing")
    prefill, decode = Prefill(small_spec, lease_s=LEASE_S, timeout_s=5.0), Decode(small_spec, timeout_s=5.0)
    kept = ["kept-0", "kept-1", "kept-2"]
    try:
        for request_id in [*kept, "dropped"]:
            prefill.service.grant(request_id, prefill.table[:2])
        _renew_while_waiting(decode.service, prefill.remote, [*kept, "never-granted"])
        assert prefill.finished("dropped", 0.0) == Finished(
            "dropped", "expired", "lease expired before decode confirmed"
        )
        assert prefill.service.leftovers()["leases"] == len(kept)
        result = _load(decode.service, prefill.remote, prefill.table, "kept-1")
        assert result.ok, result.reason
        assert not decode.caches.mismatched_tokens(np.arange(2), 0, NUM_TOKENS, seed=SEED)
        assert prefill.finished("kept-1", 5.0).outcome == "released"
        for _ in range(3):
            decode.service.renew(prefill.remote, ["dropped"])
        late = _load(decode.service, prefill.remote, prefill.table, "dropped")
        assert (late.ok, late.code) == (False, "lease_expired"), late.reason
        assert "already ended: expired" in late.reason
        ignored = [r.getMessage() for r in caplog.records if "never-granted" in r.getMessage()]
        assert ignored and all("renewal ignored" in m and "no lease held" in m for m in ignored)
    finally:
        decode.close()
        prefill.close()


class _Rank:
    """One rank of a TP prefill: the engine's replicated copy of the request in its own caches."""

    def __init__(self, spec: CacheSpec, rank: int, tp: int, base_port: int) -> None:
        self.caches, local = endpoint(spec, f"prefill-tp{rank}", 5.0)
        self.local = dataclasses.replace(local, engine_id="prefill", shape=PeerShape(PAGE_TOKENS, tp, rank))
        self.table = np.arange(self.caches.num_pages, dtype=np.int64)[::-1].copy()
        self.caches.write_tokens(self.table, 0, self.caches.num_pages * PAGE_TOKENS, seed=SEED)
        self.service = PrefillService(
            self.local, host="127.0.0.1", port=base_port + rank, lease_s=LEASE_S, timeout_s=5.0
        )
        self.ended: list[Finished] = []

    def outcome(self, request_id: str, timeout_s: float) -> str | None:
        def get() -> str | None:
            self.ended += self.service.finished()
            return next((f.outcome for f in self.ended if f.request_id == request_id), None)

        return wait_for(get, lambda o: o is not None, timeout_s)

    def close(self) -> None:
        self.service.close()
        self.local.transport.close()


def test_a_decode_rank_renews_exactly_the_prefill_ranks_it_releases(small_spec) -> None:
    """Prefill TP 4, decode TP 2: every prefill rank holds the request; decode rank 1 reads rank 2's copy and
    releases ranks 2 and 3 (rank 0's and 1's are decode rank 0's). Its renewals reach ranks 2 and 3 and no
    other: those two outlast 2.5 leases and are released by the load; ranks 0 and 1 expire."""
    base = free_port_range(4)
    ranks = [_Rank(small_spec, r, 4, base) for r in range(4)]
    caches, local = endpoint(small_spec, "decode-tp1", 5.0)
    decode = DecodeService(
        dataclasses.replace(local, shape=PeerShape(PAGE_TOKENS, 2, 1)), timeout_s=5.0, verify_digests=True
    )
    remote = RemotePrefill("prefill", "127.0.0.1", base, 4)
    try:
        for rank in ranks:
            rank.service.grant("r", rank.table[:2])
        _renew_while_waiting(decode, remote, ["r"])
        assert [rank.outcome("r", 0.0) for rank in ranks] == ["expired", "expired", None, None]
        result = _load(decode, remote, ranks[2].table, "r")
        assert result.ok, result.reason
        assert not caches.mismatched_tokens(np.arange(2), 0, NUM_TOKENS, seed=SEED)
        assert [ranks[r].outcome("r", 5.0) for r in (2, 3)] == ["released", "released"]
    finally:
        decode.close()
        local.transport.close()
        for rank in ranks:
            rank.close()


def test_an_unreachable_prefill_costs_the_caller_nothing(small_spec, caplog) -> None:
    """``renew`` for a prefill nobody answers for returns at once (the handshake's wait is the lane's); the
    lane logs that the leases may expire and then serves a real load."""
    caches, local = endpoint(small_spec, "decode-0", 0.5)
    decode = DecodeService(local, timeout_s=0.5, verify_digests=True, lanes=1)  # the ghost and the real share it
    prefill = Prefill(small_spec)
    try:
        ghost = RemotePrefill("ghost", "127.0.0.1", free_port(), 1)
        t0 = time.perf_counter()
        decode.renew(ghost, ["lost-0", "lost-1"])
        assert time.perf_counter() - t0 < decode.timeout_s / 2, "renew waited for the handshake"

        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

        logged = wait_for(warned, bool, 10.0)
        assert any("could not renew 2 lease(s) on prefill ghost rank 0 (they may expire)" in m for m in logged), logged
        n = -(-NUM_TOKENS // PAGE_TOKENS)
        prefill.service.grant("real", prefill.table[:n])
        result = _load(decode, prefill.remote, prefill.table, "real")
        assert result.ok, result.reason
        assert not caches.mismatched_tokens(np.arange(n), 0, NUM_TOKENS, seed=SEED)
    finally:
        decode.close()
        local.transport.close()
        prefill.close()


def test_renewals_go_out_while_the_lane_waits_on_another_load(small_spec) -> None:
    """One lane, busy 2.5 leases with a load whose claim prefill holds (the engine has not handed that request
    over yet): the waiting request's renewals still reach prefill (the prefill is connected), so both load."""
    prefill = Prefill(small_spec, lease_s=LEASE_S, timeout_s=10.0)
    caches, local = endpoint(small_spec, "decode-0", 10.0)
    decode = DecodeService(local, timeout_s=10.0, verify_digests=True, lanes=1)
    n = -(-NUM_TOKENS // PAGE_TOKENS)
    try:
        prefill.service.grant("warm-up", prefill.table[:n])
        assert _load(decode, prefill.remote, prefill.table, "warm-up").ok  # connected before the wait
        prefill.service.grant("waiting", prefill.table[:n])
        decode.submit(LoadJob("granted-late", prefill.remote, prefill.table[:n], np.arange(n), NUM_TOKENS, 0))
        held = wait_for(prefill.service.leftovers, lambda h: h["early_claims"] == 1, 5.0)
        assert held["early_claims"] == 1, held
        _renew_while_waiting(decode, prefill.remote, ["waiting"])
        assert decode.results() == [], "the lane was to be busy all along"
        prefill.service.grant("granted-late", prefill.table[:n])
        first = wait_for(decode.results, bool, 10.0)
        assert [(r.request_id, r.ok) for r in first] == [("granted-late", True)], first
        result = _load(decode, prefill.remote, prefill.table, "waiting")
        assert result.ok, f"{result.code}: {result.reason}"
        assert not caches.mismatched_tokens(np.arange(n), 0, NUM_TOKENS, seed=SEED)
    finally:
        decode.close()
        local.transport.close()
        prefill.close()

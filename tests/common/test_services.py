"""The prefill and decode services end to end in one process (real NIXL agents, real host caches):
what each side keeps per peer and per request, and how a bad reply from a peer fails a load."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import numpy as np
import pytest

from glm_pd_common.errors import TransferFailed
from glm_pd_common.handoff.decode.service import DecodeService, LoadJob, LoadResult
from glm_pd_common.handoff.prefill import digesting
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.plan import build_plan
from tests.support.services import NUM_PAGES, PAGE_TOKENS, SEED, Decode, Prefill, endpoint, wait_for

IDLE = {
    "leases": 0,
    "unready": 0,
    "early_claims": 0,
    "plans": 0,
    "streams": 0,
    "staging_pairs": 0,
    "decode_peers": 1,
    "transport_peers": 1,
}


@pytest.mark.parametrize("same_name", [True, False], ids=["same-agent-name", "new-agent-name"])
def test_a_decode_restarting_leaves_one_peer_on_prefill(small_spec, same_name) -> None:
    """Each restart is a new process's agent on a new connection: prefill keeps the live one only, in its own
    map and in its transport (before: one peer and one agent per restart, or a refused re-handshake). A restart
    under the same agent name cannot prove to be the old process: it is accepted once prefill has forgotten the
    old connection (silent past the idle bound, 1 s here), never by evicting a live one."""
    prefill = Prefill(small_spec)
    try:
        for restart in range(4):
            if same_name:
                wait_for(prefill.service.leftovers, lambda h: h["decode_peers"] == 0, 10.0)
            decode = Decode(small_spec, "decode-0" if same_name else f"decode-0-{restart}")
            try:
                result = decode.load(prefill, f"r{restart}", 3 * 64 - 5)
                assert result.ok, result.reason
                assert not decode.caches.mismatched_tokens(np.arange(3), 0, 3 * 64 - 5, seed=SEED)
                assert prefill.finished(f"r{restart}", 5.0).outcome == "released"
                held = wait_for(prefill.service.leftovers, lambda h: h == IDLE, 5.0)
                assert held == IDLE, f"after restart {restart}"
                assert prefill.local.transport.remote_peers() == [decode.local.transport.agent_name]
                assert decode.service.leftovers() == {
                    "queued": 0,
                    "results": 0,
                    "prefill_peers": 1,
                    "transport_peers": 1,
                    "lanes_assigned": 1,
                }
            finally:
                decode.close()
        gone = wait_for(prefill.service.leftovers, lambda h: h["decode_peers"] == 0, 5.0)
        assert gone == {**IDLE, "decode_peers": 0, "transport_peers": 0}, "a silent decode is forgotten"
    finally:
        prefill.close()


def test_an_idle_decode_is_kept_by_its_heartbeats_and_loads_again(small_spec) -> None:
    """Silence past ``peer_idle_s`` forgets a peer; an idle live decode is not silent: its lanes heartbeat."""
    prefill, decode = Prefill(small_spec, idle_s=1.0), Decode(small_spec, beat_s=0.1)
    try:
        assert decode.load(prefill, "first", 64).ok
        time.sleep(3.5)  # more than three idle bounds
        assert prefill.service.leftovers()["decode_peers"] == 1
        result = decode.load(prefill, "second", 64)
        assert result.ok, result.reason
    finally:
        decode.close()
        prefill.close()


def _short(pages: list[int]) -> list:
    return pages[:-1]


def _long(pages: list[int]) -> list:
    return [*pages, 0]


def _wrong_type(pages: list[int]) -> list:
    return [str(p) for p in pages]


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (_short, r"per-page digests for region \d+: 2 digests; the plan has \d+ regions of 3 destination pages"),
        (_long, r"per-page digests for region \d+: 4 digests; the plan has \d+ regions of 3 destination pages"),
        (_wrong_type, r"malformed 'page_digests' message: Expected `int`, got `str` - at `\$\.pages\["),
    ],
    ids=["short", "long", "wrong-type"],
)
def test_a_bad_page_digest_reply_fails_the_load_and_prefill_frees_at_once(small_spec, monkeypatch, tamper, reason):
    """A corrupted load makes decode ask for per-page digests; prefill's reply is tampered with. The load
    fails naming what was wrong, decode aborts, and prefill frees the pages now, not at lease expiry (60 s).
    Before: a short or long list raised ValueError inside the load: no abort was sent."""
    real = digesting.page_digests
    monkeypatch.setattr(digesting, "page_digests", lambda *a: tamper(real(*a)))
    prefill = Prefill(small_spec, lease_s=60.0)
    decode = Decode(small_spec)
    try:
        result = decode.load(prefill, "bad-digests", 3 * 64, fault="corrupt")
        assert not result.ok and result.states[-1] == "FAILED"
        assert re.search(reason, result.reason), result.reason
        ended = prefill.finished("bad-digests", 3.0)
        assert ended is not None and ended.outcome == "aborted", "prefill still holds the pages"
        assert prefill.service.leftovers()["leases"] == 0
    finally:
        decode.close()
        prefill.close()


def test_bytes_moved_are_the_transfers_that_completed(small_spec) -> None:
    """A load's byte counts are the batches the transport reported done, counted here from the layout
    (equal page sizes: whole pages, pages x page bytes per region); a batch that never completes counts 0."""
    prefill, decode = Prefill(small_spec), Decode(small_spec)
    try:
        num_tokens, num_pages = 2 * 64 + 7, 3
        result = decode.load(prefill, "bytes", num_tokens)
        assert result.ok, result.reason
        want = {"main": 0, "indexer": 0}
        for region in decode.caches.regions:
            want[region.kind] += region.page_bytes * num_pages
        assert result.bytes_by_kind == want
        transport = decode.local.transport
        plan = build_plan(
            prefill.caches.regions,
            decode.caches.regions,
            prefill.table[:num_pages],
            np.arange(num_pages),
            num_tokens=num_tokens,
            prefix_tokens=0,
        )
        done = transport.post_plan("prefill-0", plan, "READ")
        transport.wait(done, 10.0)
        assert done.completed_bytes_by_kind == want
        decode.faults.kinds["hung"] = "transport_hang"
        decode.faults.at("hung", "posting")  # what the service calls before a load's first batch
        hung = transport.post_plan("prefill-0", plan, "READ")
        with pytest.raises(TransferFailed, match="did not complete"):
            transport.wait(hung, 0.5)
        assert hung.completed_bytes_by_kind == {}
    finally:
        decode.close()
        prefill.close()


def _claim(decode: DecodeService, prefill: Prefill, request_id: str, num_tokens: int, **job) -> LoadResult:
    """Submit one load of what prefill granted under ``request_id`` (``job`` overrides the job's fields)."""
    n = -(-num_tokens // PAGE_TOKENS)
    fields = {"remote_pages": prefill.table[:n], "local_pages": np.arange(n), **job}
    decode.submit(LoadJob(request_id, prefill.remote, num_tokens=num_tokens, prefix_tokens=0, **fields))
    results = wait_for(decode.results, bool, 30.0)
    assert results, f"no result for {request_id}"
    return results[0]


def _granted(prefill: Prefill, request_id: str, num_tokens: int) -> None:
    prefill.service.grant(request_id, prefill.table[: -(-num_tokens // PAGE_TOKENS)])


def _expired(prefill, decode, rid):
    _granted(prefill, rid, 64)
    assert prefill.finished(rid, 5.0).outcome == "expired"
    return _claim(decode.service, prefill, rid, 64)


def _aborted(prefill, decode, rid):
    _granted(prefill, rid, 64)
    _granted(prefill, rid, 64)  # two live requests under one id: neither is served
    assert prefill.finished(rid, 5.0).outcome == "aborted"
    return _claim(decode.service, prefill, rid, 64)


def _wrong_pages(prefill, decode, rid):
    _granted(prefill, rid, 2 * 64)
    return _claim(decode.service, prefill, rid, 2 * 64, remote_pages=prefill.table[1:3])


def _bad_page_id(prefill, decode, rid):
    _granted(prefill, rid, 2 * 64)
    return _claim(decode.service, prefill, rid, 2 * 64, local_pages=np.array([0, NUM_PAGES + 4]))


def _fault(name):
    def run(prefill, decode, rid):
        return decode.load(prefill, rid, 2 * 64, fault=name)

    return run


def _foreign_page_size(prefill, decode, rid):
    """A decode whose shape prefill cannot pair with (48-token pages): prefill refuses its hello."""
    _caches, local = endpoint(prefill.local.spec, "decode-odd", 5.0)  # held: the transport registered them
    service = DecodeService(dataclasses.replace(local, shape=PeerShape(48, 1, 0)), timeout_s=5.0, verify_digests=False)
    try:
        _granted(prefill, rid, 64)
        return _claim(service, prefill, rid, 64)
    finally:
        service.close()
        local.transport.close()


@pytest.mark.parametrize(
    ("case", "code", "reason"),
    [
        (_expired, "lease_expired", r"already ended: expired"),
        (_aborted, "aborted", r"already ended: aborted"),
        (_wrong_pages, "invalid_params", r"decode's source pages are not the pages it holds"),
        (_bad_page_id, "invalid_params", rf"page id {NUM_PAGES + 4}\b"),
        (_fault("transport_error"), "transport", r"failed \(injected\)"),
        (_fault("corrupt"), "digest", r"checksum mismatch"),
        (_fault("lose_release"), "timeout", r"no answer from 127\.0\.0\.1:\d+ within"),
        (_foreign_page_size, "refused_peer", r"refused the handshake: .*page_tokens"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_a_failed_load_says_what_kind_of_failure_it_was(small_spec, case, code, reason) -> None:
    """Each failure the services can meet, made to happen for real, reports its own ``code`` (metrics count
    lease expiries apart from transport failures) and a reason naming it."""
    prefill = Prefill(small_spec, lease_s=0.3 if case is _expired else 60.0, timeout_s=1.5)
    decode = Decode(small_spec, timeout_s=1.5)
    try:
        result = case(prefill, decode, "coded")
        assert not result.ok
        assert (result.code, re.search(reason, result.reason) is not None) == (code, True), result.reason
    finally:
        decode.close()
        prefill.close()


def test_a_successful_load_has_no_failure_code(small_spec) -> None:
    prefill, decode = Prefill(small_spec), Decode(small_spec)
    try:
        result = decode.load(prefill, "fine", 64)
        assert (result.ok, result.code, result.reason) == (True, "", "")
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize(
    "where",
    ["between_waits", "inside_a_wait"],
    ids=["held-up-between-waits", "stopped-inside-its-wait"],
)
def test_a_claim_queued_while_prefill_was_held_up_is_answered_before_expiry(small_spec, monkeypatch, where) -> None:
    """Prefill's thread is held up while decode's claim waits in the socket and the lease's time runs out: between
    two waits (its transport poll blocks), or inside its wait on the socket (the process is stopped: SIGSTOP, a
    debugger; the wait ends long past its timeout). On waking, prefill holds the leases over by as long and answers
    what queued before it expires leases: the pages are still held, so the load succeeds. Before: the lease expired
    first and the claim, sent in time, failed (inside a wait, the time away was not even seen)."""
    prefill, decode = Prefill(small_spec, lease_s=1.0), Decode(small_spec)
    try:
        assert decode.load(prefill, "warm-up", 64).ok  # the handshake is done: only the claim is left to queue
        held, stalled = threading.Event(), threading.Event()
        owner, name = (
            (prefill.local.transport, "notifs") if where == "between_waits" else (prefill.service.server, "recv")
        )
        real = getattr(owner, name)

        def held_up(*args: float, **kwargs: float) -> object:
            if held.is_set():
                stalled.set()
                while held.is_set():
                    time.sleep(0.01)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, held_up)
        prefill.service.grant("late", prefill.table[:1])
        time.sleep(0.1)  # the grant is taken, the lease's clock runs
        held.set()
        assert stalled.wait(5.0)
        job = LoadJob("late", prefill.remote, prefill.table[:1], np.arange(1), 64, 0)
        decode.service.submit(job)
        time.sleep(1.5)  # past the lease, with decode's claim queued
        held.clear()
        results = wait_for(decode.service.results, bool, 30.0)
        assert results and results[0].ok, results[0].reason if results else "no result"
        assert prefill.finished("late", 5.0).outcome == "released"
    finally:
        decode.close()
        prefill.close()

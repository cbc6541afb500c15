"""Streamed transfers between the prefill and decode services (real NIXL agents, real host caches).

Prefill's caches hold other content (``STALE``) until a step "writes" a chunk (``SEED``), just before it is
announced: a page decode read before its announcement would keep stale bytes, and reads are never repeated,
so the final content check fails on any early read. Decode verifies prefill's digests of the whole suffix.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from glm_pd_common.handoff.decode.service import LoadJob, LoadResult, RemotePrefill
from glm_pd_common.handoff.wire import protocol
from tests.support.services import NUM_PAGES, PAGE_TOKENS, SEED, Decode, Prefill, wait_for

STALE, HELD = SEED + 1, SEED + 2  # prefill's unwritten tokens; decode's own prefix hit
NO_STREAMS = {"leases": 0, "unready": 0, "early_claims": 0, "plans": 0, "streams": 0}


def streamed_prefill(spec, **kw) -> Prefill:
    prefill = Prefill(spec, streamed=True, **kw)
    prefill.caches.write_tokens(prefill.table, 0, NUM_PAGES * PAGE_TOKENS, seed=STALE)
    return prefill


@pytest.fixture
def pair(small_spec) -> Iterator[tuple[Prefill, Decode]]:
    """A streamed prefill and a decode, closed after the case."""
    prefill, decode = streamed_prefill(small_spec), Decode(small_spec)
    yield prefill, decode
    decode.close()
    prefill.close()


def start(decode: Decode, prefill: Prefill, transfer: str, num_tokens: int, prefix_tokens: int = 0) -> LoadJob:
    """Decode admits the request at once: only prefill's address travels (no pages, no shape)."""
    where = RemotePrefill(f"127.0.0.1:{prefill.service.port}", "127.0.0.1", prefill.service.port, 0)
    pages = np.arange(NUM_PAGES, dtype=np.int64)
    job = LoadJob(transfer, where, np.empty(0, np.int64), pages, num_tokens, prefix_tokens, stream_id=transfer)
    decode.service.submit(job)
    return job


def step(prefill: Prefill, transfer: str, done: int, upto: int) -> None:
    """One prefill step: write tokens ``[done, upto)``, then announce them with the pages they are in."""
    prefill.caches.write_tokens(prefill.table, done, upto, seed=SEED)
    first, end = -(-done // PAGE_TOKENS), -(-upto // PAGE_TOKENS)
    prefill.service.advance_stream(transfer, prefill.table[first:end], upto)


def finish(prefill: Prefill, transfer: str, num_tokens: int) -> None:
    pages = prefill.table[: -(-num_tokens // PAGE_TOKENS)]
    prefill.service.grant_stream(f"{transfer}#0", transfer, pages, num_tokens)


def result_of(decode: Decode, timeout_s: float = 20.0) -> LoadResult:
    results = wait_for(decode.service.results, bool, timeout_s)
    assert results, "no load result"
    return results[0]


def landed(decode: Decode, upto: int, since: int = 0) -> bool:
    """Decode's pages hold tokens ``[since, upto)`` (read from decode's own memory)."""
    return upto <= since or not decode.caches.mismatched_tokens(np.arange(NUM_PAGES), since, upto, seed=SEED)


@pytest.mark.parametrize("slot_bytes", [0, 8192], ids=["direct", "staged"])
@pytest.mark.parametrize("prefix_pages", [0, 2])
def test_chunks_land_while_prefill_runs_and_the_lease_brings_the_rest(small_spec, prefix_pages, slot_bytes) -> None:
    """Staged: every announced span and the tail after the lease are read in 8 KiB slots (tens per span), each
    cut mid-page; what lands is what posting the runs directly lands."""
    prefill = streamed_prefill(small_spec, slot_bytes=slot_bytes, pairs=1)
    decode = Decode(small_spec, slot_bytes=slot_bytes)
    try:
        _chunks_land(prefill, decode, prefix_pages, slot_bytes)
    finally:
        decode.close()
        prefill.close()


def _chunks_land(prefill: Prefill, decode: Decode, prefix_pages: int, slot_bytes: int) -> None:
    num_tokens, prefix = 9 * PAGE_TOKENS + 17, prefix_pages * PAGE_TOKENS
    decode.caches.write_tokens(np.arange(NUM_PAGES), 0, prefix, seed=HELD)
    prefill.service.open_stream("t1", num_tokens)
    start(decode, prefill, "t1", num_tokens, prefix)
    done = 0
    for upto in (3 * PAGE_TOKENS + 5, 6 * PAGE_TOKENS, 8 * PAGE_TOKENS + 40):
        step(prefill, "t1", done, upto)
        whole = max(upto // PAGE_TOKENS * PAGE_TOKENS, prefix)
        assert wait_for(lambda w=whole: landed(decode, w, prefix), bool, 10.0), f"tokens to {whole}"
        done = upto
    step(prefill, "t1", done, num_tokens)
    assert not decode.service.results(), "the load ended before prefill finished"
    finish(prefill, "t1", num_tokens)
    result = result_of(decode)
    assert result.ok, result.reason
    wrong = decode.caches.mismatched_tokens(np.arange(NUM_PAGES), prefix, num_tokens, seed=SEED)
    assert not wrong, wrong
    moved = sum(result.bytes_by_kind.values())
    pages = -(-num_tokens // PAGE_TOKENS) - prefix_pages  # equal page sizes: whole pages travel
    assert moved == sum(r.page_bytes for r in decode.local.regions) * pages, result.bytes_by_kind
    assert result.staged_bytes == (moved if slot_bytes else 0), result
    assert prefill.finished("t1#0", 5.0).outcome == "released"
    assert not decode.caches.mismatched_tokens(np.arange(NUM_PAGES), 0, prefix, seed=HELD), "prefix overwritten"
    empty = {**NO_STREAMS, "staging_pairs": 0}
    assert wait_for(prefill.service.leftovers, lambda h: h.items() >= empty.items(), 5.0).items() >= empty.items()
    assert decode.local.staging is None or decode.local.staging.pairs.lent() == 0


@pytest.mark.parametrize("slot_bytes", [0, 8192], ids=["direct", "staged"])
def test_steps_announced_back_to_back_land_whole(small_spec, slot_bytes) -> None:
    """Prefill announces every step and the lease without waiting for decode: staged, the announcements arrive
    while decode waits for a slot (each is kept for the stream's reader, none lost or read twice)."""
    prefill = streamed_prefill(small_spec, slot_bytes=slot_bytes, pairs=1)
    decode = Decode(small_spec, slot_bytes=slot_bytes)
    try:
        num_tokens = 10 * PAGE_TOKENS - 3
        prefill.service.open_stream("t2", num_tokens)
        start(decode, prefill, "t2", num_tokens)
        done = 0
        for upto in (PAGE_TOKENS + 1, 3 * PAGE_TOKENS, 5 * PAGE_TOKENS + 9, 7 * PAGE_TOKENS, num_tokens):
            step(prefill, "t2", done, upto)
            done = upto
        finish(prefill, "t2", num_tokens)
        result = result_of(decode)
        assert result.ok, result.reason
        assert not decode.caches.mismatched_tokens(np.arange(NUM_PAGES), 0, num_tokens, seed=SEED)
        assert result.staged_bytes == (sum(result.bytes_by_kind.values()) if slot_bytes else 0)
        assert prefill.finished("t2#0", 5.0).outcome == "released"
    finally:
        decode.close()
        prefill.close()


def test_decode_subscribing_before_prefill_has_the_request_waits_for_it(pair) -> None:
    prefill, decode = pair
    num_tokens = 4 * PAGE_TOKENS
    start(decode, prefill, "early", num_tokens)
    time.sleep(0.5)
    prefill.service.open_stream("early", num_tokens)
    step(prefill, "early", 0, num_tokens)
    finish(prefill, "early", num_tokens)
    result = result_of(decode)
    assert result.ok, result.reason
    assert landed(decode, num_tokens)


def test_decode_giving_up_mid_stream_frees_prefills_lease_when_it_comes(pair) -> None:
    prefill, decode = pair
    num_tokens = 6 * PAGE_TOKENS
    prefill.service.open_stream("gone", num_tokens)
    start(decode, prefill, "gone", num_tokens)
    step(prefill, "gone", 0, 2 * PAGE_TOKENS)
    assert wait_for(lambda: landed(decode, 2 * PAGE_TOKENS), bool, 10.0)
    decode.service.cancel("gone")
    result = result_of(decode)
    assert not result.ok and result.code == "aborted", result
    assert decode.service.leftovers()["prefill_peers"] == 1, "a client's abort dropped the link to prefill"
    step(prefill, "gone", 2 * PAGE_TOKENS, num_tokens)
    finish(prefill, "gone", num_tokens)
    ended = prefill.finished("gone#0", 5.0)
    assert ended is not None and ended.outcome == "aborted", "prefill kept the lease of a transfer decode left"
    held = wait_for(prefill.service.leftovers, lambda h: h["leases"] + h["streams"] == 0, 5.0)
    assert held["leases"] == 0 and held["streams"] == 0, held


@pytest.mark.parametrize("silent_at", ["query", "hello"])
def test_a_cancelled_load_ends_while_prefill_does_not_answer(small_spec, silent_at: str) -> None:
    """A frozen prefill (its socket accepts, nothing answers): decode's client goes while the load waits for
    prefill's first answer, to the address query or to the handshake. The load ends at once, as ``aborted``,
    not when its timeout (30 s) runs out."""
    decode = Decode(small_spec, timeout_s=30.0)
    ctx = zmq.Context()
    frozen = ctx.socket(zmq.ROUTER)
    port = frozen.bind_to_random_port("tcp://127.0.0.1")
    try:
        tp_size = 0 if silent_at == "query" else 1  # streamed params name host:port only; or the shape is known
        where = RemotePrefill(f"127.0.0.1:{port}", "127.0.0.1", port, tp_size)
        job = LoadJob("frozen", where, np.empty(0, np.int64), np.arange(4), 2 * PAGE_TOKENS, 0, stream_id="frozen")
        decode.service.submit(job)
        assert frozen.poll(10_000), "decode never reached prefill's socket"
        asked = type(protocol.decode(frozen.recv_multipart()[-1])).__name__
        assert asked == {"query": "Query", "hello": "Hello"}[silent_at]
        decode.service.cancel("frozen")
        result = result_of(decode, 10.0)  # a third of the load's own timeout
        assert not result.ok and result.code == "aborted", result
    finally:
        decode.close()
        frozen.close(0)
        ctx.term()


def test_prefill_ending_the_request_fails_the_load_naming_why(pair) -> None:
    prefill, decode = pair
    prefill.service.open_stream("preempted", 5 * PAGE_TOKENS)
    start(decode, prefill, "preempted", 5 * PAGE_TOKENS)
    step(prefill, "preempted", 0, 2 * PAGE_TOKENS)
    prefill.service.end_stream("preempted", "preempted: its blocks were freed")
    result = result_of(decode)
    assert not result.ok and "preempted: its blocks were freed" in result.reason, result.reason
    assert wait_for(prefill.service.leftovers, lambda h: h["streams"] == 0, 5.0)["streams"] == 0


def test_a_prompt_of_another_length_is_refused(pair) -> None:
    prefill, decode = pair
    prefill.service.open_stream("other", 5 * PAGE_TOKENS)
    start(decode, prefill, "other", 4 * PAGE_TOKENS)
    result = result_of(decode)
    assert not result.ok and "prompt has 320 tokens; decode's has 256" in result.reason, result.reason


def test_prefill_gone_mid_stream_fails_the_load_within_the_timeout(small_spec) -> None:
    prefill, decode = streamed_prefill(small_spec), Decode(small_spec, timeout_s=2.0)
    try:
        prefill.service.open_stream("dead", 5 * PAGE_TOKENS)
        start(decode, prefill, "dead", 5 * PAGE_TOKENS)
        step(prefill, "dead", 0, 2 * PAGE_TOKENS)
        assert wait_for(lambda: landed(decode, 2 * PAGE_TOKENS), bool, 10.0)
        prefill.close()
        result = result_of(decode, 15.0)
        assert not result.ok and result.code == "timeout", result
    finally:
        decode.close()


def test_a_prefill_without_streamed_transfers_refuses_the_subscription(small_spec) -> None:
    prefill, decode = Prefill(small_spec), Decode(small_spec)
    try:
        start(decode, prefill, "pull-only", 2 * PAGE_TOKENS)
        result = result_of(decode)
        assert not result.ok and "without streamed transfers" in result.reason, result.reason
    finally:
        decode.close()
        prefill.close()

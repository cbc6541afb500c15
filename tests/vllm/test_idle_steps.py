"""A decode whose requests only wait for loads sleeps instead of stepping (``idle_wait_s``), inside vLLM's own
Scheduler (tests/support/vllm_engine.py; prefill steps on a thread of its own, as its own server would).

vLLM steps without pause while any request exists, a parked WAITING_FOR_REMOTE_KVS one included; on a CPU engine
each step is a shared-memory round trip whose readers spin. A streamed load parks its request for the whole
prefill. What the worker asked its decode service for is recorded (the seconds each step offered to wait), so
the cases assert the worker's decisions, not the machine's speed."""

from __future__ import annotations

import math
import threading
import time

import pytest
from vllm.v1.request import RequestStatus

from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from tests.support.ports import free_port_range
from tests.support.vllm_engine import Engine

PROMPT = 300
WAIT_S = 5.0  # below half of lease_s 60's renewal interval: the worker clamps nothing
STREAMED = {"streamed": True}


@pytest.fixture
def engines(tiny_model):
    port = free_port_range(8)
    base = {"model": tiny_model, "block_size": 64, "tp": 1, "port": port, "lease_s": 60.0,
            "module_path": "glm_pd_vllm.connector"}  # fmt: skip
    prefill = Engine({**base, "role": "kv_producer", "engine_id": "P", "pool_tokens": 64 * 64,
                      "max_num_batched_tokens": 64, "extra": STREAMED})  # fmt: skip
    decode = Engine({**base, "role": "kv_consumer", "engine_id": "D", "pool_tokens": 32 * 64,
                     "extra": {**STREAMED, "idle_wait_s": WAIT_S}})  # fmt: skip
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def record_waits(decode: Engine) -> list[float]:
    """Every ``wait_s`` the worker passes to its decode service's ``results``, in call order (one per step)."""
    service = decode.workers[0]._worker.decode
    waits: list[float] = []
    results = service.results

    def recorded(wait_s: float = 0.0):
        waits.append(wait_s)
        return results(wait_s)

    service.results = recorded
    return waits


def stream(prefill: Engine, decode: Engine, rid: str, seed: int, max_tokens: int) -> None:
    """Both legs of a streamed request at once, as the router sends them."""
    prompt, segments = list(range(seed, seed + PROMPT)), [(PROMPT, seed)]
    transfer = f"tx-{rid}"
    prefill.add(rid, prompt, segments, {"do_remote_decode": True, "glm_pd_transfer_id": transfer})
    params = {"do_remote_prefill": True, "glm_pd_protocol": PROTOCOL_VERSION, "glm_pd_transfer_id": transfer,
              "remote_host": "127.0.0.1", "remote_port": prefill.connector._scheduler.port}  # fmt: skip
    decode.add(rid, prompt, segments, params, max_tokens=max_tokens)


class Stepping:
    """Prefill's own loop on a thread, until stopped (its server would run it; decode's loop is the test's)."""

    def __init__(self, engine: Engine) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=engine.run, args=(self.stop.is_set, 100000), daemon=True)
        self.thread.start()

    def __enter__(self) -> Stepping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def test_a_parked_decode_waits_for_its_load_and_wakes_when_it_ends(engines) -> None:
    """Decode admits a streamed request and parks it while prefill computes: each of its steps offers to wait
    ``idle_wait_s`` and returns when the load ends, so the steps during the park are bounded by its length over
    the wait (with ``idle_wait_s`` 0, the same park took one step per loop pass), and the step that reports the
    load returns before its bound. The request then decodes from exact bytes."""
    prefill, decode = engines
    waits = record_waits(decode)
    stream(prefill, decode, "S", 100, max_tokens=3)
    decode.step()  # admitted and parked: the load runs against a prefill that has not stepped yet
    assert decode.scheduler.requests["S"].status == RequestStatus.WAITING_FOR_REMOTE_KVS, decode.state()
    parked = []  # (seconds the step took, wait it offered)
    t0 = time.monotonic()
    with Stepping(prefill):
        while decode.scheduler.requests["S"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            began, calls = time.monotonic(), len(waits)
            decode.step()
            parked.append((time.monotonic() - began, waits[calls]))
        park_s = time.monotonic() - t0
        decode.run(lambda: decode.tracked["S"].finish is not None)
        decode.run(lambda: prefill.idle() and decode.idle())
    s = decode.tracked["S"]
    assert s.finish == "length" and s.mismatched == [], s
    assert all(offered == WAIT_S for _, offered in parked[:-1]), parked
    assert len(parked) <= math.ceil(park_s / WAIT_S) + 2, (park_s, parked)
    assert parked[-1][0] < WAIT_S, f"the step that saw the load end waited out its bound: {parked}"


def test_steps_that_compute_never_wait(engines) -> None:
    """A request decoding beside a parked streamed load: every step schedules its token, and none of them offers
    to wait (a wait there would stall every running request for the park)."""
    prefill, decode = engines
    with Stepping(prefill):
        stream(prefill, decode, "A", 200, max_tokens=200)
        decode.run(lambda: len(decode.tracked["A"].tokens) > 0)
    waits = record_waits(decode)
    stream(prefill, decode, "B", 300, max_tokens=3)  # prefill does not step: B stays parked
    for _ in range(20):
        decode.step()
    assert decode.scheduler.requests["B"].status == RequestStatus.WAITING_FOR_REMOTE_KVS, decode.state()
    assert len(decode.tracked["A"].tokens) > 20 and waits == [0.0] * 20, (len(decode.tracked["A"].tokens), waits)
    with Stepping(prefill):
        decode.run(lambda: decode.tracked["B"].finish is not None and decode.tracked["A"].finish is not None)
        decode.run(lambda: prefill.idle() and decode.idle())
    assert decode.tracked["B"].mismatched == [] and decode.tracked["A"].mismatched == []


def test_the_wait_leaves_room_for_lease_renewals(tiny_model) -> None:
    """Renewals of prefill's leases go out with decode's steps (every ``lease_s``/6): with ``lease_s`` 6 a step
    offers at most half of that second, whatever ``idle_wait_s`` says."""
    port = free_port_range(8)
    base = {"model": tiny_model, "block_size": 64, "tp": 1, "port": port, "lease_s": 6.0,
            "module_path": "glm_pd_vllm.connector"}  # fmt: skip
    prefill = Engine({**base, "role": "kv_producer", "engine_id": "P", "pool_tokens": 64 * 64, "extra": STREAMED})
    decode = Engine({**base, "role": "kv_consumer", "engine_id": "D", "pool_tokens": 32 * 64,
                     "extra": {**STREAMED, "idle_wait_s": WAIT_S}})  # fmt: skip
    try:
        waits = record_waits(decode)
        stream(prefill, decode, "S", 400, max_tokens=2)
        decode.step()
        decode.step()
        assert waits[-1] == 0.5, waits
        with Stepping(prefill):
            decode.run(lambda: decode.tracked["S"].finish is not None)
            decode.run(lambda: prefill.idle() and decode.idle())
        assert decode.tracked["S"].mismatched == []
    finally:
        decode.shutdown()
        prefill.shutdown()

"""Prefill's streamed steps wait for their ready event, in step order (common/glm_pd_common/handoff/prefill/streams.py).

On a GPU a step's writes are queued, not done, when vLLM hands the connector its step: the worker records a CUDA
event behind them and the announcement must wait for it. These gates are ready events completed by hand, so the
rule is checked on CPU: nothing is announced before its event, a later step never overtakes an earlier one, and a
failed event ends the transfer (what the step wrote cannot be trusted) without holding up another transfer's.
"""

from __future__ import annotations

import time

import numpy as np

from glm_pd_common.handoff.prefill.streams import Advance, StreamCall, StreamTable
from glm_pd_common.handoff.wire import protocol

SUB = b"decode-0"


class Gate:
    """A ready event the test completes (or breaks) by hand."""

    def __init__(self) -> None:
        self.done = False
        self.broken = False

    def query(self) -> bool:
        if self.broken:
            raise RuntimeError("device-side assert")
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("the service never blocks on an event")


def _opened(*transfer_ids: str) -> StreamTable:
    table = StreamTable(timeout_s=60, clock=time.monotonic)
    for tid in transfer_ids:
        table.take(StreamCall(tid, num_tokens=1000))
        table.subscribe(SUB, protocol.Subscribe(v=protocol.PROTOCOL_VERSION, request_id=tid, num_tokens=1000), "decode")
    return table


def _progress(out: list[tuple[bytes, protocol.Message]]) -> list[tuple[int, list[int]]]:
    return [(m.ready_tokens, m.pages) for _, m in out if isinstance(m, protocol.Progress)]


def test_a_step_is_announced_only_once_its_event_completes_and_never_before_an_earlier_step() -> None:
    table = _opened("t")
    first, second = Gate(), Gate()
    assert table.take(Advance("t", np.array([7, 3]), 128, first)) == []
    assert table.take(Advance("t", np.array([9]), 192, second)) == []
    assert _progress(table.announce_ready()) == []
    second.done = True  # the later step's event alone: still nothing, the earlier step's writes may be in flight
    assert _progress(table.announce_ready()) == []
    first.done = True
    assert _progress(table.announce_ready()) == [(128, [7, 3]), (192, [9])]
    assert table.announce_ready() == []


def test_a_failed_event_ends_its_transfer_and_drops_its_later_steps_only() -> None:
    table = _opened("bad", "good")
    broken, later, other = Gate(), Gate(), Gate()
    table.take(Advance("bad", np.array([1]), 64, broken))
    table.take(Advance("good", np.array([5]), 64, other))
    table.take(Advance("bad", np.array([2]), 128, later))
    broken.broken = True
    other.done = later.done = True
    out = table.announce_ready()
    failed = [m for _, m in out if isinstance(m, protocol.Failed)]
    assert [(m.request_id, m.code) for m in failed] == [("bad", "aborted")]
    assert "ready event failed" in failed[0].reason and "device-side assert" in failed[0].reason
    sent = [(m.request_id, m.pages) for _, m in out if isinstance(m, protocol.Progress)]
    assert sent == [("good", [5])]  # bad's later step was dropped, good's went out
    again = table.subscribe(
        SUB, protocol.Subscribe(v=protocol.PROTOCOL_VERSION, request_id="bad", num_tokens=1000), "decode"
    )
    assert isinstance(again[0][1], protocol.Failed)  # a late subscriber is told at once


def test_an_engine_end_drops_the_steps_still_waiting_for_their_event() -> None:
    table = _opened("t")
    gate = Gate()
    table.take(Advance("t", np.array([4]), 64, gate))
    out = table.take(StreamCall("t", why="preempted"))
    assert [m.reason for _, m in out if isinstance(m, protocol.Failed)] == ["prefill ended the request: preempted"]
    gate.done = True
    assert table.announce_ready() == []
    assert len(table) == 0

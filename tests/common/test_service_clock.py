"""Prefill's service clock (glm_pd_common/handoff/prefill/clock.py) and the bounded set of ended ids
(handoff/recent.py), on a hand-driven source: no sleeping."""

from __future__ import annotations

import numpy as np
import pytest

from glm_pd_common.errors import LeaseExpired
from glm_pd_common.handoff.prefill.clock import ServiceClock
from glm_pd_common.handoff.prefill.lease import LeaseTable
from glm_pd_common.handoff.recent import RecentIds


class Source:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_time_inside_an_allowed_wait_or_a_short_turn_runs_on() -> None:
    src = Source()
    clock = ServiceClock(away_s=0.5, source=src)
    clock.checkpoint(then_wait_s=2.0)
    src.t += 2.3  # the wait ran out and the turn took 0.3 s: not away
    assert clock.checkpoint() == 0.0
    src.t += 0.4
    assert clock.checkpoint() == 0.0
    assert clock.now() == pytest.approx(102.7)


def test_time_away_stops_the_clock_once_for_every_table_reading_it() -> None:
    src = Source()
    clock = ServiceClock(away_s=0.5, source=src)
    leases = LeaseTable(ttl_s=1.0, transfer_ttl_s=1.0, clock=clock.now)
    leases.grant("r", np.arange(3))
    clock.checkpoint(then_wait_s=0.002)
    src.t += 30.0  # stopped inside the wait (SIGSTOP): 30 s past its end
    assert clock.checkpoint() == pytest.approx(29.998)
    assert clock.now() == pytest.approx(100.002)
    assert leases.expire() == []  # the lease's second has not passed in service time
    leases.claim("r")
    clock.checkpoint(then_wait_s=2.0)
    src.t += 1.5  # inside a wait: service time runs, and the claim's hold runs out
    assert clock.checkpoint() == 0.0
    with pytest.raises(LeaseExpired):
        leases.claim("r")


def test_recent_ids_keep_the_newest_and_say_why() -> None:
    recent = RecentIds(capacity=3)
    for i in range(5):
        recent.add(f"r{i}", "expired" if i % 2 else "released")
    assert len(recent) == 3 and "r1" not in recent and recent.get("r4") == "released"
    recent.add("r2", "aborted")  # known again: the newest
    recent.add("r5")
    assert "r3" not in recent and recent.get("r2") == "aborted" and recent.get("r5") == ""
    recent.discard("r2")
    assert "r2" not in recent and recent.get("never") is None

"""Lanes shared by prefill's transfer lanes and decode's load lanes (glm_pd_common/handoff/lanes.py): which lane
a key gets, and the pool of threads that serves them."""

from __future__ import annotations

import threading
import time

import pytest
import xxhash

from glm_pd_common.handoff.lanes import LaneMap, LanePool


def test_peers_spread_first_come_first_served_and_keep_their_lane() -> None:
    lanes = LaneMap(3)
    first = [lanes.assign(f"peer-{i}") for i in range(5)]
    assert first == [0, 1, 2, 0, 1]
    assert [lanes.assign(f"peer-{i}") for i in (4, 0, 3)] == [1, 0, 0]
    assert [lanes.of(f"peer-{i}") for i in range(5)] == first
    assert len(lanes) == 5


def test_past_the_cap_a_key_is_hashed_and_never_stored() -> None:
    lanes = LaneMap(4, remembered=2)
    lanes.assign("a")
    lanes.assign("b")
    late = [f"remote-{i}" for i in range(50)]
    expected = [xxhash.xxh3_64_intdigest(k.encode()) % 4 for k in late]
    assert [lanes.assign(k) for k in late] == expected
    assert [lanes.assign(k) for k in late] == expected  # stable without being remembered
    assert len(lanes) == 2
    assert len(set(expected)) > 1  # the hash spreads them, not one lane for every late key
    assert lanes.of("never-seen") == xxhash.xxh3_64_intdigest(b"never-seen") % 4


def test_no_lanes_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one lane"):
        LaneMap(0)


def test_a_blocked_key_holds_only_its_own_lane() -> None:
    release = threading.Event()
    done: list[str] = []

    def work(job: str) -> None:
        if job == "a1":
            release.wait(5)
        done.append(job)

    lanes: LanePool[str] = LanePool("test", work, count=2)
    try:
        lanes.submit("peer-a", "a1")
        lanes.submit("peer-a", "a2")
        lanes.submit("peer-b", "b1")
        deadline = time.monotonic() + 5
        while "b1" not in done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == ["b1"]  # peer b ran while peer a's first job was stuck; a2 waits behind a1
        release.set()
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == ["b1", "a1", "a2"]
    finally:
        release.set()
        lanes.close(timeout_s=5)


def test_lanes_are_bounded_and_keys_keep_theirs() -> None:
    lanes: LanePool[str] = LanePool("test", lambda job: None, count=3)
    try:
        first = [lanes.lane_of(f"peer-{i}") for i in range(7)]
        assert first == [0, 1, 2, 0, 1, 2, 0]  # first come first served, then shared
        assert [lanes.lane_of(f"peer-{i}") for i in range(7)] == first
    finally:
        lanes.close(timeout_s=5)


def test_a_wake_runs_the_turn_between_jobs_now_and_idle_runs_on_the_timeout() -> None:
    turns: list[int] = []
    idled = threading.Event()
    lanes: LanePool[str] = LanePool(
        "test", lambda job: None, count=2, idle_s=60, between=turns.append, idle=lambda lane: idled.set()
    )
    try:
        deadline = time.monotonic() + 5
        while len(turns) < 2 and time.monotonic() < deadline:  # each lane takes its first turn before waiting
            time.sleep(0.01)
        before = list(turns)
        lanes.wake(1)
        while turns.count(1) < before.count(1) + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert turns.count(1) == before.count(1) + 1 and turns.count(0) == before.count(0)
        assert not idled.is_set()  # 60 s have not passed: the wake, not the idle timeout, ran the turn
    finally:
        lanes.close(timeout_s=5)
    quick: LanePool[str] = LanePool("test", lambda job: None, count=1, idle_s=0.01, idle=lambda lane: idled.set())
    try:
        assert idled.wait(5)
    finally:
        quick.close(timeout_s=5)


def test_a_failing_job_does_not_kill_its_lane_and_current_names_the_lane() -> None:
    seen: list[int | None] = []
    pools: list[LanePool[str]] = []

    def work(job: str) -> None:
        seen.append(pools[0].current())
        if job == "bad":
            raise RuntimeError("a bug in one job")

    lanes = LanePool("test", work, count=1)
    pools.append(lanes)
    try:
        lanes.submit("k", "bad")
        lanes.submit("k", "good")
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [0, 0] and lanes.current() is None
    finally:
        lanes.close(timeout_s=5)

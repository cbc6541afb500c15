"""Prefill's per-peer lanes (glm_pd_sglang/lanes.py): one key's jobs in order, other keys not held behind them."""

import threading
import time

from glm_pd_sglang.lanes import Lanes


def test_a_blocked_key_holds_only_its_own_lane() -> None:
    release = threading.Event()
    done: list[str] = []

    def work(job: str) -> None:
        if job == "a1":
            release.wait(5)
        done.append(job)

    lanes: Lanes[str] = Lanes("test", work, count=2)
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
    lanes: Lanes[str] = Lanes("test", lambda job: None, count=3)
    try:
        first = [lanes.lane_of(f"peer-{i}") for i in range(7)]
        assert first == [0, 1, 2, 0, 1, 2, 0]  # first come first served, then shared
        assert [lanes.lane_of(f"peer-{i}") for i in range(7)] == first
    finally:
        lanes.close(timeout_s=5)

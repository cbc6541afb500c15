"""Lane assignment shared by prefill's transfer lanes and decode's load lanes (common/handoff/lanes.py)."""

from __future__ import annotations

import pytest
import xxhash

from glm_pd_common.handoff.lanes import LaneMap


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

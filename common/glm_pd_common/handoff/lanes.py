"""Which of a fixed set of lanes (service threads) serves a peer, for prefill's transfer lanes and decode's load lanes.

A peer keeps its lane, so its work stays in order; peers are spread first come first served. Keys come from remote
messages, so only ``remembered`` of them are kept: past that, a key's lane is its hash (stable, never stored).
"""

from __future__ import annotations

import xxhash

MAX_REMEMBERED = 4096


class LaneMap:
    """Key -> lane. Not thread-safe: its owner calls it under the lock that guards its queues."""

    def __init__(self, count: int, *, remembered: int = MAX_REMEMBERED) -> None:
        if count < 1:
            raise ValueError(f"need at least one lane, got {count}")
        self.count = count
        self._remembered = remembered
        self._lane_of: dict[str, int] = {}

    def assign(self, key: str) -> int:
        """The key's lane, giving it the next one if it has none yet."""
        lane = self._lane_of.get(key)
        if lane is None:
            lane = len(self._lane_of) % self.count
            if len(self._lane_of) < self._remembered:
                self._lane_of[key] = lane
            else:
                lane = self.hashed(key)
        return lane

    def of(self, key: str) -> int:
        """The lane a key's work runs on, without assigning one (a key never assigned gets its hashed lane)."""
        return self._lane_of.get(key, self.hashed(key))

    def hashed(self, key: str) -> int:
        return xxhash.xxh3_64_intdigest(key.encode()) % self.count

    def __len__(self) -> int:
        return len(self._lane_of)

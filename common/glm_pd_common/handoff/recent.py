"""Ids that ended lately, remembered boundedly, so a late message about one is answered at once.

Ids come from peers, so only the newest ``capacity`` are kept: an older one is answered as if never seen, which
every caller handles anyway (a lease never granted is refused the same way, only later).
"""

from __future__ import annotations

from collections import OrderedDict

CAPACITY = 4096


class RecentIds:
    """id -> why it ended (or ""), the newest ``capacity`` of them; adding a known id makes it the newest."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()

    def add(self, key: str, why: str = "") -> None:
        self._ids.pop(key, None)
        self._ids[key] = why
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def get(self, key: str) -> str | None:
        return self._ids.get(key)

    def discard(self, key: str) -> None:
        self._ids.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)

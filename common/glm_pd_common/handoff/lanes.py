"""Lanes: a fixed set of service threads, and which of them serves a peer (prefill's transfer lanes, decode's loads).

A peer keeps its lane, so its work stays in order; peers are spread first come first served. Keys come from remote
messages, so only ``remembered`` of them are kept: past that, a key's lane is its hash (stable, never stored).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import xxhash

logger = logging.getLogger(__name__)

T = TypeVar("T")

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


class _Wake:
    """Queued to make an idle lane take its turn now (``between``) instead of at its next timeout."""


_WAKE = _Wake()


class LanePool(Generic[T]):
    """A fixed set of service threads, each draining its own queue in order: prefill's transfer lanes (SGLang)
    and decode's load lanes. A key keeps its lane (``LaneMap``), so one key's jobs never overlap or reorder, and
    a key stuck in a job holds only its own lane, never every queued job up to its timeout.

    ``start()`` runs first on each lane's thread (the endpoint's device selection); ``between(lane)`` before
    each wait for a job (decode sends due renewals there, so a renewal never waits behind a backlog of loads);
    ``idle(lane)`` after ``idle_s`` with no job (heartbeats).
    """

    def __init__(
        self,
        name: str,
        work: Callable[[T], None],
        *,
        count: int,
        idle_s: float | None = None,
        between: Callable[[int], None] | None = None,
        idle: Callable[[int], None] | None = None,
        start: Callable[[], None] | None = None,
    ) -> None:
        self._map = LaneMap(count)
        self._start = start
        self._work, self._between, self._idle, self._idle_s = work, between, idle, idle_s
        self._queues: list[queue.SimpleQueue[T | _Wake | None]] = [queue.SimpleQueue() for _ in range(count)]
        self._lock = threading.Lock()
        self._here = threading.local()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, key: str, job: T) -> int:
        """Queue ``job`` on ``key``'s lane (assigning one if the key has none); returns the lane."""
        lane = self.lane_of(key)
        self._queues[lane].put(job)
        return lane

    def lane_of(self, key: str) -> int:
        with self._lock:
            return self._map.assign(key)

    def lane_for(self, key: str) -> int:
        """The lane ``key``'s work runs on, without assigning one."""
        with self._lock:
            return self._map.of(key)

    def wake(self, lane: int) -> None:
        self._queues[lane].put(_WAKE)

    def current(self) -> int | None:
        """The lane the calling thread serves, or None off the pool's threads."""
        lane: int | None = getattr(self._here, "lane", None)
        return lane

    def queued(self) -> int:
        return sum(q.qsize() for q in self._queues)

    def assigned(self) -> int:
        """Keys remembered (bounded by ``LaneMap``'s cap)."""
        with self._lock:
            return len(self._map)

    def close(self, timeout_s: float) -> None:
        """Stop after the jobs already queued; a lane stuck in a job is left to its own bounded wait."""
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.1))

    def _run(self, lane: int) -> None:
        jobs = self._queues[lane]
        self._here.lane = lane
        if self._start is not None:
            self._start()
        while True:
            self._guarded(self._between, lane)
            try:
                job = jobs.get(timeout=self._idle_s)
            except queue.Empty:
                self._guarded(self._idle, lane)
                continue
            if job is None:
                return
            if isinstance(job, _Wake):
                continue
            try:
                self._work(job)
            except Exception:  # the work reports its own failures; a bug must not kill the lane
                logger.exception("glm-pd: lane %d failed on a job", lane)

    @staticmethod
    def _guarded(step: Callable[[int], None] | None, lane: int) -> None:
        if step is None:
            return
        try:
            step(lane)
        except Exception:  # a lost renewal or heartbeat is retried on the next turn
            logger.exception("glm-pd: lane %d failed between jobs", lane)

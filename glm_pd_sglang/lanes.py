"""Per-peer transfer lanes on prefill: a bounded set of threads, each draining its own queue in order.

One thread for every transfer would let a hung decode peer hold every queued room up to the transfer
timeout. Each destination (a room's set of decode ranks) is instead pinned to one lane, first come first
served, so its chunks stay in order while another peer's rooms run on another lane. Past ``count``
destinations, lanes are shared; past ``_MAX_REMEMBERED`` the lane is picked by hash (keys come from remote
registrations, so the map must not grow without bound).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import xxhash

logger = logging.getLogger(__name__)

LANES = 8  # transfer threads per prefill rank; more decode peers than this share lanes
_MAX_REMEMBERED = 4096

T = TypeVar("T")


class Lanes(Generic[T]):
    """Run ``work(job)`` on the lane of each job's key; jobs of one key never overlap or reorder."""

    def __init__(self, name: str, work: Callable[[T], None], *, count: int = LANES) -> None:
        if count < 1:
            raise ValueError(f"need at least one lane, got {count}")
        self._work = work
        self._queues: list[queue.SimpleQueue[T | None]] = [queue.SimpleQueue() for _ in range(count)]
        self._lane_of: dict[str, int] = {}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, key: str, job: T) -> None:
        self._queues[self.lane_of(key)].put(job)

    def lane_of(self, key: str) -> int:
        with self._lock:
            lane = self._lane_of.get(key)
            if lane is None:
                lane = len(self._lane_of) % len(self._queues)
                if len(self._lane_of) < _MAX_REMEMBERED:
                    self._lane_of[key] = lane
                else:
                    lane = xxhash.xxh3_64_intdigest(key.encode()) % len(self._queues)
            return lane

    def queued(self) -> int:
        return sum(q.qsize() for q in self._queues)

    def close(self, timeout_s: float) -> None:
        """Stop after the jobs already queued; a lane stuck in a job is left to its own bounded wait."""
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    def _run(self, lane: int) -> None:
        jobs = self._queues[lane]
        while (job := jobs.get()) is not None:
            try:
                self._work(job)
            except Exception:  # the work reports its own failures; a bug must not kill the lane
                logger.exception("glm-pd: transfer lane %d failed on a job", lane)

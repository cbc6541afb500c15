"""Per-peer transfer lanes on prefill: a bounded set of threads, each draining its own queue in order.

One thread for every transfer would let a hung decode peer hold every queued room up to the transfer
timeout. Each destination (a room's set of decode ranks) is instead pinned to one lane, first come first
served, so its chunks stay in order while another peer's rooms run on another lane (``LaneMap``: past
``count`` destinations lanes are shared, past its cap they are picked by hash).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from glm_pd_common.handoff.lanes import LaneMap

logger = logging.getLogger(__name__)

LANES = 8  # transfer threads per prefill rank; more decode peers than this share lanes

T = TypeVar("T")


class Lanes(Generic[T]):
    """Run ``work(job)`` on the lane of each job's key; jobs of one key never overlap or reorder."""

    def __init__(self, name: str, work: Callable[[T], None], *, count: int = LANES) -> None:
        self._lanes = LaneMap(count)
        self._work = work
        self._queues: list[queue.SimpleQueue[T | None]] = [queue.SimpleQueue() for _ in range(count)]
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
            return self._lanes.assign(key)

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

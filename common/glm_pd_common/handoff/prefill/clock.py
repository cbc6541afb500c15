"""Prefill's service clock: monotonic time that stands still while the service thread is away.

Every deadline prefill keeps measures decode's time (a lease, a claim that came early, a grant waiting for the GPU,
a subscription waiting for the engine, a decode's silence). When the one thread that answers decode is held up
(a GC pause, a busy host, a stopped process), decode's messages sit unanswered in the socket, and that time is not
decode's to lose: the clock pauses by as long, so every table that reads it holds over at once, and what queued
meanwhile is answered before anything expires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

AWAY_S = 0.5  # this long past the allowed wait means the thread was held up (a turn takes milliseconds)


class ServiceClock:
    """``now()`` is the monotonic clock less every stretch the thread was away. The thread calls ``checkpoint``
    whenever it is at the socket, naming how long it may wait there next: running past that by ``away_s`` or more
    is time away."""

    def __init__(self, *, away_s: float = AWAY_S, source: Callable[[], float] = time.monotonic) -> None:
        self.away_s = away_s
        self._source = source
        self._held = 0.0
        self._back_by = source()

    def now(self) -> float:
        return self._source() - self._held

    def checkpoint(self, then_wait_s: float = 0.0) -> float:
        """Hold the clock for any time away since the last checkpoint's allowance; returns that time (or 0)."""
        real = self._source()
        away, self._back_by = real - self._back_by, real + then_wait_s
        if away < self.away_s:
            return 0.0
        self._held += away
        logger.warning("glm-pd prefill: the service thread was away %.2f s; its clock held by as much", away)
        return away

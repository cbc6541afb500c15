"""Thread hand-off helpers shared by the prefill and decode services."""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


def drain(q: queue.SimpleQueue[T]) -> list[T]:
    """Everything queued now, without blocking."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out

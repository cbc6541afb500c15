"""Thread hand-off helpers shared by the prefill and decode services."""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


def drain(q: queue.SimpleQueue[T], wait_s: float = 0.0) -> list[T]:
    """Everything queued now; when nothing is, waits up to ``wait_s`` for the first item (then takes what
    else is queued by then)."""
    out = []
    if wait_s > 0:
        try:
            out.append(q.get(timeout=wait_s))
        except queue.Empty:
            return out
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out

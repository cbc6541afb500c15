"""Bounded line reads from a child's pipe: a read that could block forever instead times out."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import IO


class LineReader:
    """Lines of ``stream`` read on a daemon thread, handed out with a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def next_matching(self, match: Callable[[str], bool], timeout_s: float) -> str | None:
        """The next line ``match`` accepts, or None at end of stream; TimeoutError past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching line within {timeout_s} s")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError(f"no matching line within {timeout_s} s") from None
            if line is None or match(line):
                return line

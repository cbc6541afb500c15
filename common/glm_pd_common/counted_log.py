"""A log line for what a stranger can make happen often (refused frames, refused handshakes): at most one line per
interval, with the count since the last, so a flood costs one line a second, not one per message."""

from __future__ import annotations

import logging
import threading
import time


class CountedLog:
    def __init__(self, logger: logging.Logger, message: str, every_s: float = 1.0) -> None:
        self._logger, self._message, self._every_s = logger, message, every_s  # message: "%d" the count, "%s" detail
        self._lock = threading.Lock()  # ZAP's thread and a service thread may both note
        self.total = 0
        self._unlogged, self._next = 0, 0.0

    def note(self, detail: object = "") -> None:
        with self._lock:
            self.total += 1
            self._unlogged += 1
            now = time.monotonic()
            if now >= self._next:
                self._logger.warning(self._message, self._unlogged, detail)
                self._unlogged, self._next = 0, now + self._every_s

"""GPU completion on prefill: the event the service waits on before anyone reads what the GPU wrote, and the
grants still waiting for theirs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class ReadyEvent(Protocol):
    """Completes once the GPU work that wrote a grant's pages has finished: a ``torch.cuda.Event`` recorded on
    the writing stream after the forward (with MTP, after the drafter's last step) satisfies it. The service
    only polls ``query``, on its own thread: an event tied to a device should make that device current for
    the call itself. ``synchronize`` is part of the shape so any CUDA event type fits."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class _Unready:
    pages: np.ndarray
    ready: ReadyEvent
    deadline: float


class UnreadyGrants:
    """Grants whose pages the GPU may still be writing: no lease (and no lease clock) until their event completes.
    Polled once per service turn, never blocked on; a grant whose event has not completed within ``ttl_s`` ends
    (a hung GPU must not hold pages forever), and so does one whose event fails (the pages cannot be trusted)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._grants: dict[str, _Unready] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._grants

    def __len__(self) -> int:
        return len(self._grants)

    def add(self, request_id: str, pages: np.ndarray, ready: ReadyEvent) -> None:
        self._grants[request_id] = _Unready(pages, ready, self._clock() + self.ttl_s)

    def pop(self, request_id: str) -> bool:
        return self._grants.pop(request_id, None) is not None

    def poll(self) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, str, str]]]:
        """(request id, pages) of the grants now ready, and (request id, outcome, why) of those that ended."""
        now = self._clock()
        ready, ended = [], []
        for request_id, grant in list(self._grants.items()):
            try:
                done = grant.ready.query()
            except Exception as exc:  # a device error
                ended.append((request_id, "aborted", f"its ready event failed: {exc!r}"))
            else:
                if done:
                    ready.append((request_id, grant.pages))
                elif now > grant.deadline:
                    why = "its pages were not ready (the GPU work writing them had not finished) within a lease"
                    ended.append((request_id, "expired", why))
                else:
                    continue
            del self._grants[request_id]
        return ready, ended

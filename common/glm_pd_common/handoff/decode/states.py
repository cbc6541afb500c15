"""The state of one request's handoff, with the same states and numbering as SGLang's ``KVPoll``.

Transitions are checked so an adapter cannot report Success for a request that never transferred, and a
terminal state never changes again; each step is recorded for reports and metrics.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class HandoffState(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


_ALLOWED = {
    HandoffState.BOOTSTRAPPING: {HandoffState.WAITING_FOR_INPUT, HandoffState.FAILED},
    HandoffState.WAITING_FOR_INPUT: {HandoffState.TRANSFERRING, HandoffState.FAILED},
    HandoffState.TRANSFERRING: {HandoffState.SUCCESS, HandoffState.FAILED},
    HandoffState.SUCCESS: set(),
    HandoffState.FAILED: set(),
}


@dataclass
class Handoff:
    request_id: str
    state: HandoffState = HandoffState.BOOTSTRAPPING
    reason: str | None = None
    history: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history.append((self.state.name, time.monotonic()))

    def advance(self, new: HandoffState, reason: str | None = None) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.state.name} -> {new.name}")
        self.state = new
        if reason is not None:
            self.reason = reason
        self.history.append((new.name, time.monotonic()))

    def fail(self, reason: str) -> None:
        """Fail unless already terminal (a late second failure keeps the first reason)."""
        if self.state not in (HandoffState.SUCCESS, HandoffState.FAILED):
            self.advance(HandoffState.FAILED, reason)

    @property
    def states(self) -> list[str]:
        return [name for name, _ in self.history]

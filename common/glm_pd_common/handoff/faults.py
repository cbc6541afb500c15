"""Where a test may disturb a handoff: the one fault-injection interface the services call.

Production passes none, and every call site is then skipped. The fault matrices' injector
(``tests/support/faults.py``, with a transport that wraps the real one) and the demo's corruption implement it.
Nothing here is reachable from a peer or from configuration: an object is handed to a service by whoever built it.
"""

from __future__ import annotations

from typing import Literal, Protocol

from glm_pd_common.layout.regions import Region

# before_claim: handshaken, the lease not yet claimed; posting: the next batch is about to be posted (the load's first,
# or a room's); mid_transfer: the first batch is posted, the others not yet; before_release: read (and verified),
# not yet confirmed
FaultPoint = Literal["before_claim", "posting", "mid_transfer", "before_release", "verifying"]


class HandoffFaults(Protocol):
    """Calls a service makes on the thread that runs a handoff, keyed by its request id (SGLang: its room)."""

    def at(self, key: str, point: FaultPoint) -> None:
        """``key``'s handoff reached ``point``."""
        ...

    def landed(self, key: str, region: Region, offset: int) -> None:
        """``key``'s bytes landed and are about to be checked; ``offset`` in ``region`` is one the check compares."""
        ...

    def confirmations(self, key: str) -> int:
        """How often to send ``key``'s release confirmation (1; 0 loses it, its answer is still awaited)."""
        ...

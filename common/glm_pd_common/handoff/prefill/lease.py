"""Prefill-held pages: a lease per request, claimed before a read, released on decode's confirmation.

The rule that keeps freed pages from ever being served: decode may count a pull as good only when prefill
confirms that the pages were still held when the read finished. Prefill answers that confirmation from
this table: ``release`` raises for a lease that expired (its pages may already hold other data), and
decode must then fail or recompute the request.

A decode request may wait in its engine's queue (no free blocks yet) longer than a lease: decode then renews
the lease every ``renew_interval(lease_s)`` while it waits, and each renewal holds the unclaimed pages one
more ttl from then. A renewal never revives an expired lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from glm_pd_common.errors import LeaseExpired


@dataclass
class Lease:
    request_id: str
    pages: np.ndarray
    expires_at: float
    claimants: set[bytes] = field(default_factory=set)  # side-channel identities of the decode ranks reading
    releases_left: int = 1  # decode ranks that still have to confirm (TP fan-out)
    expectation_set: bool = False


class LeaseTable:
    """Leases of one prefill instance, timed by ``clock`` (the service's: it stands still while the service thread
    is away, so that time never counts against a lease; tests inject one to test expiry without sleeping)."""

    def __init__(self, ttl_s: float, transfer_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.transfer_ttl_s = transfer_ttl_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def grant(self, request_id: str, pages: np.ndarray, releases: int = 1) -> float:
        """Hold ``pages`` for ``request_id`` until ``releases`` confirmations; returns the expiry time.
        A duplicate id is refused."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id} already holds a lease")
        lease = Lease(request_id, np.asarray(pages, dtype=np.int64), self._clock() + self.ttl_s, releases_left=releases)
        self._leases[request_id] = lease
        return lease.expires_at

    def expect(self, request_id: str, releases: int) -> None:
        """Set how many decode ranks will confirm, once (the first decode rank to speak knows the TP shape)."""
        lease = self._leases.get(request_id)
        if lease is not None and not lease.expectation_set:
            lease.releases_left, lease.expectation_set = releases, True

    def claim(self, request_id: str, by: bytes = b"") -> Lease:
        """Decode is about to read: extend the hold to cover the transfer, or refuse an expired lease."""
        lease = self._live(request_id)
        lease.claimants.add(by)
        lease.expires_at = max(lease.expires_at, self._clock() + self.transfer_ttl_s)
        return lease

    def renew(self, request_id: str) -> bool:
        """Decode still waits to claim: hold the pages ``ttl_s`` from now (never shorter than they were held).
        False for a claimed lease (the claim's hold governs); ``LeaseExpired`` for an unknown or expired one."""
        lease = self._live(request_id)
        if lease.claimants:
            return False
        lease.expires_at = max(lease.expires_at, self._clock() + self.ttl_s)
        return True

    def release(self, request_id: str) -> np.ndarray | None:
        """A decode rank confirms its read; raises ``LeaseExpired`` if the pages were not held to now.
        Returns the pages once the last expected confirmation arrives (the caller frees them), else None."""
        lease = self._live(request_id)
        lease.releases_left -= 1
        if lease.releases_left > 0:
            return None
        del self._leases[request_id]
        return lease.pages

    def drop(self, request_id: str) -> np.ndarray | None:
        """Abort: free the pages whatever the lease's state."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease.pages

    def claimants(self) -> set[bytes]:
        """Every decode identity that holds a claim on a lease now."""
        return set().union(*(lease.claimants for lease in self._leases.values()))

    def expire(self) -> list[Lease]:
        """Remove and return every lease past its expiry (the caller frees their pages)."""
        now = self._clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.request_id]
        return gone

    def _live(self, request_id: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise LeaseExpired(f"request {request_id}: no lease held (expired, released or never granted)")
        if lease.expires_at <= self._clock():
            # Left in the table: ``expire`` hands it to the caller, who frees its pages.
            raise LeaseExpired(f"request {request_id}: lease expired {self._clock() - lease.expires_at:.3f} s ago")
        return lease

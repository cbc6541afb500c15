"""Lease renewals decode owes prefill, per decode lane: kept merged, sent by the lane's own thread.

A request waiting for decode's blocks keeps prefill's lease alive by renewal. The engine asks from its own thread;
the lane that talks to that prefill sends, one batch per prefill rank this rank releases, so renewals share the
lane's connections and never race its loads. Pending renewals are merged per prefill, so a busy lane's backlog
never grows past one set of ids per prefill.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from glm_pd_common.errors import GlmPdError
from glm_pd_common.handoff.decode.links import PrefillLinks
from glm_pd_common.handoff.decode.loads import RemotePrefill
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import MAX_RENEW_IDS, PROTOCOL_VERSION
from glm_pd_common.layout.tp import SideLayout, release_set

logger = logging.getLogger(__name__)


class Renewals:
    def __init__(
        self,
        lanes: int,
        links: PrefillLinks,
        tp_rank: int,
        layouts: Callable[[RemotePrefill], tuple[SideLayout, SideLayout]],
    ) -> None:
        self._links = links
        self._tp_rank = tp_rank
        self._layouts = layouts  # both sides' ranks as the pairing sees them
        self._pending: list[dict[RemotePrefill, set[str]]] = [{} for _ in range(lanes)]
        self._lock = threading.Lock()

    def add(self, lane: int, remote: RemotePrefill, ids: list[str] | set[str]) -> bool:
        """Owe these renewals on ``lane``; True when the lane owed none before (an idle lane must be woken)."""
        with self._lock:
            pending = self._pending[lane]
            was_idle = not pending
            pending.setdefault(remote, set()).update(ids)
        return was_idle

    def due(self, lane: int) -> bool:
        return bool(self._pending[lane])

    def send(self, lane: int, *, connect: bool = True) -> None:
        """Send the lane's renewals, one batch per prefill rank. ``connect=False`` (inside a load's wait): only to
        prefills whose ranks are all connected; the others wait for the lane's next turn. A rank that cannot be
        reached is logged, and its leases are left to expire (the load then fails as ``lease_expired``)."""
        with self._lock:
            pending, self._pending[lane] = self._pending[lane], {}
        for placeholder, ids in pending.items():
            batch = sorted(ids)
            if not placeholder.tp_size and not connect:  # learning a streamed prefill's shape takes a round trip
                self.add(lane, placeholder, ids)
                continue
            try:
                remote = self._links.known(placeholder)
                ranks = release_set(self._tp_rank, *self._layouts(remote))
            except GlmPdError as exc:
                logger.warning(
                    "glm-pd decode: cannot renew %d lease(s) on %s: %s", len(batch), placeholder.engine_id, exc
                )
                continue
            if not connect and any(self._links.connected(remote, rank) is None for rank in ranks):
                self.add(lane, remote, ids)
                continue
            for rank in ranks:
                try:
                    peer = self._links.get(remote, rank)
                    for start in range(0, len(batch), MAX_RENEW_IDS):
                        chunk = batch[start : start + MAX_RENEW_IDS]
                        peer.client.send(protocol.Renew(v=PROTOCOL_VERSION, request_ids=chunk))
                except Exception as exc:  # the lease then expires on its own: the load reports lease_expired
                    logger.warning(
                        "glm-pd decode: could not renew %d lease(s) on prefill %s rank %d (they may expire): %s",
                        len(batch),
                        remote.engine_id,
                        rank,
                        exc,
                    )

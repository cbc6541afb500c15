"""Prefill's side of decode's renewals: the unclaimed leases a decode engine still waits on are held longer.

A renewal is unanswered, so anything it may not renew is ignored (logged at debug): another decode's lease or
transfer, a grant whose pages the GPU has not finished writing (its clock has not started), a claimed lease (the
claim's hold governs) and an ended one. A streamed transfer's id renews its lease.
"""

from __future__ import annotations

import logging

from glm_pd_common.errors import LeaseExpired
from glm_pd_common.handoff.prefill.lease import LeaseState, LeaseTable
from glm_pd_common.handoff.prefill.streams import StreamTable

logger = logging.getLogger(__name__)


def renew(leases: LeaseTable, streams: StreamTable, engine: str, request_ids: list[str]) -> None:
    """Renew, for decode engine ``engine``, what of ``request_ids`` (lease or transfer ids) it may renew."""
    mine = [i for i in request_ids if streams.owned(i, engine)]  # another's transfer: not renewed
    for request_id in [streams.lease_of(i) or i for i in mine]:  # a transfer id: its lease
        if not leases.may_act(request_id, engine):
            logger.debug("glm-pd prefill: renewal of %s ignored: it belongs to another decode", request_id)
            continue
        lease = leases.get(request_id)
        if lease is not None and lease.state is LeaseState.UNREADY:
            logger.debug("glm-pd prefill: renewal of %s ignored: its pages are not ready yet", request_id)
            continue
        try:
            if not leases.renew(request_id, engine):
                logger.debug("glm-pd prefill: renewal of %s ignored: decode has claimed it", request_id)
        except LeaseExpired as exc:
            logger.debug("glm-pd prefill: renewal ignored: %s", exc)

"""Decode's side of a staged read: ask prefill for each slot, read it as one descriptor into a slot of our own
pair, scatter it into our pages (``transport.staging``). A claimed lease's read is opened by its claim; a
streamed transfer's, over tokens prefill has announced, by a ``StreamRead`` and closed by a ``ReadDone``, so
prefill's pair goes back while the transfer runs on.

Slots 0 and 1 are asked at once; once slot ``k`` is read, slot ``k + 2`` is asked (prefill may reuse the slot
``k`` left) before ``k`` is scattered, so prefill's next gather overlaps our read and our scatter. Only the
bytes of the plan decode computed land, in the pages it holds for the request: prefill names where it gathered a
slot, never where the bytes go, and the slot's read is bounds-checked against prefill's announced buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from glm_pd_common.errors import ProtocolError, TransferFailed
from glm_pd_common.handoff.decode.links import PrefillLink, PrefillLinks
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.transport.base import Transport
from glm_pd_common.transport.staging import Staging, staged_runs, stages


def slot_bytes_for(local: Staging | None, peer: PrefillLink, plan: TransferPlan) -> int:
    """The slot size this plan moves in, 0 to post it directly: both ranks must stage, and the plan must be one
    staging pays for (``stages``); slots are the smaller of the two ranks'."""
    theirs = peer.view.staging
    if local is None or theirs is None or not plan.entries:
        return 0
    if not stages(plan, local.mode, plan.entries[0].dst.mem_kind):
        return 0
    return min(local.slot_bytes, theirs.slot_bytes)


def read_staged(
    links: PrefillLinks,
    peer: PrefillLink,
    plan: TransferPlan,
    request_id: str,
    slot_bytes: int,
    staging: Staging,
    transport: Transport,
    timeout_s: float,
    between: Callable[[int], None],
    *,
    opening: protocol.StreamRead | None = None,
    keep: frozenset[str] = frozenset(),
    landed: Callable[[int], object] | None = None,
) -> int:
    """Read ``plan`` from ``peer`` in slots of ``slot_bytes``; returns the slots moved. ``between(k)`` runs before
    slot ``k`` is read (fault points). ``opening`` opens a streamed read first (``request_id`` is its transfer
    id); what arrives meanwhile for a request in ``keep`` waits for its own reader (``PrefillLinks.ask``).
    ``landed(n)`` hears, once each slot but the last is scattered, that the plan's first ``n`` bytes are in our
    pages (so their digests are taken while the next slots move; the last slot's come after the read)."""
    runs = staged_runs(plan, slot_bytes)
    theirs = peer.view.staging
    assert theirs is not None  # slot_bytes_for chose staging with this peer
    pair = staging.pairs.take(timeout_s)
    if pair is None:
        raise TransferFailed(f"no staging slot pair came free within {timeout_s:.0f} s ({staging.pairs.count} pairs)")
    try:
        if opening is not None:
            peer.client.send(opening)
        for k in range(min(2, runs.num_slots)):
            peer.client.send(protocol.Gather(v=PROTOCOL_VERSION, request_id=request_id, slot=k))
        for k in range(runs.num_slots):
            between(k)
            got = links.ask(
                peer,
                protocol.Gather(v=PROTOCOL_VERSION, request_id=request_id, slot=k),
                request_id,
                (protocol.Gathered,),
                send=False,
                keep=keep,
            )
            length = runs.slot_bytes(k)
            if got.slot != k or got.offset + length > theirs.size_bytes:
                raise ProtocolError(
                    f"prefill gathered slot {got.slot} ({length} B) at offset {got.offset} of its "
                    f"{theirs.size_bytes} B staging buffer; decode waited for slot {k}"
                )
            here = staging.slot_addr(pair, k)
            xfer = transport.post(
                peer.agent,
                "READ",
                np.array([here]),
                np.array([theirs.base_addr + got.offset]),
                np.array([length]),
                what=f"staged slot {k} of {runs.num_slots}",
            )
            try:
                transport.wait(xfer, timeout_s)
            finally:
                transport.release(xfer)
            if k + 2 < runs.num_slots:
                peer.client.send(protocol.Gather(v=PROTOCOL_VERSION, request_id=request_id, slot=k + 2))
            elif k + 1 == runs.num_slots and opening is not None:
                peer.client.send(protocol.ReadDone(v=PROTOCOL_VERSION, request_id=request_id))  # before the scatter
                opening = None
            staging.mover.scatter(here, *runs.side(k, "dst"))
            if landed is not None and k + 1 < runs.num_slots:
                landed((k + 1) * slot_bytes)  # every slot but the last is full
    finally:
        staging.pairs.give(pair)
        if opening is not None:  # given up mid-way: prefill's pair goes back now, not when the transfer ends
            peer.client.send(protocol.ReadDone(v=PROTOCOL_VERSION, request_id=request_id))
    return runs.num_slots

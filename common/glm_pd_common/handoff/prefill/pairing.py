"""What a prefill rank serves a decode rank: the plan of a claim, checked against the lease, and how many
releases end a lease. Decode computes the same pairing from the same shapes (``layout.tp``), so a claim for any
other pages is refused here before anything moves."""

from __future__ import annotations

import numpy as np

from glm_pd_common.errors import GlmPdError, PlanError
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import Endpoint, PeerView
from glm_pd_common.layout.pages import suffix_pages
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.layout.shards import TokenShard, token_shard
from glm_pd_common.layout.tp import SideLayout, Source, expected_releases, source_for


def _layouts(local: Endpoint, decode: PeerView) -> tuple[SideLayout, SideLayout]:
    g = local.spec.geometry
    return SideLayout.of_shape(local.shape, g), SideLayout.of_shape(decode.shape, g)


def _served(local: Endpoint, decode: PeerView) -> tuple[Source, TokenShard]:
    """What this rank serves that decode rank (the pairing decode computed), and decode's token shard."""
    rank = decode.shape.tp_rank
    source = source_for(local.shape.tp_rank, rank, *_layouts(local, decode))
    if source is None:
        raise PlanError(f"decode rank {rank} reads nothing from prefill rank {local.shape.tp_rank}")
    return source, token_shard(rank, decode.shape.sharding)


def expected_releases_from(local: Endpoint, decode: PeerView) -> int:
    """How many of that decode's ranks release a lease of this rank (each that reads it, or a dummy)."""
    return expected_releases(local.shape.tp_rank, *_layouts(local, decode))


def claim_plan(
    local: Endpoint, decode: PeerView, held: np.ndarray, msg: protocol.TransferRequest | protocol.StreamRead
) -> TransferPlan:
    """The plan of ``msg`` over the pages ``held`` (a lease's, or a streamed transfer's announced so far): its
    source pages must be exactly the suffix of those this rank serves that decode rank (by the shared rule), or
    it is refused."""
    source, theirs = _served(local, decode)
    own = suffix_pages(
        held,
        msg.num_tokens,
        msg.prefix_tokens,
        source.shard.table_tokens(local.shape.page_tokens),
        align_tokens=theirs.table_tokens(decode.shape.page_tokens),
    )
    if not np.array_equal(own, np.asarray(msg.src_pages, dtype=np.int64)):
        raise GlmPdError(f"request {msg.request_id}: decode's source pages are not the pages it holds")
    return build_plan(
        local.regions,
        decode.regions,
        own,
        np.asarray(msg.dst_pages, dtype=np.int64),
        num_tokens=msg.num_tokens,
        prefix_tokens=msg.prefix_tokens,
        src_shard=source.shard,
        dst_shard=theirs,
        layers=source.layers,
    )

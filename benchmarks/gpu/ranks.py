"""What both processes of the bench build alike: the request's page pools, the agents and the service endpoint.

Both sides derive every byte count from ``layout.spec`` (GLM-5.3) and draw the same page tables from one seed, so
the parent and the child agree on a row's pages without sending them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from glm_pd_common.layout.regions import Region
    from glm_pd_common.layout.spec import CacheSpec
    from glm_pd_common.transport.base import Op, Transport
    from glm_pd_common.transport.staging import Staging

REPO = Path(__file__).resolve().parents[2]
PAGE_TOKENS = 64  # CUDA DSA pages (FACTS §2)
POOL_SLACK_PAGES = 64  # each side's pool holds this many pages more than the request
CHUNKS = 16  # streamed: 131,072 tokens in 8,192-token chunks, the engines' own prefill chunk on an H100/H200
SEED = 28
TIMEOUT_S = 120.0  # a transfer, a load, a child's answer
SETTLE_S = 0.3  # a streamed load subscribes meanwhile
DECODE, PREFILL = "bench-decode", "bench-prefill"  # engine ids
DECODE_AGENT, PREFILL_AGENT = DECODE + "-tp0", PREFILL + "-tp0"  # their services' NIXL agents
RAW_DECODE, RAW_PREFILL = "bench-raw-decode", "bench-raw-prefill"  # the flat buffers' agents
POOLS = ("contiguous", "shuffled")


def page_tables(pages: int, pool_pages: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Prefill's and decode's page tables of one request per pool: ``contiguous`` (pages in order: one run per
    region) and ``shuffled`` (each side a random draw from its whole pool: hardly two neighbours merge)."""
    rng = np.random.default_rng(seed)
    ordered = np.arange(pages, dtype=np.int64)
    shuffled = (rng.permutation(pool_pages)[:pages], rng.permutation(pool_pages)[:pages])
    return {"contiguous": (ordered, ordered.copy()), "shuffled": shuffled}


def spec() -> CacheSpec:
    from glm_pd_common.layout.geometry import ModelGeometry
    from glm_pd_common.layout.spec import CacheSpec

    return CacheSpec.create(ModelGeometry.preset("glm-5.3"))


def transports(caches: Any, flat: Region, names: tuple[str, str], posts: Op) -> tuple[Any, Any]:
    """A flat buffer's raw agent and the caches' service agent (``posts``: its operation, whose GPU path it probes
    at registration and reports)."""
    from glm_pd_common.transport.base import TransportConfig
    from glm_pd_common.transport.factory import create_transport

    raw = create_transport(names[0], TransportConfig(allow_tcp=True, timeout_s=TIMEOUT_S))
    raw.register([flat])
    service = create_transport(names[1], TransportConfig(allow_tcp=True, timeout_s=TIMEOUT_S, posts=posts))
    service.register(caches.regions)
    return raw, service


def endpoint(engine_id: str, extras: dict[str, Any], caches: Any, transport: Transport, staging: Staging) -> Any:
    """The rank as its service sees it, staging buffer included (registered with ``transport`` before the
    handshake, so the peer's agent knows it); ``extras``: the memory kind's own fields (its reader, thread set-up)."""
    from glm_pd_common.handoff.wire.handshake import Endpoint
    from glm_pd_common.layout.fingerprint import PeerShape

    shape = PeerShape(PAGE_TOKENS, 1, 0)
    return Endpoint(engine_id, spec(), caches.regions, transport, shape, staging=staging, **extras)


def span_of(region: Region) -> list[Any]:
    """A region as the JSON the other process rebuilds a ``Span`` from."""
    return [region.base_addr, region.size_bytes, region.mem_kind, region.device_id]

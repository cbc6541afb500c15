"""The handshake: what a rank tells its peer about itself, and the checks before it trusts the peer's word.

A peer's hello is remote input: its fingerprint must match ours field by field, its page size and TP shape
must be convertible, and its region list must be exactly the regions our shared geometry implies, each
with the byte sizes the layout implies. Only then do its regions become plan inputs.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from glm_pd_common.errors import GlmPdError, ProtocolError
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.trust import OPEN, Trust
from glm_pd_common.layout.fingerprint import PeerShape, check_shape, require_match
from glm_pd_common.layout.formats import main_page_format
from glm_pd_common.layout.pages import INT64_MAX
from glm_pd_common.layout.regions import Region, plan_order
from glm_pd_common.layout.shards import owned_layers
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.transport.base import Span, Transport
from glm_pd_common.transport.devices import ThreadSetup, host_only
from glm_pd_common.transport.memory import HOST, MemoryReader
from glm_pd_common.transport.staging import Staging


def hello_proof(session: bytes, peer: str) -> bytes:
    """What a decode process's hellos to ``peer`` (a prefill rank) carry: its keyed digest under the process's
    random ``session`` secret. The same on every hello to that rank, so the rank tells the same decode on a new
    connection from another peer borrowing its agent name; keyed per rank, so one prefill cannot pass it off to
    another."""
    return hashlib.blake2b(peer.encode(), key=session, digest_size=32).digest()


def same_proof(sent: bytes, known: bytes) -> bool:
    """Whether a hello's proof is the one an accepted peer gave (an empty proof proves nothing)."""
    return bool(sent) and hmac.compare_digest(sent, known)


def make_hello(
    engine_id: str,
    spec: CacheSpec,
    shape: PeerShape,
    regions: list[Region],
    backend: str,
    agent_name: str,
    agent_metadata: bytes,
    proof: bytes = b"",
    staging: Staging | None = None,
) -> protocol.Hello:
    return protocol.Hello(
        v=PROTOCOL_VERSION,
        engine_id=engine_id,
        fingerprint=spec.fingerprint(),
        shape=shape,
        regions=[
            protocol.RegionSummary(
                r.kind,
                r.layer_id,
                r.is_mtp,
                r.base_addr,
                r.num_pages,
                r.page_bytes,
                r.page_stride,
                r.mem_kind,
                r.device_id,
            )
            for r in plan_order(regions)
        ],
        transport=backend,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        proof=proof,
        staging=None if staging is None else _summary(staging),
    )


def _summary(staging: Staging) -> protocol.StagingSummary:
    span = staging.span
    return protocol.StagingSummary(span.base_addr, span.size_bytes, staging.slot_bytes, span.mem_kind, span.device_id)


@dataclass(frozen=True)
class Endpoint:
    """This rank as the prefill and decode services see it: identity, caches, transport and shape."""

    engine_id: str
    spec: CacheSpec
    regions: list[Region]
    transport: Transport
    shape: PeerShape
    memory: MemoryReader = HOST  # how digests read the regions (device memory needs the adapter's reader)
    on_thread: ThreadSetup = host_only  # what each thread glm-pd starts runs first (selects the CUDA device)
    trust: Trust = OPEN  # how its side channels authenticate peers (the deployment's credential)
    staging: Staging | None = None  # its staging buffer, registered with ``transport`` (None: direct posting only)

    def hello(self, agent_metadata: bytes, proof: bytes = b"") -> protocol.Hello:
        return make_hello(
            self.engine_id,
            self.spec,
            self.shape,
            self.regions,
            self.transport.backend,
            self.transport.agent_name,
            agent_metadata,
            proof,
            self.staging,
        )


@dataclass(frozen=True)
class PeerView:
    """A validated peer: its identity, shape, and its regions as plan inputs."""

    engine_id: str
    agent_name: str
    shape: PeerShape
    regions: list[Region]
    agent_metadata: bytes
    staging: protocol.StagingSummary | None = None

    @property
    def spans(self) -> list[Span]:
        """What a transfer with this peer may touch there: its regions and its staging buffer."""
        spans = [Span(r.name, r.base_addr, r.size_bytes, r.mem_kind, r.device_id) for r in self.regions]
        if self.staging is not None:
            s = self.staging
            spans.append(Span("staging", s.base_addr, s.size_bytes, s.mem_kind, s.device_id))
        return spans


_ADDRESS_LIMIT = INT64_MAX


def accept_hello(
    local: CacheSpec, hello: protocol.Hello, *, backend: str, role: str, local_role: str = "local"
) -> PeerView:
    """Validate a peer's hello against our spec; raises naming every differing field or bad region."""
    require_match(
        local.fingerprint(), hello.fingerprint, local_name=local_role, remote_name=f"{role} {hello.engine_id}"
    )
    if hello.transport != backend:
        raise ProtocolError(f"{role} {hello.engine_id} uses transport {hello.transport!r}; this side uses {backend!r}")
    shape = hello.shape
    check_shape(shape, side=role)
    g = local.geometry
    held = owned_layers(g.num_layers, g.num_mtp_layers, shape.sharding, shape.tp_rank, shape.tp_size)
    want = [("main", lay) for lay in held] + [("indexer", lay) for lay in g.indexer_layers if lay in held]
    got = [(s.kind, s.layer_id) for s in hello.regions]
    if sorted(got) != sorted(want) or len(set(got)) != len(got):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ProtocolError(
            f"{role} {hello.engine_id} announced regions that do not match the shared geometry: "
            f"missing {missing}, unexpected {extra}, {len(got) - len(set(got))} duplicate(s)"
        )
    formats = {"main": main_page_format(local.row), "indexer": local.indexer.page_format}
    regions = []
    for s in hello.regions:
        try:
            regions.append(
                Region(
                    kind=s.kind,  # type: ignore[arg-type]  # a wire str, matched against the geometry's kinds above
                    layer_id=s.layer_id,
                    is_mtp=s.layer_id >= g.num_layers,
                    base_addr=s.base_addr,
                    page_tokens=shape.page_tokens,
                    page_bytes=s.page_bytes,
                    page_stride=s.page_stride,
                    num_pages=s.num_pages,
                    page_format=formats[s.kind],
                    mem_kind=s.mem_kind,  # type: ignore[arg-type]  # a wire str, not narrowed to MemKind here
                    device_id=s.device_id,
                )
            )
        except GlmPdError as exc:
            raise ProtocolError(f"{role} {hello.engine_id} announced a bad region: {exc}") from exc
        if s.base_addr < 0 or s.is_mtp != (s.layer_id >= g.num_layers):
            raise ProtocolError(f"{role} {hello.engine_id}: region {regions[-1].name} has a bad address or MTP flag")
        if s.base_addr + s.page_stride * s.num_pages > _ADDRESS_LIMIT:
            # run addresses are int64: such a region could only overflow or wrap when a transfer is posted
            raise ProtocolError(
                f"{role} {hello.engine_id}: region {regions[-1].name} ends past the 64-bit address space "
                f"(base {s.base_addr:#x} + {s.num_pages} pages x {s.page_stride} B)"
            )
    staging = hello.staging
    if staging is not None and (
        staging.base_addr + staging.size_bytes > _ADDRESS_LIMIT or not 0 < 2 * staging.slot_bytes <= staging.size_bytes
    ):
        raise ProtocolError(
            f"{role} {hello.engine_id} announced a bad staging buffer: {staging.size_bytes} B at "
            f"{staging.base_addr:#x} in slots of {staging.slot_bytes} B"
        )
    return PeerView(hello.engine_id, hello.agent_name, shape, plan_order(regions), hello.agent_metadata, staging)

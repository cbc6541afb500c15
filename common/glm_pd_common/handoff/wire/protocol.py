"""Versioned wire messages between peers (msgspec msgpack, tagged by ``type``).

Version history:
- 1: hello, query (a hello without joining: what ``glm-pd doctor --peer`` sends), transfer request
  (decode's claim on a lease), claimed, done, released, failed, abort, heartbeat, digest query/reply.
- 2: the hello's fingerprint carries a layout version in place of the protocol version; vLLM's
  ``kv_transfer_params`` and SGLang's backend messages carry this version too. Fields nobody read are gone
  (transfer ``dst_engine_id``; done ``num_bytes``/``digests``; claimed ``num_bytes``/``lease_s``); digests are typed
  as uint64; decode sends heartbeats while idle, so prefill can forget a decode that went silent.
- 3: ``renew`` (decode keeps the leases of requests still waiting for its blocks; unanswered); ``failed``
  carries a ``code`` from ``FAILURE_CODES``, so decode tells a lease expiry from a refusal or a bad request;
  the hello's shape carries ``pages_per_block`` (vLLM's kernel pages per scheduler block, for block ids in
  ``kv_transfer_params``); a release-only confirmation may precede the grant and is held like a claim.
- 4: the hello's shape carries ``sharding`` (context parallelism: token and layer shards); a layer-split rank
  announces only the layers it holds; a decode rank may claim from several prefill ranks per request, and
  vLLM's ``kv_transfer_params`` carry prefill's sharding.
- 5: streamed handoff: ``subscribe`` (decode asks for the progress of a transfer id while prefill still runs)
  and ``progress`` (prefill: the first ``ready_tokens`` are written, in these pages; a lease id once the request
  finished, which decode then claims as in pull); ``abort`` and ``renew`` accept a transfer id.
- 6: the hello carries ``proof``: a decode process's keyed digest of the prefill rank it greets, the same on every
  hello it sends that rank, so prefill tells the same decode on a new connection from another peer borrowing its
  agent name. Side channels authenticate (CURVE) before any message; a lease or streamed transfer belongs to the
  decode engine that first acts on it.
- 7: staged transfers: the hello announces the rank's staging buffer (``staging``); a claim may ask for its runs
  in slots of ``slot_bytes``, and decode then asks for each slot (``gather``) and reads it from where prefill
  says it gathered it (``gathered``). The transport metadata a hello carries names its node, so a rank that
  moves GPU memory by cuda_ipc (no RDMA) refuses a peer on another node.
  Digests are ``layout.digest_words``' keyed word sums (computable on a GPU), no longer xxh3-64.
- 8: staged streamed reads: a subscriber asks prefill to cut a span of the tokens already announced into slots
  (``stream_read``), asks for each slot as in a staged claim (``gather``), and ends the read (``read_done``), so
  its slot pair goes back while the transfer runs on. A claim is answered ``claimed`` at once; the digests a
  verifying claim asked for follow in ``source_digests``, computed while decode reads.

A message is decoded whole and checked before anything acts on it: the size cap first, then the version
from a minimal header, then the full shape. Nothing is half-applied.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union, get_args

import msgspec

from glm_pd_common.decoding import decode_as
from glm_pd_common.errors import ConfigError, ProtocolError
from glm_pd_common.layout.fingerprint import Fingerprint, PeerShape
from glm_pd_common.layout.pages import INT64_MAX

PROTOCOL_VERSION = 8  # every message, kv_transfer_params and SGLang backend frame carries it; see the history

HEARTBEAT_S = 5.0  # an idle decode lane says it is alive at least this often (a wire contract, as the messages)
RENEWALS_PER_LEASE = 6  # as vLLM's NIXL heartbeats: five renewals in a row may be lost before a lease runs out


def renew_interval(lease_s: float) -> float:
    """How often decode renews the lease of a request still waiting for blocks (``lease_s`` is prefill's)."""
    if not lease_s > 0:
        raise ConfigError(f"lease_s must be positive, got {lease_s!r}")
    return lease_s / RENEWALS_PER_LEASE


MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # a 1M-token page list is ~100 KB; anything near this is hostile
# Every consumer holds page ids as int64: a larger or negative one is refused where it enters.
PageId = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Digest = Annotated[int, msgspec.Meta(ge=0)]  # 64-bit (``layout.digest_words``): msgpack caps it at 2**64 - 1
# Text a peer sends is bounded by its type, so no remote string is held, logged or echoed past these lengths.
MAX_ID_CHARS = 512  # request, lease, transfer, engine and agent ids (vLLM's params already cap ids at 256)
MAX_REASON_CHARS = 2048
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=64)]  # region kinds, memory kinds, transport names
MAX_RENEW_IDS = 4096  # request ids in one renewal; decode splits a longer list over several messages
# Why a load failed, as decode reports it; prefill's ``failed`` names one too (the ones it can know).
FailureCode = Literal[
    "lease_expired", "transport", "digest", "refused_peer", "invalid_params", "timeout", "aborted", "internal"
]
FAILURE_CODES: tuple[str, ...] = get_args(FailureCode)


class _Base(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True):
    v: int


class RegionSummary(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Name
    layer_id: int
    is_mtp: bool
    base_addr: int
    num_pages: int
    page_bytes: int
    page_stride: int
    mem_kind: Name = "DRAM"
    device_id: int = 0


class StagingSummary(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rank's registered staging buffer: pairs of ``slot_bytes`` slots (``transport.staging``)."""

    base_addr: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
    size_bytes: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
    slot_bytes: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
    mem_kind: Name = "DRAM"
    device_id: int = 0


class Hello(_Base, tag="hello", frozen=True):
    engine_id: Id
    fingerprint: Fingerprint
    shape: PeerShape
    regions: list[RegionSummary]
    transport: Name
    agent_name: Id
    agent_metadata: bytes
    proof: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # decode's (see the version history); prefill: empty
    staging: StagingSummary | None = None


class Query(_Base, tag="query", frozen=True):
    """Ask a peer for its hello without becoming its peer (no transport metadata is loaded)."""

    engine_id: Id


class TransferRequest(_Base, tag="transfer", frozen=True):
    """Decode's ask: move these tokens; ``dst_pages`` are decode's suffix pages, ``src_pages`` prefill's."""

    request_id: Id
    num_tokens: int
    prefix_tokens: int
    src_pages: list[PageId]
    dst_pages: list[PageId]
    verify: bool = False
    slot_bytes: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] = 0  # staged: the plan's runs in slots this big


class Claimed(_Base, tag="claimed", frozen=True):
    """Prefill holds the pages until decode's done (or its timeout): decode may read. A claim that asked to verify
    gets prefill's digests after this (``source_digests``), computed while decode reads."""

    request_id: Id


class SourceDigests(_Base, tag="source_digests", frozen=True):
    """Prefill's per-region digests of the bytes a claim reads (its source pages), in the plan's region order."""

    request_id: Id
    digests: list[Digest]


class Released(_Base, tag="released", frozen=True):
    """Prefill's answer to decode's done: the pages were still held when the read finished."""

    request_id: Id


class Done(_Base, tag="done", frozen=True):
    """Decode's read finished: may prefill confirm the pages were held until now (``Released``)?"""

    request_id: Id


class Failed(_Base, tag="failed", frozen=True):
    """A refusal; ``code`` is what kind (``lease_expired``: prefill holds no live lease for the request)."""

    request_id: Id
    reason: Reason
    code: FailureCode = "internal"


class Abort(_Base, tag="abort", frozen=True):
    request_id: Id
    reason: Reason


class Heartbeat(_Base, tag="heartbeat", frozen=True):
    """Decode is alive (sent on an idle connection); prefill forgets a peer silent for too long."""

    engine_id: Id
    seq: int


class Renew(_Base, tag="renew", frozen=True):
    """Decode still waits for blocks for these requests: hold their unclaimed pages another lease from now.
    Unanswered; an id prefill holds no live unclaimed lease for is ignored (an expired lease stays expired)."""

    request_ids: Annotated[list[Id], msgspec.Meta(max_length=MAX_RENEW_IDS)]


class Subscribe(_Base, tag="subscribe", frozen=True):
    """Decode holds blocks for a streamed transfer: send its ``progress`` as prefill computes it."""

    request_id: Id  # the transfer id the router gave both legs
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]  # decode's prompt length; prefill's must match


class Progress(_Base, tag="progress", frozen=True):
    """Prefill has written the first ``ready_tokens`` tokens of a streamed transfer. ``pages`` are prefill's page
    table entries from index ``first_page`` on (what this subscriber has not been sent yet). ``lease_id`` is
    set once the request finished: its pages are leased under that id, and ``pages`` is the whole table."""

    request_id: Id
    num_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # prefill's prompt length, 0 if not known yet
    ready_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
    first_page: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
    pages: list[PageId]
    lease_id: Id = ""


class Gather(_Base, tag="gather", frozen=True):
    """Decode, staged: gather slot ``slot`` of the claimed plan, or of the open stream read of transfer
    ``request_id`` (decode is done reading slot ``slot - 2``)."""

    request_id: Id
    slot: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]


class StreamRead(_Base, tag="stream_read", frozen=True):
    """A subscriber, staged: cut tokens ``[prefix_tokens, num_tokens)`` of streamed transfer ``request_id`` into
    slots of ``slot_bytes`` (then ``gather`` each). The pages are the claim's rule over the pages announced so far:
    ``src_pages`` prefill's, ``dst_pages`` decode's."""

    request_id: Id  # the transfer id
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
    prefix_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
    src_pages: list[PageId]
    dst_pages: list[PageId]
    slot_bytes: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]


class ReadDone(_Base, tag="read_done", frozen=True):
    """A subscriber read every slot of its staged streamed read (or gave it up): its slot pair may go back."""

    request_id: Id  # the transfer id


class Gathered(_Base, tag="gathered", frozen=True):
    """Prefill: slot ``slot`` is in its staging buffer at ``offset``, complete."""

    request_id: Id
    slot: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]


class DigestQuery(_Base, tag="digest_query", frozen=True):
    request_id: Id
    region_indices: list[int]


class PageDigests(_Base, tag="page_digests", frozen=True):
    request_id: Id
    pages: dict[int, list[Digest]]  # region index -> one digest per destination page


Message = Union[
    Hello,
    Query,
    TransferRequest,
    Claimed,
    SourceDigests,
    Released,
    Done,
    Failed,
    Abort,
    Heartbeat,
    Renew,
    Subscribe,
    Progress,
    Gather,
    Gathered,
    StreamRead,
    ReadDone,
    DigestQuery,
    PageDigests,
]


class _Header(msgspec.Struct):
    type: Name
    v: int


_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Decode and validate one message; refuse oversized, unknown-version or malformed input."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the cap of {MAX_MESSAGE_BYTES}")
    header = decode_as(data, _Header, "message (no valid header: type, v)")
    if header.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"message {header.type!r} has protocol version {header.v}; this peer speaks {PROTOCOL_VERSION}"
        )
    return decode_as(data, Message, f"{header.type!r} message")  # type: ignore[arg-type]


def clip(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` cut to ``limit`` characters (marked), for what the wire carries and what logs show."""
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} chars)"

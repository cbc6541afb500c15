"""The backend's zmq messages between SGLang ranks (msgspec msgpack behind a tag frame).

Decode -> prefill: a registration (once per prefill rank: glm-pd's hello plus SGLang's endpoint and
metadata buffers) and a room message per request. Prefill -> decode: a refusal at registration, digests
before Success when verification is on; the terminal status uses SGLang's own tagged status frame. A staged
push (``staged``) adds: prefill asks for a pair of decode's staging slots, decode lends one (or none), prefill
says where each slot it wrote must land, and decode says when the slot is free again.
Every payload is size-capped, its protocol version checked from a minimal header (the same version as
the core protocol's), and then decoded whole before anything acts on it.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec

from glm_pd_common.decoding import decode_as
from glm_pd_common.errors import ProtocolError
from glm_pd_common.handoff.wire.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from glm_pd_common.layout.pages import INT64_MAX

Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # addresses, lengths, offsets, slots: held as int64

TAG_REGISTER = b"GLMPD_REGISTER"
TAG_ROOM = b"GLMPD_ROOM"
TAG_REFUSED = b"GLMPD_REFUSED"
TAG_DIGESTS = b"GLMPD_DIGESTS"
TAG_STATUS = b"GLMPD_STATUS"
TAG_SLOT_ASK = b"GLMPD_SLOT_ASK"
TAG_SLOT_LENT = b"GLMPD_SLOT_LENT"
TAG_SLOT_LANDED = b"GLMPD_SLOT_LANDED"
TAG_SLOT_FREE = b"GLMPD_SLOT_FREE"


class AuxBuffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    ptr: int
    data_len: int
    item_len: int


class _Versioned(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every payload says which protocol version wrote it (keyword-only, so it follows the positional fields)."""

    v: int = PROTOCOL_VERSION


class _Header(msgspec.Struct):
    v: int


class Registration(_Versioned, frozen=True):
    hello: bytes  # glm_pd_common.handoff.wire.protocol.Hello, encoded: fingerprint, shape, regions, transport metadata
    decode_ip: str
    decode_port: int
    engine_rank: int
    aux: list[AuxBuffer]


class Room(_Versioned, frozen=True):
    room: int
    agent_name: str
    decode_ip: str
    decode_port: int
    dst_pages: list[int]  # decode's suffix pages (main KV)
    dst_state_pages: list[int] | None  # decode's suffix pages of the DSA state (the indexer)
    aux_index: int | None
    decode_prefix_len: int
    required_dst_info_num: int
    is_dummy: bool


class Refused(_Versioned, frozen=True):
    prefill_rank: int
    reason: str


class Digests(_Versioned, frozen=True):
    room: int
    regions: list[str]
    digests: list[int]

    def __post_init__(self) -> None:
        # verify_room pairs them with zip(strict=True): a mismatch there would raise in decode's poll loop
        if len(self.regions) != len(self.digests):
            raise ValueError(f"{len(self.regions)} region names but {len(self.digests)} digests")


class SlotAsk(_Versioned, frozen=True):
    """Prefill rank ``prefill_rank`` will push room ``room`` staged: lend it a pair of slots (answer at the
    address given)."""

    room: int
    prefill_rank: int
    prefill_ip: str
    prefill_port: int


class SlotLent(_Versioned, frozen=True):
    """Decode's answer: its slots ``offsets`` (two, in its staging buffer) of ``slot_bytes``, or none (push
    directly)."""

    room: int
    agent_name: str  # the decode rank's agent: a room may push to several
    offsets: list[Count]
    slot_bytes: Count


class SlotLanded(_Versioned, frozen=True):
    """Slot ``slot`` (in the lent pair's ``slot % 2``) holds these runs' bytes, in order: scatter them there
    (``last``: the push's final slot, after which its pair is free)."""

    room: int
    prefill_rank: int
    slot: Count
    last: bool
    addrs: list[Count]
    lengths: list[Count]


class SlotFree(_Versioned, frozen=True):
    """Decode scattered slot ``slot`` (or refused it: ``error``): prefill may write that slot again."""

    room: int
    agent_name: str
    slot: Count
    error: str = ""


T = TypeVar("T", bound=_Versioned)


def frames(tag: bytes, message: _Versioned) -> list[bytes]:
    return [tag, msgspec.msgpack.encode(message)]


def parse(msg: list[bytes], kind: type[T]) -> T:
    """Decode the payload frame of a tagged message; refuse a wrong frame count, oversize, another protocol
    version or a bad shape."""
    tag = msg[0][:32] if msg else b""
    if len(msg) != 2:
        raise ProtocolError(f"{tag!r} message has {len(msg)} frames, expected 2")
    if len(msg[1]) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{tag!r} message of {len(msg[1])} bytes exceeds the cap of {MAX_MESSAGE_BYTES}")
    version = decode_as(msg[1], _Header, f"{tag!r} message (no protocol version)").v
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{tag!r} message has protocol version {version}; this peer speaks {PROTOCOL_VERSION}")
    return decode_as(msg[1], kind, f"{tag!r} message")

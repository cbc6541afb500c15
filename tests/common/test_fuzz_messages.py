"""Hostile and malformed wire messages: every decoder of peer data refuses them with glm-pd's own errors.

A peer (or anyone who can reach the side channel) controls every byte of a message. Each property here
says: the input is either turned into a well-typed value, or refused with a GlmPdError subclass whose
message names what was wrong. Any other exception (TypeError, KeyError, OverflowError, ...) escapes
the services' error handling, leaves the request hanging and is a bug. The same for page ids, plans and
digests: test_fuzz_pages.py; for handshakes: test_fuzz_hello.py.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from glm_pd_common.errors import ProtocolError
from glm_pd_common.handoff.wire import protocol as proto
from glm_pd_common.handoff.wire.handshake import make_hello
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelServer, SideChannelTimeout
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.hostmem import HostCaches
from tests.support.hostile import (
    BY_TAG,
    FUZZ,
    UINT64_MAX,
    decode_or_refuse,
    hostile,
    ints,
    message_dicts,
    typed,
    wire_accepts,
)


def samples(spec: CacheSpec) -> list[proto.Message]:
    """One valid message of every type (the Hello a real one, with real regions)."""
    caches = HostCaches(spec, page_tokens=64, num_pages=4)
    v = PROTOCOL_VERSION
    return [
        make_hello("p0", spec, PeerShape(64, 2, 1), caches.regions, "nixl", "agent-p0", b"\x00meta"),
        proto.Hello(
            **{
                **msgspec.structs.asdict(
                    make_hello("p0", spec, PeerShape(64, 1, 0), caches.regions, "nixl", "agent-p0", b""),
                ),
                "staging": proto.StagingSummary(4096, 1 << 20, 1 << 18, "VRAM", 1),
            }
        ),
        proto.Query(v=v, engine_id="doctor"),
        proto.TransferRequest(
            v=v, request_id="r", num_tokens=130, prefix_tokens=64, src_pages=[1, 2], dst_pages=[3, 0]
        ),
        proto.TransferRequest(
            v=v, request_id="r", num_tokens=130, prefix_tokens=0, src_pages=[1], dst_pages=[3], slot_bytes=1 << 20
        ),
        proto.Gather(v=v, request_id="r", slot=3),
        proto.Gathered(v=v, request_id="r", slot=3, offset=1 << 21),
        proto.StreamRead(
            v=v, request_id="t", num_tokens=128, prefix_tokens=64, src_pages=[5], dst_pages=[2], slot_bytes=1 << 16
        ),
        proto.ReadDone(v=v, request_id="t"),
        proto.Claimed(v=v, request_id="r"),
        proto.SourceDigests(v=v, request_id="r", digests=[1, UINT64_MAX]),
        proto.Released(v=v, request_id="r"),
        proto.Done(v=v, request_id="r"),
        proto.Failed(v=v, request_id="r", reason="x", code="lease_expired"),
        proto.Abort(v=v, request_id="r", reason="y"),
        proto.Renew(v=v, request_ids=["r", "s"]),
        proto.Heartbeat(v=v, engine_id="e", seq=3),
        proto.Subscribe(v=v, request_id="t", num_tokens=130),
        proto.Progress(v=v, request_id="t", num_tokens=130, ready_tokens=64, first_page=1, pages=[7], lease_id="t#0"),
        proto.DigestQuery(v=v, request_id="r", region_indices=[0, 9]),
        proto.PageDigests(v=v, request_id="r", pages={0: [1, 2]}),
    ]


def test_every_message_type_is_fuzzed(small_spec) -> None:
    """Every message class the protocol module defines is in the decoded union (so in BY_TAG, which the
    strategies draw from) and has a valid sample: a new message type cannot slip in unfuzzed."""
    defined = {
        c.__struct_config__.tag
        for c in vars(proto).values()
        if isinstance(c, type) and issubclass(c, proto._Base) and c is not proto._Base
    }
    assert set(BY_TAG) == defined
    assert {type(m).__struct_config__.tag for m in samples(small_spec)} == defined


# -- protocol.decode --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(d=message_dicts())
def test_decode_is_well_typed_or_refused(d) -> None:
    """Message-shaped maps of any content: a message exactly of the declared types, or ProtocolError."""
    msg = decode_or_refuse(msgspec.msgpack.encode(d))
    if msg is not None:  # accepted: it was exactly a message of its tag, no unknown field, right version
        assert type(msg).__struct_config__.tag == d["type"]
        assert set(d) - {"type"} <= {f.encode_name for f in BY_TAG[d["type"]].fields}


@settings(max_examples=200, deadline=None)
@given(tag=st.sampled_from(sorted(BY_TAG)), v=st.one_of(ints, hostile))
def test_any_other_version_is_refused_before_the_shape(tag, v) -> None:
    """An unknown version is refused by its number even when the rest is garbage (it may be a newer schema)."""
    assume(not (type(v) is int and v == PROTOCOL_VERSION))
    raw = msgspec.msgpack.encode({"type": tag, "v": v, "whatever": [1, "x"]})
    with pytest.raises(ProtocolError, match=rf"protocol version {v}\b" if type(v) is int else r"header.*\$\.v"):
        proto.decode(raw)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), tag=st.sampled_from(sorted(BY_TAG)))
def test_decode_refuses_wrong_types_naming_the_field(data, tag) -> None:
    """A field of the wrong type is refused, and the error points at that field."""
    info = BY_TAG[tag]
    fields = [f for f in info.fields if f.name != "v"]
    f = data.draw(st.sampled_from(fields))
    good = dict(data.draw(st.fixed_dictionaries({g.encode_name: typed(g.type) for g in fields})))
    kind = {g.name: g.type for g in msgspec.structs.fields(info.cls)}[f.name]
    bad = data.draw(hostile.filter(lambda x: not wire_accepts(x, kind)))
    good[f.encode_name] = bad
    with pytest.raises(ProtocolError, match=rf"malformed '{tag}' message: .*\$\.{f.encode_name}"):
        proto.decode(msgspec.msgpack.encode({"type": tag, "v": PROTOCOL_VERSION, **good}))


def test_every_strict_prefix_of_every_message_is_refused(small_spec) -> None:
    """A truncated message (a dropped frame tail, a short read) never decodes into a shorter valid one."""
    for msg in samples(small_spec):
        raw = proto.encode(msg)
        assert proto.decode(raw) == msg
        for cut in range(len(raw)):
            with pytest.raises(ProtocolError):
                proto.decode(raw[:cut])


@FUZZ
@given(data=st.data())
def test_corrupted_encodings_are_well_typed_or_refused(small_spec, data) -> None:
    """Flipped, inserted and deleted bytes in real messages (a Hello included)."""
    raw = bytearray(proto.encode(data.draw(st.sampled_from(samples(small_spec)))))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "append"]))
        if op == "flip" and at < len(raw):
            raw[at] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=9))
        elif op == "delete":
            del raw[at : at + data.draw(st.integers(1, 9))]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=9))
    decode_or_refuse(bytes(raw))


def test_size_cap_is_exact_and_checked_before_parsing(small_spec) -> None:
    """MAX_MESSAGE_BYTES is a hard edge: a valid message one byte over it is refused, one at it decodes."""
    hello = samples(small_spec)[0]

    def padded(n: int) -> bytes:  # the transport metadata is the one field without a length of its own
        return proto.encode(msgspec.structs.replace(hello, agent_metadata=b"y" * n))

    overhead = len(padded(1 << 16)) - (1 << 16)  # past 64 KiB a bin header has a fixed size
    at_cap, over = padded(proto.MAX_MESSAGE_BYTES - overhead), padded(proto.MAX_MESSAGE_BYTES - overhead + 1)
    assert (len(at_cap), len(over)) == (proto.MAX_MESSAGE_BYTES, proto.MAX_MESSAGE_BYTES + 1)
    assert isinstance(proto.decode(at_cap), proto.Hello)
    with pytest.raises(ProtocolError, match=f"{len(over)} bytes exceeds the cap of {proto.MAX_MESSAGE_BYTES}"):
        proto.decode(over)


@settings(max_examples=200, deadline=None)
@given(d=st.sampled_from(sorted(BY_TAG)).flatmap(lambda tag: typed(BY_TAG[tag]).map(lambda d: {**d, "type": tag})))
def test_well_typed_messages_with_hostile_numbers_are_accepted(d) -> None:
    """The converse: the shape check refuses no well-typed message; numbers are the next layer's to judge."""
    d["v"] = PROTOCOL_VERSION
    msg = decode_or_refuse(msgspec.msgpack.encode(d))
    assert msg is not None and proto.encode(msg) == proto.encode(msgspec.convert(d, type(msg)))


# -- remote page ids into the plan ------------------------------------------------------------------


def test_side_channel_binds_only_the_configured_address() -> None:
    """Bound to 127.0.0.1, not to every interface: LAST_ENDPOINT is what zmq actually bound."""
    server = SideChannelServer("127.0.0.1")
    try:
        endpoint = server._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert endpoint == f"tcp://127.0.0.1:{server.port}"
    finally:
        server.close()
    fixed = SideChannelServer("127.0.0.1", server.port)  # the configured-port path (vLLM: base + rank)
    try:
        assert fixed._sock.getsockopt(zmq.LAST_ENDPOINT).decode() == f"tcp://127.0.0.1:{server.port}"
    finally:
        fixed.close()


def test_side_channel_drops_oversized_and_refuses_malformed_frames_then_keeps_serving() -> None:
    """A frame past MAX_MESSAGE_BYTES never reaches the decoder (zmq MAXMSGSIZE drops the peer); bad frames
    are ProtocolErrors; a well-formed message afterwards is still served."""
    server = SideChannelServer("127.0.0.1")
    ctx = zmq.Context()
    try:

        def peer() -> zmq.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{server.port}")
            return sock

        big = peer()
        big.send(b"\x00" * (proto.MAX_MESSAGE_BYTES + 1))
        with pytest.raises(SideChannelTimeout):
            server.recv(timeout_s=1.0)
        bad = peer()
        bad.send_multipart([b"a", b"b"])  # the ROUTER adds the identity: three frames
        with pytest.raises(ProtocolError, match="frame count 3"):
            server.recv(timeout_s=5.0)
        bad.send(b"\xc1garbage")
        with pytest.raises(ProtocolError, match="no valid header"):
            server.recv(timeout_s=5.0)
        good = peer()
        good.send(proto.encode(proto.Query(v=PROTOCOL_VERSION, engine_id="doctor")))
        start = time.monotonic()
        _, msg = server.recv(timeout_s=5.0)
        assert msg == proto.Query(v=PROTOCOL_VERSION, engine_id="doctor") and time.monotonic() - start < 5
        for sock in (big, bad, good):
            sock.close(0)
    finally:
        ctx.destroy(linger=0)  # closes the peers a failed check left open (term would wait for them forever)
        server.close()

"""Hostile and malformed remote input: every decoder of peer data refuses it with glm-pd's own errors.

A peer (or anyone who can reach the side channel) controls every byte of a message. Each property here
says: the input is either turned into a well-typed value, or refused with a GlmPdError subclass whose
message names what was wrong. Any other exception (TypeError, KeyError, OverflowError, ...) escapes
the services' error handling, leaves the request hanging and is a bug.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from glm_pd_common import protocol as proto
from glm_pd_common.errors import ConfigError, GlmPdError, LayoutMismatch, PageOutOfRange, PlanError, ProtocolError
from glm_pd_common.fingerprint import PROTOCOL_VERSION, Fingerprint, PeerShape
from glm_pd_common.hostmem import HostCaches
from glm_pd_common.layout import SUPPORTED_PAGE_TOKENS
from glm_pd_common.pages import num_pages_for
from glm_pd_common.peer import accept_hello, make_hello
from glm_pd_common.plan import build_plan
from glm_pd_common.sidechannel import SideChannelServer, SideChannelTimeout
from glm_pd_common.spec import CacheSpec
from glm_pd_common.tp import SUPPORTED_TP

INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MESSAGE_INFO: mi.UnionType = mi.type_info(proto.Message)  # type: ignore[assignment]
BY_TAG: dict[str, mi.StructType] = {t.tag: t for t in MESSAGE_INFO.types}  # type: ignore[union-attr]

# Integers msgpack can carry, biased to the edges where int64 conversions and bounds checks break.
ints = st.one_of(
    st.integers(-3, 70),
    st.integers(INT64_MIN, UINT64_MAX),
    st.sampled_from([INT64_MIN, -1, 0, 1, 7, 8, 1 << 31, 1 << 32, INT64_MAX, INT64_MAX + 1, UINT64_MAX]),
)
scalars = st.one_of(
    st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8)
)
hostile = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=4), ints), inner, max_size=3)
    ),
    max_leaves=10,
)


def mostly(usual: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], odds: int = 5) -> st.SearchStrategy[Any]:
    """``usual`` ``odds`` times in ``odds + 1`` (one_of's branch choice is not uniform enough to rely on)."""
    return st.integers(0, odds).flatmap(lambda k: usual if k else rare)


def typed(t: mi.Type, name: str = "", *, mixed: bool = False) -> st.SearchStrategy[Any]:
    """Values of the declared type (with hostile numbers): what gets past the shape check to the next layer.
    ``mixed``: fields of nested structs are sometimes of any type too."""
    if name == "v":
        return mostly(st.just(PROTOCOL_VERSION), ints)
    if isinstance(t, mi.IntType):
        return ints
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=True)
    if isinstance(t, mi.StrType):
        return st.text(max_size=12)
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=16)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return st.lists(typed(t.item_type), max_size=6)
    if isinstance(t, mi.DictType):
        return st.dictionaries(typed(t.key_type), typed(t.value_type), max_size=3)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(typed(u) for u in t.types))
    if isinstance(t, mi.StructType):
        return st.fixed_dictionaries(
            {f.encode_name: field_value(f) if mixed else typed(f.type, f.name) for f in t.fields}
        )
    raise AssertionError(f"no strategy for {t}")


def field_value(f: mi.Field) -> st.SearchStrategy[Any]:
    """Mostly the declared type, sometimes anything at all (wrong types, nesting, None)."""
    return mostly(typed(f.type, f.name, mixed=True), hostile, odds=7)


@st.composite
def message_dicts(draw: st.DrawFn, tag: str | None = None) -> dict[str, Any]:
    """A message-shaped map: a known (or unknown) tag, typed or hostile fields, some missing, some extra."""
    tag = tag or draw(st.one_of(st.sampled_from(sorted(BY_TAG)), st.sampled_from(sorted(BY_TAG)), st.text(max_size=6)))
    info = BY_TAG.get(tag)
    out: dict[str, Any] = {"type": tag}
    for f in info.fields if info else ():
        if draw(st.integers(0, 15)):  # a field is dropped one time in 16
            out[f.encode_name] = draw(field_value(f))
    if info is None:
        out["v"] = draw(typed(mi.IntType(), "v"))
    if not draw(st.integers(0, 7)):
        out[draw(st.text(max_size=6))] = draw(hostile)
    return out


def conforms(value: Any, t: mi.Type) -> bool:
    """Does a decoded value have exactly its declared type (a bool is not an int; ints fit in msgpack's range)?"""
    if isinstance(t, mi.IntType):
        return type(value) is int and INT64_MIN <= value <= UINT64_MAX
    simple = {mi.BoolType: bool, mi.FloatType: float, mi.StrType: str, mi.BytesType: bytes, mi.NoneType: type(None)}
    if type(t) in simple:
        return type(value) is simple[type(t)]
    if isinstance(t, mi.ListType):
        return type(value) is list and all(conforms(v, t.item_type) for v in value)
    if isinstance(t, mi.VarTupleType):
        return type(value) is tuple and all(conforms(v, t.item_type) for v in value)
    if isinstance(t, mi.DictType):
        return type(value) is dict and all(conforms(k, t.key_type) and conforms(v, t.value_type) for k, v in value.items())
    if isinstance(t, mi.UnionType):
        return any(conforms(value, u) for u in t.types)
    if isinstance(t, mi.StructType):
        return type(value) is t.cls and all(conforms(getattr(value, f.name), f.type) for f in t.fields)
    raise AssertionError(f"no rule for {t}")


def decode_or_refuse(raw: bytes) -> proto.Message | None:
    """The property every decoder of remote bytes must have: a well-typed message, or ProtocolError."""
    try:
        msg = proto.decode(raw)
    except ProtocolError as exc:
        assert str(exc), "a refusal must say why"
        return None
    info = BY_TAG[type(msg).__struct_config__.tag]  # type: ignore[index]
    assert conforms(msg, info), f"decode returned an ill-typed {msg!r}"
    assert msg.v == PROTOCOL_VERSION
    assert proto.decode(proto.encode(msg)) == msg
    return msg


def samples(spec: CacheSpec) -> list[proto.Message]:
    """One valid message of every type (the Hello a real one, with real regions)."""
    caches = HostCaches(spec, page_tokens=64, num_pages=4)
    v = PROTOCOL_VERSION
    return [
        make_hello("p0", spec, PeerShape(64, 2, 1), caches.regions, "nixl", "agent-p0", b"\x00meta"),
        proto.Query(v=v, engine_id="doctor"),
        proto.TransferRequest(
            v=v, request_id="r", num_tokens=130, prefix_tokens=64, src_pages=[1, 2], dst_pages=[3, 0], dst_engine_id="d"
        ),
        proto.Claimed(v=v, request_id="r", lease_s=30.0, num_bytes=5, digests=[1, UINT64_MAX]),
        proto.Released(v=v, request_id="r"),
        proto.Done(v=v, request_id="r", num_bytes=5, digests=None),
        proto.Failed(v=v, request_id="r", reason="x"),
        proto.Abort(v=v, request_id="r", reason="y"),
        proto.Heartbeat(v=v, engine_id="e", seq=3),
        proto.DigestQuery(v=v, request_id="r", region_indices=[0, 9]),
        proto.PageDigests(v=v, request_id="r", pages={0: [1, 2]}),
    ]


def test_every_message_type_is_fuzzed():
    """The strategies cover the whole union: a new message type cannot slip in unfuzzed."""
    assert set(BY_TAG) == {t.__struct_config__.tag for t in proto.Message.__args__}  # type: ignore[attr-defined]


# -- protocol.decode --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(d=message_dicts())
def test_decode_is_well_typed_or_refused(d):
    msg = decode_or_refuse(msgspec.msgpack.encode(d))
    if msg is not None:  # accepted: it was exactly a message of its tag, no unknown field, right version
        assert type(msg).__struct_config__.tag == d["type"]
        assert set(d) - {"type"} <= {f.encode_name for f in BY_TAG[d["type"]].fields}


@settings(max_examples=200, deadline=None)
@given(tag=st.sampled_from(sorted(BY_TAG)), v=st.one_of(ints, hostile))
def test_any_other_version_is_refused_before_the_shape(tag, v):
    """An unknown version is refused by its number even when the rest is garbage (it may be a newer schema)."""
    assume(not (type(v) is int and v == PROTOCOL_VERSION))
    raw = msgspec.msgpack.encode({"type": tag, "v": v, "whatever": [1, "x"]})
    with pytest.raises(ProtocolError, match=rf"protocol version {v}\b" if type(v) is int else r"header.*\$\.v"):
        proto.decode(raw)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), tag=st.sampled_from(sorted(BY_TAG)))
def test_decode_refuses_wrong_types_naming_the_field(data, tag):
    """A required field of the wrong type is refused, and the error points at that field."""
    info = BY_TAG[tag]
    fields = [f for f in info.fields if f.name != "v"]
    f = data.draw(st.sampled_from(fields))
    good = dict(data.draw(st.fixed_dictionaries({g.encode_name: typed(g.type) for g in fields})))
    bad = data.draw(hostile.filter(lambda x: not conforms(x, f.type)))
    good[f.encode_name] = bad
    with pytest.raises(ProtocolError, match=rf"malformed '{tag}' message: .*\$\.{f.encode_name}"):
        proto.decode(msgspec.msgpack.encode({"type": tag, "v": PROTOCOL_VERSION, **good}))


def test_every_strict_prefix_of_every_message_is_refused(small_spec):
    """A truncated message (a dropped frame tail, a short read) never decodes into a shorter valid one."""
    for msg in samples(small_spec):
        raw = proto.encode(msg)
        assert proto.decode(raw) == msg
        for cut in range(len(raw)):
            with pytest.raises(ProtocolError):
                proto.decode(raw[:cut])


@FUZZ
@given(data=st.data())
def test_corrupted_encodings_are_well_typed_or_refused(small_spec, data):
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


def test_size_cap_is_exact_and_checked_before_parsing():
    """MAX_MESSAGE_BYTES is a hard edge: a valid message one byte over it is refused, one at it decodes."""

    def failed(n: int) -> bytes:
        return proto.encode(proto.Failed(v=PROTOCOL_VERSION, request_id="y" * n, reason=""))

    overhead = len(failed(1 << 16)) - (1 << 16)  # past 64 KiB a str header has a fixed size
    at_cap, over = failed(proto.MAX_MESSAGE_BYTES - overhead), failed(proto.MAX_MESSAGE_BYTES - overhead + 1)
    assert (len(at_cap), len(over)) == (proto.MAX_MESSAGE_BYTES, proto.MAX_MESSAGE_BYTES + 1)
    assert isinstance(proto.decode(at_cap), proto.Failed)
    with pytest.raises(ProtocolError, match=f"{len(over)} bytes exceeds the cap of {proto.MAX_MESSAGE_BYTES}"):
        proto.decode(over)

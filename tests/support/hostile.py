"""Hypothesis strategies and checks for hostile remote input: what a peer (or anyone reaching a side channel)
may send, drawn from the wire types themselves, and how a decoder's answer is judged."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from glm_pd_common.errors import ProtocolError
from glm_pd_common.handoff.wire import protocol as proto
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION

INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
MESSAGE_INFO: mi.UnionType = mi.type_info(proto.Message)  # type: ignore[assignment]
BY_TAG: dict[str, mi.StructType] = {t.tag: t for t in MESSAGE_INFO.types}  # type: ignore[union-attr]
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

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
        if t.ge is None and t.le is None:
            return ints
        lo, hi = t.ge, t.le
        in_range = ints.filter(lambda x: (lo is None or x >= lo) and (hi is None or x <= hi))
        # msgpack carries nothing past int64 below or uint64 above
        return st.one_of(st.integers(INT64_MIN if lo is None else lo, UINT64_MAX if hi is None else hi), in_range)
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
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
    if isinstance(t, mi.LiteralType):
        return value in t.values and type(value) is type(t.values[0])
    simple = {mi.BoolType: bool, mi.FloatType: float, mi.StrType: str, mi.BytesType: bytes, mi.NoneType: type(None)}
    if type(t) in simple:
        return type(value) is simple[type(t)]
    if isinstance(t, mi.ListType):
        return type(value) is list and all(conforms(v, t.item_type) for v in value)
    if isinstance(t, mi.VarTupleType):
        return type(value) is tuple and all(conforms(v, t.item_type) for v in value)
    if isinstance(t, mi.DictType):
        return type(value) is dict and all(
            conforms(k, t.key_type) and conforms(v, t.value_type) for k, v in value.items()
        )
    if isinstance(t, mi.UnionType):
        return any(conforms(value, u) for u in t.types)
    if isinstance(t, mi.StructType):
        return type(value) is t.cls and all(conforms(getattr(value, f.name), f.type) for f in t.fields)
    raise AssertionError(f"no rule for {t}")


def wire_accepts(value: Any, kind: Any) -> bool:
    """Would msgpack decoding accept ``value`` for a field of type ``kind`` (ints are valid floats, lists tuples)?"""
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=kind)
    except msgspec.ValidationError:
        return False
    return True


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
    assert proto.encode(proto.decode(proto.encode(msg))) == proto.encode(msg)  # bytes: NaN != NaN
    return msg

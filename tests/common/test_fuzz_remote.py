"""Hostile and malformed remote input: every decoder of peer data refuses it with glm-pd's own errors.

A peer (or anyone who can reach the side channel) controls every byte of a message. Each property here
says: the input is either turned into a well-typed value, or refused with a GlmPdError subclass whose
message names what was wrong. Any other exception (TypeError, KeyError, OverflowError, ...) escapes
the services' error handling, leaves the request hanging and is a bug.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from glm_pd_common.errors import ConfigError, GlmPdError, LayoutMismatch, PageOutOfRange, PlanError, ProtocolError
from glm_pd_common.handoff import protocol as proto
from glm_pd_common.handoff.peer import accept_hello, make_hello
from glm_pd_common.handoff.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.sidechannel import SideChannelServer, SideChannelTimeout
from glm_pd_common.layout.checksum import check_landed, flip_byte, moved_byte, page_digests, plan_digests
from glm_pd_common.layout.fingerprint import Fingerprint, PeerShape
from glm_pd_common.layout.formats import SUPPORTED_PAGE_TOKENS
from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.layout.tp import SUPPORTED_TP
from glm_pd_common.tools.hostmem import HostCaches

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


def samples(spec: CacheSpec) -> list[proto.Message]:
    """One valid message of every type (the Hello a real one, with real regions)."""
    caches = HostCaches(spec, page_tokens=64, num_pages=4)
    v = PROTOCOL_VERSION
    return [
        make_hello("p0", spec, PeerShape(64, 2, 1), caches.regions, "nixl", "agent-p0", b"\x00meta"),
        proto.Query(v=v, engine_id="doctor"),
        proto.TransferRequest(
            v=v, request_id="r", num_tokens=130, prefix_tokens=64, src_pages=[1, 2], dst_pages=[3, 0]
        ),
        proto.Claimed(v=v, request_id="r", digests=[1, UINT64_MAX]),
        proto.Released(v=v, request_id="r"),
        proto.Done(v=v, request_id="r"),
        proto.Failed(v=v, request_id="r", reason="x", code="lease_expired"),
        proto.Abort(v=v, request_id="r", reason="y"),
        proto.Renew(v=v, request_ids=["r", "s"]),
        proto.Heartbeat(v=v, engine_id="e", seq=3),
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


def test_size_cap_is_exact_and_checked_before_parsing() -> None:
    """MAX_MESSAGE_BYTES is a hard edge: a valid message one byte over it is refused, one at it decodes."""

    def failed(n: int) -> bytes:
        return proto.encode(proto.Failed(v=PROTOCOL_VERSION, request_id="y" * n, reason=""))

    overhead = len(failed(1 << 16)) - (1 << 16)  # past 64 KiB a str header has a fixed size
    at_cap, over = failed(proto.MAX_MESSAGE_BYTES - overhead), failed(proto.MAX_MESSAGE_BYTES - overhead + 1)
    assert (len(at_cap), len(over)) == (proto.MAX_MESSAGE_BYTES, proto.MAX_MESSAGE_BYTES + 1)
    assert isinstance(proto.decode(at_cap), proto.Failed)
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
SRC_PT, SRC_PAGES, DST_PT, DST_PAGES = 64, 8, 32, 16  # unequal page sizes: the conversion path is fuzzed too


@pytest.fixture
def caches(small_spec) -> tuple[HostCaches, HostCaches]:
    """Real regions (real memory) on both sides; the fixture keeps the buffers alive."""
    return (
        HostCaches(small_spec, page_tokens=SRC_PT, num_pages=SRC_PAGES),
        HostCaches(small_spec, page_tokens=DST_PT, num_pages=DST_PAGES),
    )


@st.composite
def request_shape(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """(num_tokens, prefix_tokens, source suffix pages, destination suffix pages) of a request that fits."""
    num_tokens = draw(st.integers(1, DST_PAGES * DST_PT))
    prefix = draw(st.integers(0, num_tokens // DST_PT)) * DST_PT
    need_src = num_pages_for(num_tokens, SRC_PT) - prefix // SRC_PT
    need_dst = num_pages_for(num_tokens, DST_PT) - prefix // DST_PT
    return num_tokens, prefix, need_src, need_dst


DEFECTS = ["none", "negative", "too_big", "duplicate", "count", "float", "bool", "str", "2d"]


@FUZZ
@given(
    shape=request_shape(),
    side=st.sampled_from(["source", "destination"]),
    defect=st.sampled_from(DEFECTS),
    data=st.data(),
)
def test_hostile_page_ids_are_refused_naming_the_defect(caches, shape, side, defect, data) -> None:
    """One defect in one side's pages: refused before any run exists, the error names the side and the defect."""
    num_tokens, prefix, need_src, need_dst = shape
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    pages = {"source": rng.permutation(SRC_PAGES)[:need_src], "destination": rng.permutation(DST_PAGES)[:need_dst]}
    pool = SRC_PAGES if side == "source" else DST_PAGES
    pt = SRC_PT if side == "source" else DST_PT
    ids = pages[side].copy()
    at = data.draw(st.integers(0, max(ids.size - 1, 0)))
    if defect in ("negative", "too_big", "duplicate", "float", "bool", "str", "2d"):
        assume(ids.size >= (2 if defect == "duplicate" else 1))
    if defect == "negative":
        ids[at] = bad = data.draw(st.one_of(st.integers(INT64_MIN, -1), st.just(-1)))
        expect = (PageOutOfRange, rf"^{side} page id {bad} is outside region main\[layer 0\] \(valid 0\.\.{pool - 1}\)")
    elif defect == "too_big":
        ids[at] = bad = data.draw(st.one_of(st.integers(pool, INT64_MAX), st.just(pool)))
        expect = (PageOutOfRange, rf"^{side} page id {bad} is outside region main\[layer 0\] \(valid 0\.\.{pool - 1}\)")
    elif defect == "duplicate":
        other = data.draw(st.integers(0, ids.size - 1).filter(lambda j: j != at))
        ids[other] = ids[at]
        expect = (PlanError, rf"^{side} page ids repeat a page \(1 duplicate\(s\)\)")
    elif defect == "count":
        wrong = data.draw(st.integers(0, ids.size + 3).filter(lambda n: n != ids.size))
        need = ids.size
        ids = rng.integers(0, pool, wrong)
        expect = (
            PlanError,
            rf"^{side} lists {wrong} suffix pages; tokens {prefix}\.\.{num_tokens} in pages of {pt} need {need}$",
        )
    elif defect in ("float", "bool", "str"):
        ids = ids.astype({"float": np.float64, "bool": bool, "str": str}[defect])
        expect = (PageOutOfRange, rf"^{side} page ids for region main\[layer 0\] are not integers")
    elif defect == "2d":
        ids = ids.reshape(1, -1)
        expect = (PlanError, rf"^{side} lists")
    pages[side] = ids
    src, dst = caches
    args = (src.regions, dst.regions, pages["source"], pages["destination"])
    if defect == "none":
        plan = build_plan(*args, num_tokens=num_tokens, prefix_tokens=prefix)
        for entry in plan.entries:
            assert np.all(entry.src_offsets + entry.lengths <= entry.src.size_bytes)
            assert np.all(entry.dst_offsets + entry.lengths <= entry.dst.size_bytes)
        return
    with pytest.raises(expect[0], match=expect[1]):
        build_plan(*args, num_tokens=num_tokens, prefix_tokens=prefix)


def _valid(ids: np.ndarray, need: int, pool: int) -> bool:
    """What build_plan must accept: the right count, every id in range, no repeats."""
    return ids.size == need and bool(np.all((ids >= 0) & (ids < pool))) and np.unique(ids).size == ids.size


def near_valid(draw: st.DrawFn, need: int, pool: int) -> np.ndarray:
    """A valid page list with 0-3 random edits (replace with any int64, duplicate, add, drop)."""
    ids = list(draw(st.permutations(range(pool)))[:need])
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["replace", "duplicate", "add", "drop"]))
        value = draw(st.one_of(st.integers(-2, pool + 1), st.integers(INT64_MIN, INT64_MAX)))
        at = draw(st.integers(0, len(ids)))
        if op == "replace" and at < len(ids):
            ids[at] = value
        elif op == "duplicate" and ids:
            ids.insert(at, ids[at % len(ids)])
        elif op == "add":
            ids.insert(at, value)
        elif op == "drop" and at < len(ids):
            del ids[at]
    return np.asarray(ids, dtype=np.int64)


@FUZZ
@given(shape=request_shape(), data=st.data())
def test_random_page_arrays_plan_iff_valid(caches, shape, data) -> None:
    """Edited page arrays: a plan exactly when both are valid, a GlmPdError otherwise; never a crash."""
    num_tokens, prefix, need_src, need_dst = shape
    s = near_valid(data.draw, need_src, SRC_PAGES)
    d = near_valid(data.draw, need_dst, DST_PAGES)
    ok = _valid(s, need_src, SRC_PAGES) and _valid(d, need_dst, DST_PAGES)
    try:
        build_plan(caches[0].regions, caches[1].regions, s, d, num_tokens=num_tokens, prefix_tokens=prefix)
    except (PlanError, PageOutOfRange) as exc:
        assert not ok, f"valid pages refused: {exc}"
    else:
        assert ok, "invalid pages were planned"


@FUZZ
@given(
    big=st.integers(INT64_MAX + 1, UINT64_MAX),
    other=st.integers(INT64_MIN, UINT64_MAX),
    big_first=st.booleans(),
)
def test_ids_past_int64_as_decoded_from_msgpack_are_refused(caches, big, other, big_first) -> None:
    """msgpack carries uint64: such ids reach the plan as Python ints and must still be refused as page ids."""
    ids = [big, other] if big_first else [other, big]
    with pytest.raises(PageOutOfRange, match=r"^source page id"):
        build_plan(caches[0].regions, caches[1].regions, ids, np.arange(4), num_tokens=128, prefix_tokens=0)


def test_an_id_past_int64_is_named_as_sent(caches) -> None:
    """The refusal should name the id the peer sent, not its int64 wrap-around."""
    with pytest.raises(PageOutOfRange, match=f"page id {INT64_MAX + 1} "):
        build_plan(
            caches[0].regions, caches[1].regions, [0, INT64_MAX + 1], np.arange(4), num_tokens=128, prefix_tokens=0
        )


def test_a_transfer_request_with_ids_past_int64_is_refused_by_decode() -> None:
    """Every consumer converts page ids to int64: ids past it must be refused where they enter."""
    raw = msgspec.msgpack.encode(
        {
            "type": "transfer",
            "v": PROTOCOL_VERSION,
            "request_id": "r",
            "num_tokens": 64,
            "prefix_tokens": 0,
            "src_pages": [0],
            "dst_pages": [UINT64_MAX],
        }
    )
    with pytest.raises(ProtocolError, match=r"malformed 'transfer' message: .*\$\.dst_pages\[0\]"):
        proto.decode(raw)  # else np.asarray(dst_pages, dtype=np.int64) in prefill_service._on_claim overflows


# -- the digest exchange: prefill's Claimed digests and PageDigests reply ------------------------------
@pytest.fixture
def landed(caches) -> TransferPlan:
    """A plan whose bytes were copied faithfully to the destination (what a good transfer leaves)."""
    src, dst = caches
    src.write_tokens(np.arange(SRC_PAGES), 0, SRC_PAGES * SRC_PT, seed=3)
    plan = build_plan(
        src.regions, dst.regions, np.arange(3), np.arange(DST_PAGES)[::-1][:6], num_tokens=190, prefix_tokens=0
    )
    for s, t, n in zip(*plan.absolute_runs(), strict=True):
        ctypes.memmove(int(t), int(s), int(n))
    return plan


def digest_lists(real: list[int]) -> st.SearchStrategy[Any]:
    """The true list, or it edited (a value changed, one dropped or added), or anything at all."""
    edited = st.tuples(st.integers(0, len(real) - 1), st.sampled_from(["change", "drop", "add"]), ints).map(
        lambda e: real[: e[0]] + ([e[2]] if e[1] != "drop" else []) + real[e[0] + (e[1] != "add") :]
    )
    return st.one_of(st.just(real), edited, hostile, st.lists(ints, max_size=12))


@FUZZ
@given(data=st.data(), corrupt=st.booleans())
def test_digest_replies_are_checked_or_refused(landed, data, corrupt) -> None:
    """Both digest replies decode receives go through the wire decoder and ``check_landed`` (what the decode
    service runs): the load passes only when the bytes landed intact and the source's digests are the true
    ones; anything else is a GlmPdError (a short or long per-page list once escaped as ValueError)."""
    plan = landed
    real = plan_digests(plan, "src")
    if corrupt:
        flip_byte(*moved_byte(plan))  # flipped back below: the fixture's memory is shared by every example
    try:
        check_replies(plan, real, corrupt, data)
    finally:
        if corrupt:
            flip_byte(*moved_byte(plan))


def check_replies(plan: TransferPlan, real: list[int], corrupt: bool, data: st.DataObject) -> None:
    claimed = {"type": "claimed", "v": PROTOCOL_VERSION, "request_id": "r", "lease_s": 1.0}
    claimed["digests"] = data.draw(digest_lists(real))
    claim = decode_or_refuse(msgspec.msgpack.encode(claimed))
    if claim is None:
        return

    def page_digests_of(regions: list[int]) -> dict[int, list[int]]:
        true = {i: page_digests(plan, i, "src") for i in regions}
        pages = data.draw(
            st.one_of(
                st.just(true),
                st.fixed_dictionaries({i: digest_lists(v) for i, v in true.items()}),
                st.dictionaries(ints, st.lists(ints, max_size=8), max_size=3),
                hostile,
            )
        )
        reply = decode_or_refuse(
            msgspec.msgpack.encode({"type": "page_digests", "v": PROTOCOL_VERSION, "request_id": "r", "pages": pages})
        )
        if reply is None:
            raise ProtocolError("refused")  # what the side channel raises for a malformed reply
        return reply.pages

    try:
        check_landed(plan, claim.digests or [], page_digests_of)
    except GlmPdError as exc:
        assert str(exc)
        assert corrupt or claim.digests != real, f"an intact load was refused: {exc}"
    else:
        assert not corrupt and claim.digests == real, "a corrupted load or a false digest passed"


# -- the handshake: a peer's hello --------------------------------------------------------------------
@pytest.fixture
def local(small_spec) -> CacheSpec:
    """The local spec with a model revision, so that the revision is compared too."""
    return dataclasses.replace(small_spec, geometry=dataclasses.replace(small_spec.geometry, revision="rev-a"))


@pytest.fixture
def hello(local) -> proto.Hello:
    """A real hello of the local spec (what a matching peer sends)."""
    caches = HostCaches(local, page_tokens=64, num_pages=4)
    return make_hello("p0", local, PeerShape(64, 2, 1), caches.regions, "nixl", "agent-p0", b"meta")


def wire(hello: proto.Hello) -> proto.Hello:
    """Through the encoder and decoder, as a peer's hello arrives."""
    msg = proto.decode(proto.encode(hello))
    assert isinstance(msg, proto.Hello)
    return msg


FP_FIELDS: dict[str, mi.Type] = {f.name: f.type for f in mi.type_info(Fingerprint).fields}  # type: ignore[union-attr]
FP_TYPES: dict[str, Any] = {f.name: f.type for f in msgspec.structs.fields(Fingerprint)}


@FUZZ
@given(data=st.data(), fields=st.sets(st.sampled_from(sorted(FP_FIELDS)), min_size=1))
def test_a_hello_with_any_fingerprint_field_changed_is_refused_naming_it(local, hello, data, fields) -> None:
    """Whatever values a peer claims, every differing field is named with both values; nothing else is."""
    base = hello.fingerprint
    changes = {}
    for name in fields:
        drawn = typed(FP_FIELDS[name]).map(lambda v: tuple(v) if isinstance(v, list) else v)  # as msgpack gives
        changes[name] = data.draw(drawn.filter(lambda v, n=name: v is not None and v != getattr(base, n)))
    peer = wire(msgspec.structs.replace(hello, fingerprint=msgspec.structs.replace(base, **changes)))
    with pytest.raises(LayoutMismatch) as err:
        accept_hello(local, peer, backend="nixl", role="prefill", local_role="decode")
    assert {name for name, _, _ in err.value.diffs} == fields
    for name, value in changes.items():
        assert f"{name}: decode={getattr(base, name)!r} prefill p0={value!r}" in str(err.value)


@FUZZ
@given(data=st.data(), name=st.sampled_from(sorted(FP_FIELDS)))
def test_a_fingerprint_field_of_the_wrong_type_is_refused_naming_it(hello, data, name) -> None:
    """Wrong types inside the fingerprint never reach the comparison: decode refuses them by path."""
    raw = msgspec.to_builtins(hello, builtin_types=(bytes,))
    raw["fingerprint"][name] = data.draw(hostile.filter(lambda v: not wire_accepts(v, FP_TYPES[name])))
    with pytest.raises(ProtocolError, match=rf"\$\.fingerprint\.{name}"):
        proto.decode(msgspec.msgpack.encode(raw))


@FUZZ
@given(page_tokens=ints, tp_size=ints, tp_rank=ints)
def test_a_hostile_peer_shape_is_refused_naming_the_field(local, hello, page_tokens, tp_size, tp_rank) -> None:
    """Page size and TP shape from a peer: accepted only when supported, else refused by field name."""
    peer = wire(msgspec.structs.replace(hello, shape=PeerShape(page_tokens, tp_size, tp_rank)))
    if page_tokens not in SUPPORTED_PAGE_TOKENS:
        expect = "page_tokens"
    elif tp_size not in SUPPORTED_TP:
        expect = "tp_size"
    elif not 0 <= tp_rank < tp_size:
        expect = f"tp_rank {tp_rank} "
    elif page_tokens != 64:
        expect = "page_bytes"  # the regions were announced for 64-token pages
    else:
        assert accept_hello(local, peer, backend="nixl", role="prefill").shape == peer.shape
        return
    with pytest.raises((ConfigError, ProtocolError), match=expect):
        accept_hello(local, peer, backend="nixl", role="prefill")


REGION_FIELDS: dict[str, mi.Type] = {f.name: f.type for f in mi.type_info(proto.RegionSummary).fields}  # type: ignore[union-attr]


@FUZZ
@given(data=st.data(), which=st.integers(0, 9), name=st.sampled_from(sorted(REGION_FIELDS)))
def test_a_hostile_region_summary_is_a_peer_view_or_refused(local, hello, data, which, name) -> None:
    """A peer's region facts (address, sizes, kind, layer, MTP flag): accepted as regions, or a GlmPdError."""
    value = data.draw(typed(REGION_FIELDS[name]).filter(lambda v: v != getattr(hello.regions[which], name)))
    regions = list(hello.regions)
    regions[which] = msgspec.structs.replace(regions[which], **{name: value})
    peer = wire(msgspec.structs.replace(hello, regions=regions))
    try:
        view = accept_hello(local, peer, backend="nixl", role="prefill")
    except GlmPdError as exc:
        assert str(exc)
        return
    for r in view.regions:  # what was accepted must be a region the plan can use
        assert r.num_pages > 0 and r.page_stride >= r.page_bytes and r.base_addr >= 0


@pytest.mark.parametrize(
    ("field", "value"), [("base_addr", UINT64_MAX), ("num_pages", 1 << 62), ("page_stride", 1 << 63)]
)
def test_a_region_past_the_address_space_is_refused_at_handshake(local, hello, field, value) -> None:
    """Transports compute run addresses in int64: a region reaching past it must be refused up front."""
    regions = [msgspec.structs.replace(hello.regions[0], **{field: value}), *hello.regions[1:]]
    with pytest.raises(ProtocolError):
        accept_hello(local, wire(msgspec.structs.replace(hello, regions=regions)), backend="nixl", role="prefill")


# -- the side channel socket ------------------------------------------------------------------------
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
        ctx.term()
        server.close()

"""Hostile zmq frames for the SGLang backend: every decoder and room check refuses with glm-pd's errors.

Anyone who can reach a rank's zmq port can send these frames. The manager's receive loop survives any
exception, but an exception other than the planned ones skips the planned handling (the room is not
failed, the peer is not told) and one that escapes into SGLang's poll loop kills the scheduler. So the
property is the same as for the core protocol: a well-typed value, or ProtocolError / PlanError /
PageOutOfRange with a message that says what was wrong.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.disaggregation.common.conn import AbortNotification, CommonKVManager

from glm_pd_common.errors import GlmPdError, PageOutOfRange, PlanError, ProtocolError
from glm_pd_common.handoff.wire.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.base import Span
from glm_pd_sglang import wire
from glm_pd_sglang.rooms import aux_runs, check_aux, check_suffix, int_pages

INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PAGE_TOKENS, NUM_PAGES = 64, 8
MESSAGES: dict[bytes, type[msgspec.Struct]] = {
    wire.TAG_REGISTER: wire.Registration,
    wire.TAG_ROOM: wire.Room,
    wire.TAG_REFUSED: wire.Refused,
    wire.TAG_DIGESTS: wire.Digests,
    wire.TAG_SLOT_ASK: wire.SlotAsk,
    wire.TAG_SLOT_LENT: wire.SlotLent,
    wire.TAG_SLOT_LANDED: wire.SlotLanded,
    wire.TAG_SLOT_FREE: wire.SlotFree,
}

ints = st.one_of(
    st.integers(-3, 70),
    st.integers(INT64_MIN, UINT64_MAX),
    st.sampled_from([INT64_MIN, -1, 0, 1, 8, INT64_MAX, INT64_MAX + 1, UINT64_MAX]),
)
hostile = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=8), st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=10,
)


def mostly(usual: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], odds: int = 5) -> st.SearchStrategy[Any]:
    """``usual`` ``odds`` times in ``odds + 1`` (one_of's branch choice is not uniform enough to rely on)."""
    return st.integers(0, odds).flatmap(lambda k: usual if k else rare)


def typed(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of the declared type (hostile numbers included), now and then a value of any type."""
    if isinstance(t, mi.IntType):
        return ints
    simple = {mi.BoolType: st.booleans(), mi.StrType: st.text(max_size=10), mi.BytesType: st.binary(max_size=24)}
    if type(t) in simple:
        return simple[type(t)]
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(mostly(typed(t.item_type), hostile, odds=9), max_size=5)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(typed(u) for u in t.types))
    if isinstance(t, mi.StructType):
        fields = {f.encode_name: mostly(typed(f.type), hostile, odds=9) for f in t.fields}
        if "v" in fields:  # mostly this version, so that the rest of the shape gets looked at
            fields["v"] = mostly(st.just(PROTOCOL_VERSION), ints, odds=9)
        return st.fixed_dictionaries(fields).map(lambda d: list(d.values()) if t.array_like else d)
    raise AssertionError(f"no strategy for {t}")


def conforms(value: Any, t: mi.Type) -> bool:
    """Does a decoded value have exactly its declared type (a bool is not an int)?"""
    if isinstance(t, mi.IntType):
        return type(value) is int and INT64_MIN <= value <= UINT64_MAX
    simple = {mi.BoolType: bool, mi.StrType: str, mi.BytesType: bytes, mi.NoneType: type(None)}
    if type(t) in simple:
        return type(value) is simple[type(t)]
    if isinstance(t, mi.ListType):
        return type(value) is list and all(conforms(v, t.item_type) for v in value)
    if isinstance(t, mi.UnionType):
        return any(conforms(value, u) for u in t.types)
    if isinstance(t, mi.StructType):
        return type(value) is t.cls and all(conforms(getattr(value, f.name), f.type) for f in t.fields)
    raise AssertionError(f"no rule for {t}")


def parse_or_refuse(frames: list[bytes], kind: type[msgspec.Struct]) -> msgspec.Struct | None:
    """The property of every payload decoder: a well-typed message, or ProtocolError."""
    try:
        msg = wire.parse(frames, kind)
    except ProtocolError as exc:
        assert str(exc)
        return None
    assert conforms(msg, mi.type_info(kind)), f"ill-typed {msg!r}"
    assert msg.v == PROTOCOL_VERSION  # type: ignore[attr-defined]  # every payload kind is versioned
    if isinstance(msg, wire.Digests):
        assert len(msg.regions) == len(msg.digests)  # what verify_room zips with strict=True
    return msg


@settings(max_examples=200, deadline=None)
@given(data=st.data(), tag=st.sampled_from(sorted(MESSAGES)))
def test_payloads_are_well_typed_or_refused(data, tag) -> None:
    """Payloads of the declared shape with hostile values, wrong types and missing fields."""
    kind = MESSAGES[tag]
    payload = data.draw(mostly(typed(mi.type_info(kind)), hostile, odds=7))
    if isinstance(payload, dict) and payload and data.draw(st.integers(0, 5)) == 0:
        payload.pop(data.draw(st.sampled_from(sorted(payload))), None)
    parse_or_refuse([tag, msgspec.msgpack.encode(payload)], kind)


@settings(max_examples=200, deadline=None)
@given(tag=st.sampled_from(sorted(MESSAGES)), blob=st.binary(max_size=200))
def test_random_bytes_are_refused_or_well_typed(tag, blob) -> None:
    """Arbitrary bytes behind each tag."""
    parse_or_refuse([tag, blob], MESSAGES[tag])


def _samples() -> dict[bytes, msgspec.Struct]:
    """One valid message per tag."""
    return {
        wire.TAG_REGISTER: wire.Registration(b"hello", "10.0.0.2", 17001, 0, [wire.AuxBuffer(4096, 64, 8)]),
        wire.TAG_ROOM: wire.Room(7, "agent", "10.0.0.2", 17001, [1, 2], [1, 2], 3, 64, 1, False),
        wire.TAG_REFUSED: wire.Refused(0, "no"),
        wire.TAG_DIGESTS: wire.Digests(7, ["main[layer 0]"], [UINT64_MAX]),
        wire.TAG_SLOT_ASK: wire.SlotAsk(7, 1, "10.0.0.3", 17002),
        wire.TAG_SLOT_LENT: wire.SlotLent(7, "agent", [0, 1 << 20], 1 << 20),
        wire.TAG_SLOT_LANDED: wire.SlotLanded(7, 1, 3, True, [1 << 40, (1 << 40) + 4096], [4096, 64]),
        wire.TAG_SLOT_FREE: wire.SlotFree(7, "agent", 3, "refused"),
    }


@pytest.mark.parametrize("tag", sorted(MESSAGES))
def test_every_truncation_and_frame_count_is_refused(tag) -> None:
    """A short payload never parses into a shorter valid message; 0, 1 or 3 frames are refused by count."""
    good = _samples()[tag]
    raw = wire.frames(tag, good)
    assert wire.parse(raw, MESSAGES[tag]) == good
    for cut in range(len(raw[1])):
        with pytest.raises(ProtocolError, match="malformed"):
            wire.parse([tag, raw[1][:cut]], MESSAGES[tag])
    for frames in ([], [tag], [*raw, b"extra"]):
        with pytest.raises(ProtocolError, match=f"has {len(frames)} frames, expected 2"):
            wire.parse(frames, MESSAGES[tag])


@pytest.mark.parametrize("tag", sorted(MESSAGES))
@pytest.mark.parametrize("version", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 0, -1, UINT64_MAX])
def test_another_protocol_version_is_refused_naming_both(tag, version) -> None:
    """A payload from a peer of another glm-pd version: refused by its header, both versions named, even where
    the rest would not parse here (another version may have another shape)."""
    good = msgspec.structs.replace(_samples()[tag], v=version)
    with pytest.raises(ProtocolError, match=f"has protocol version {version}; this peer speaks {PROTOCOL_VERSION}"):
        wire.parse(wire.frames(tag, good), MESSAGES[tag])
    other_shape = msgspec.msgpack.encode({"v": version, "something": "else"})
    with pytest.raises(ProtocolError, match=f"has protocol version {version}; this peer speaks {PROTOCOL_VERSION}"):
        wire.parse([tag, other_shape], MESSAGES[tag])


@pytest.mark.parametrize("tag", sorted(MESSAGES))
def test_a_payload_nested_past_the_stack_is_refused(tag) -> None:
    """A few KB nested 100,000 arrays deep makes msgspec raise RecursionError: a ProtocolError like any bad shape,
    or the listener that parses it would take it for a bug."""
    payload = b"\x82\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa1x" + b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(ProtocolError, match="undecodable"):
        wire.parse([tag, payload], MESSAGES[tag])


@pytest.mark.parametrize("tag", sorted(MESSAGES))
def test_a_payload_without_a_version_is_refused(tag) -> None:
    """What an unversioned (older) peer sends: refused as having no protocol version, not decoded."""
    fields = msgspec.structs.asdict(_samples()[tag])
    del fields["v"]
    with pytest.raises(ProtocolError, match="no protocol version"):
        wire.parse([tag, msgspec.msgpack.encode(fields)], MESSAGES[tag])


def test_oversized_payloads_are_refused_by_size_before_decoding() -> None:
    """A valid message one byte past MAX_MESSAGE_BYTES: refused for its size, naming both numbers."""
    ok = wire.Refused(0, "")
    overhead = len(msgspec.msgpack.encode(wire.Refused(0, "x" * (1 << 16)))) - (1 << 16)
    at_cap = msgspec.msgpack.encode(wire.Refused(0, "x" * (MAX_MESSAGE_BYTES - overhead)))
    assert len(at_cap) == MAX_MESSAGE_BYTES and wire.parse([wire.TAG_REFUSED, at_cap], wire.Refused) != ok
    over = at_cap + b"\x00"
    with pytest.raises(ProtocolError, match=f"{MAX_MESSAGE_BYTES + 1} bytes exceeds the cap of {MAX_MESSAGE_BYTES}"):
        wire.parse([wire.TAG_REFUSED, over], wire.Refused)


@settings(max_examples=100, deadline=None)
@given(regions=st.lists(st.text(max_size=6), max_size=5), digests=st.lists(ints, max_size=5))
def test_digests_with_unpaired_regions_are_refused_at_decode(regions, digests) -> None:
    """verify_room zips regions with digests (strict): a mismatch must be a ProtocolError here, not a
    ValueError in decode's poll loop."""
    raw = msgspec.msgpack.encode({"room": 1, "regions": regions, "digests": digests, "v": PROTOCOL_VERSION})
    if len(regions) == len(digests):
        assert wire.parse([wire.TAG_DIGESTS, raw], wire.Digests).digests == digests
    else:
        with pytest.raises(ProtocolError, match=f"{len(regions)} region names but {len(digests)} digests"):
            wire.parse([wire.TAG_DIGESTS, raw], wire.Digests)


# -- SGLang's status and abort frames (the backend's status tag, SGLang's parser) ------------------------
frame_text = st.one_of(
    st.binary(max_size=12),
    ints.map(lambda i: str(i).encode()),
    st.sampled_from([b"", b" 1 ", b"1_0", b"-0", b"0x10", "١".encode(), b"\xff", b"nan"]),
)


@settings(max_examples=200, deadline=None)
@given(frames=st.lists(frame_text, max_size=6), tagged=st.booleans())
def test_status_frames_parse_to_ints_or_are_dropped(frames, tagged) -> None:
    """The status frame decode receives from any prefill rank: (room, status, rank, reason) or None."""
    manager = SimpleNamespace(kv_status_msg_tag=wire.TAG_STATUS)
    msg = [wire.TAG_STATUS, *frames] if tagged else frames
    out = CommonKVManager.parse_kv_status_message(manager, msg)  # type: ignore[arg-type]
    if out is not None:
        room, status, rank, reason = out
        assert msg[:1] == [wire.TAG_STATUS]  # untagged frames may start with the 12-byte tag by chance
        assert all(type(x) is int for x in (room, status, rank))
        assert reason is None or isinstance(reason, str)


@settings(max_examples=200, deadline=None)
@given(frames=st.lists(frame_text, max_size=6))
def test_abort_frames_parse_or_are_dropped(frames) -> None:
    """SGLang's abort notice (prefill receives it from any decode): parsed or dropped, never raised."""
    notice = AbortNotification.from_zmq([b"ABORT", *frames])
    assert notice is None or type(notice.room) is int


# -- rooms.py: decode's numbers in a room message ----------------------------------------------------
page_lists = st.one_of(
    st.lists(st.integers(0, NUM_PAGES - 1), max_size=NUM_PAGES),
    st.lists(st.integers(0, NUM_PAGES - 1), max_size=NUM_PAGES, unique=True),
    st.lists(ints, max_size=6),
)


@pytest.fixture
def caches(small_spec) -> tuple[HostCaches, HostCaches]:
    """Real regions on both sides; the fixture keeps the buffers alive."""
    return (
        HostCaches(small_spec, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES),
        HostCaches(small_spec, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES),
    )


@FUZZ
@given(
    prefix=st.one_of(
        ints,
        st.integers(0, 10).map(lambda k: k * PAGE_TOKENS),
        st.integers(0, UINT64_MAX // PAGE_TOKENS).map(lambda k: k * PAGE_TOKENS),  # aligned, past int64 too
        st.sampled_from([(1 << 63) - 8 * PAGE_TOKENS, 1 << 63, UINT64_MAX + 1 - PAGE_TOKENS]),
    ),
    pages=mostly(st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=NUM_PAGES, unique=True), page_lists, 2),
    state=mostly(st.just("same"), st.one_of(st.none(), page_lists), 2),
)
def test_a_room_that_passes_check_suffix_plans_or_is_refused_with_glm_pd_errors(caches, prefix, pages, state) -> None:
    """What prefill does with a room: int_pages, check_suffix, then (per chunk) the core plan."""
    try:
        dst = int_pages(pages, what="decode page ids")
        dst_state = dst if state == "same" else int_pages(state, what="decode DSA state page ids")
        check_suffix(prefix, dst, dst_state, PAGE_TOKENS, side="decode 10.0.0.2:17001")  # type: ignore[arg-type]
    except (ProtocolError, PlanError, PageOutOfRange) as exc:  # an id past int64: the core parser's refusal
        assert str(exc)
        return
    assert prefix >= 0 and prefix % PAGE_TOKENS == 0 and dst_state is not None and np.array_equal(dst, dst_state)
    src = np.arange(dst.size) % NUM_PAGES  # prefill's own suffix pages (it checks its count separately)
    try:
        build_plan(
            caches[0].regions,
            caches[1].regions,
            src,
            dst,
            num_tokens=prefix + dst.size * PAGE_TOKENS,
            prefix_tokens=prefix,
        )
    except (PlanError, PageOutOfRange) as exc:
        assert str(exc)


@FUZZ
@given(
    values=st.one_of(
        st.lists(ints, max_size=6),
        # (no bools mixed with ints: numpy reads [0, True] as ints; msgspec's list[int] refuses bools first)
        st.lists(st.one_of(ints, st.floats(), st.text(max_size=3), st.none()), max_size=4),
        st.lists(st.booleans(), min_size=1, max_size=3),
        st.lists(st.lists(ints, max_size=3), max_size=3),
        st.none(),
    )
)
def test_int_pages_returns_the_ids_as_sent_or_refuses(values) -> None:
    """int64 exactly as sent (no wrap-around of a uint64 id to a negative one), or ProtocolError."""
    try:
        out = int_pages(values, what="decode page ids")
    except (ProtocolError, PageOutOfRange) as exc:
        assert str(exc).startswith("decode page ids")
        return
    if values is None:
        assert out is None
        return
    assert out is not None and out.dtype == np.int64 and out.ndim == 1
    flat = [v for x in values for v in (x if isinstance(x, list) else [x])]
    assert out.tolist() == flat and all(type(v) is int for v in flat)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ([[1, 2], [3]], "not a flat list"),
        ([INT64_MAX + 1], f"page id {INT64_MAX + 1} is not a 64-bit page id"),
        ([UINT64_MAX, 0], f"page id {UINT64_MAX} is not a 64-bit page id"),
        ([1.0], "not integers"),
        ([True], "not integers"),
        (["1"], "not integers"),
    ],
)
def test_int_pages_names_what_is_wrong(values, needle) -> None:
    """Each refusal says what is wrong with the list."""
    with pytest.raises(GlmPdError, match=needle):
        int_pages(values, what="decode page ids")


aux_triples = st.lists(st.tuples(ints, ints, st.one_of(st.integers(0, 64), ints)), max_size=4)


@FUZZ
@given(remote=aux_triples, data=st.data())
def test_check_aux_then_aux_runs_stay_inside_both_buffers(remote, data) -> None:
    """Decode's metadata buffers (pointer, length, item): refused, or every run lies inside both buffers."""
    local_items = [item for _, _, item in remote] if data.draw(st.booleans()) else data.draw(st.lists(ints, max_size=4))
    try:
        spans = check_aux(local_items, remote, peer="10.0.0.2:17001")
    except ProtocolError as exc:
        assert str(exc)
        return
    for span, (ptr, size, item) in zip(spans, remote, strict=True):
        assert 0 < span.base_addr == ptr and item <= size == span.size_bytes and ptr + size <= INT64_MAX
    mine = [Span(f"prefill aux[{i}]", 1 << 20, 64 * max(item, 1)) for i, item in enumerate(local_items)]
    src_index, dst_index = data.draw(ints), data.draw(ints)
    try:
        src, dst, lengths = aux_runs(mine, spans, local_items, src_index, dst_index)
    except PageOutOfRange as exc:
        assert "metadata slot" in str(exc)
        return
    live = [(s, d) for s, d, item in zip(mine, spans, local_items, strict=True) if item]
    assert src.size == dst.size == lengths.size == len(live)
    for (s, d), a, b, n in zip(live, src, dst, lengths, strict=True):
        assert s.base_addr <= a and a + n <= s.base_addr + s.size_bytes
        assert d.base_addr <= b and b + n <= d.base_addr + d.size_bytes

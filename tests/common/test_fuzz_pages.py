"""Hostile page ids, page arrays and digest replies from a peer: a plan only when valid, else a GlmPdError
naming the defect; never another exception (see test_fuzz_messages.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from glm_pd_common.errors import GlmPdError, PageOutOfRange, PlanError, ProtocolError
from glm_pd_common.handoff.wire import protocol as proto
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.layout.digest_order import moved_byte
from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.digests import check_landed, page_digests, plan_digests
from tests.support.faults import flip
from tests.support.hostile import (
    FUZZ,
    INT64_MAX,
    INT64_MIN,
    UINT64_MAX,
    decode_or_refuse,
    hostile,
    ints,
)

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
        flip(*moved_byte(plan))  # flipped back below: the fixture's memory is shared by every example
    try:
        check_replies(plan, real, corrupt, data)
    finally:
        if corrupt:
            flip(*moved_byte(plan))


def check_replies(plan: TransferPlan, real: list[int], corrupt: bool, data: st.DataObject) -> None:
    def source_digests(digests: object) -> bytes:
        return msgspec.msgpack.encode({"type": "source_digests", "v": PROTOCOL_VERSION, "request_id": "r",
                                       "digests": digests})  # fmt: skip

    # the true reply decodes (else every drawn one would be refused and nothing below would run)
    assert decode_or_refuse(source_digests(real)) is not None
    claim = decode_or_refuse(source_digests(data.draw(digest_lists(real))))
    if claim is None:
        return
    assert isinstance(claim, proto.SourceDigests)

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
        check_landed(plan, claim.digests, page_digests_of)
    except GlmPdError as exc:
        assert str(exc)
        assert corrupt or claim.digests != real, f"an intact load was refused: {exc}"
    else:
        assert not corrupt and claim.digests == real, "a corrupted load or a false digest passed"


# -- the handshake: a peer's hello --------------------------------------------------------------------

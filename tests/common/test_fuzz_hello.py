"""Hostile handshakes: a hello whose fingerprint, shape or regions differ or are ill-typed is refused naming the
field; never another exception (see test_fuzz_messages.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm_pd_common.errors import ConfigError, GlmPdError, LayoutMismatch, ProtocolError
from glm_pd_common.handoff.wire import protocol as proto
from glm_pd_common.handoff.wire.handshake import accept_hello, make_hello
from glm_pd_common.layout.fingerprint import Fingerprint, PeerShape
from glm_pd_common.layout.formats import SUPPORTED_PAGE_TOKENS
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.layout.tp import SUPPORTED_TP
from glm_pd_common.tools.hostmem import HostCaches
from tests.support.hostile import (
    FUZZ,
    UINT64_MAX,
    hostile,
    ints,
    typed,
    wire_accepts,
)


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

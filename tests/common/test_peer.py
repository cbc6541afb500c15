"""The handshake treats a peer's hello as hostile input: every bad fact is refused by name."""

import msgspec
import pytest

from glm_pd_common.errors import ConfigError, LayoutMismatch, ProtocolError
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import accept_hello, make_hello
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.tools.hostmem import HostCaches


@pytest.fixture
def hello(small_spec):
    caches = HostCaches(small_spec, page_tokens=64, num_pages=4)
    return make_hello("p0", small_spec, PeerShape(64, 2, 1), caches.regions, "nixl", "agent-p0", b"meta")


def test_a_good_hello_becomes_plan_regions(small_spec, hello):
    peer = accept_hello(small_spec, hello, backend="nixl", role="prefill")
    assert [r.key for r in peer.regions][:3] == [("main", 0), ("indexer", 0), ("main", 1)]
    assert peer.regions[-1].is_mtp and peer.shape.page_tokens == 64
    assert len(peer.spans) == len(peer.regions)


def _with_regions(hello, regions):
    return msgspec.structs.replace(hello, regions=regions)


def test_indexer_on_a_shared_layer_is_refused(small_spec, hello):
    extra = msgspec.structs.replace(hello.regions[1], layer_id=1)
    with pytest.raises(ProtocolError, match=r"unexpected \[\('indexer', 1\)\]"):
        accept_hello(small_spec, _with_regions(hello, [*hello.regions, extra]), backend="nixl", role="prefill")


def test_missing_indexer_region_is_refused(small_spec, hello):
    without = [r for r in hello.regions if (r.kind, r.layer_id) != ("indexer", 6)]
    with pytest.raises(ProtocolError, match=r"missing \[\('indexer', 6\)\]"):
        accept_hello(small_spec, _with_regions(hello, without), backend="nixl", role="prefill")


def test_duplicate_region_is_refused(small_spec, hello):
    with pytest.raises(ProtocolError, match="duplicate"):
        accept_hello(
            small_spec, _with_regions(hello, [*hello.regions, hello.regions[0]]), backend="nixl", role="prefill"
        )


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("page_bytes", 576 * 64, "page_bytes"),
        ("page_stride", 10, "page_stride"),
        ("num_pages", 0, "num_pages"),
        ("base_addr", -5, "bad address"),
    ],
)
def test_bad_region_facts_are_refused(small_spec, hello, field, value, needle):
    bad = [msgspec.structs.replace(hello.regions[0], **{field: value}), *hello.regions[1:]]
    with pytest.raises(ProtocolError, match=needle):
        accept_hello(small_spec, _with_regions(hello, bad), backend="nixl", role="prefill")


def test_fingerprint_and_transport_and_shape_are_checked(small_spec, hello):
    other = msgspec.structs.replace(hello.fingerprint, main_row_bytes=576)
    with pytest.raises(LayoutMismatch, match="main_row_bytes: decode=656 prefill p0=576"):
        accept_hello(
            small_spec,
            msgspec.structs.replace(hello, fingerprint=other),
            backend="nixl",
            role="prefill",
            local_role="decode",
        )
    with pytest.raises(ProtocolError, match="transport 'nixl'"):
        accept_hello(small_spec, hello, backend="mooncake", role="prefill")
    with pytest.raises(ConfigError, match="page_tokens"):
        accept_hello(
            small_spec, msgspec.structs.replace(hello, shape=PeerShape(48, 2, 0)), backend="nixl", role="prefill"
        )


def test_hello_survives_the_wire(small_spec, hello):
    again = protocol.decode(protocol.encode(hello))
    assert accept_hello(small_spec, again, backend="nixl", role="prefill").engine_id == "p0"

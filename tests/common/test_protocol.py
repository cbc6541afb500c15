import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm_pd_common.errors import ProtocolError
from glm_pd_common.handoff.wire import protocol as proto
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.spec import CacheSpec

V = PROTOCOL_VERSION


def _hello():
    fp = CacheSpec.create(ModelGeometry.preset("glm-5.3")).fingerprint()
    return proto.Hello(
        v=V,
        engine_id="p0",
        fingerprint=fp,
        shape=PeerShape(64, 8, 0),
        regions=[proto.RegionSummary("main", 0, False, 1 << 30, 100, 41984, 41984)],
        transport="nixl",
        agent_name="a",
        agent_metadata=b"\x00meta",
    )


@pytest.mark.parametrize(
    "msg",
    [
        _hello(),
        proto.TransferRequest(v=V, request_id="r", num_tokens=10, prefix_tokens=0, src_pages=[1], dst_pages=[2]),
        proto.Done(v=V, request_id="r"),
        proto.Claimed(v=V, request_id="r"),
        proto.SourceDigests(v=V, request_id="r", digests=[0, 2**64 - 1]),
        proto.Released(v=V, request_id="r"),
        proto.Query(v=V, engine_id="doctor"),
        proto.Failed(v=V, request_id="r", reason="x"),
        proto.Failed(v=V, request_id="r", reason="x", code="lease_expired"),
        proto.Abort(v=V, request_id="r", reason="x"),
        proto.Heartbeat(v=V, engine_id="e", seq=3),
        proto.Renew(v=V, request_ids=["a", "b"]),
        proto.DigestQuery(v=V, request_id="r", region_indices=[0]),
        proto.PageDigests(v=V, request_id="r", pages={0: [1, 2]}),
    ],
)
def test_round_trip(msg):
    assert proto.decode(proto.encode(msg)) == msg


def test_unknown_version_refused_before_shape():
    raw = msgspec.msgpack.encode({"type": "done", "v": 99, "whatever": [1]})
    with pytest.raises(ProtocolError, match="protocol version 99"):
        proto.decode(raw)


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "done", "v": V, "request_id": 5},
        {"type": "done", "v": V},
        {"type": "nope", "v": V},
        {"type": "done", "v": V, "request_id": "r", "num_bytes": 1},  # a field of version 1, gone in 2
        {"type": "page_digests", "v": V, "request_id": "r", "pages": {0: [-1]}},  # digests are uint64
        {"type": "failed", "v": V, "request_id": "r", "reason": "x", "code": "lease expired"},  # not a code
        {"type": "renew", "v": V, "request_ids": [1]},
        {"type": "renew", "v": V, "request_ids": ["r"] * (proto.MAX_RENEW_IDS + 1)},  # past the cap: split it
        {"type": "renew", "v": V, "request_id": "r"},  # one id is a list of one
        {"type": "source_digests", "v": V, "request_id": "r", "digests": [-5]},  # digests are uint64
        {"type": "claimed", "v": V, "request_id": "r", "digests": [5]},  # since version 8 they follow the claim
        {"type": "claimed", "v": V, "request_id": "r", "lease_s": 1.0},  # sent in version 1, never read: gone
        {
            "type": "transfer",
            "v": V,
            "request_id": "r",
            "num_tokens": 1,
            "prefix_tokens": 0,
            "src_pages": ["1"],
            "dst_pages": [1],
        },
    ],
)
def test_wrong_shape_refused(raw):
    with pytest.raises(ProtocolError, match="malformed"):
        proto.decode(msgspec.msgpack.encode(raw))


def test_oversized_refused():
    with pytest.raises(ProtocolError, match="exceeds the cap"):
        proto.decode(b"\x00" * (proto.MAX_MESSAGE_BYTES + 1))


@given(st.binary(max_size=256))
def test_arbitrary_bytes_never_crash(blob):
    with contextlib.suppress(ProtocolError):
        proto.decode(blob)


def test_truncated_hello_refused():
    raw = proto.encode(_hello())
    with pytest.raises(ProtocolError):
        proto.decode(raw[: len(raw) // 2])


def test_every_failure_code_crosses_the_wire():
    """Decode's ``LoadResult.code`` and prefill's ``Failed.code`` share one vocabulary, all of it valid."""
    for code in proto.FAILURE_CODES:
        msg = proto.Failed(v=V, request_id="r", reason="x", code=code)
        assert proto.decode(proto.encode(msg)).code == code


def test_a_version_2_peer_is_refused_by_its_number():
    """Version 3 added ``renew`` and ``Failed.code``: a version 2 peer's messages are refused, not misread."""
    raw = msgspec.msgpack.encode({"type": "failed", "v": 2, "request_id": "r", "reason": "x"})
    with pytest.raises(ProtocolError, match=f"protocol version 2; this peer speaks {V}"):
        proto.decode(raw)

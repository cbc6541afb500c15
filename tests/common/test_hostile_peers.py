"""A stranger on the side channel can neither stall prefill's service nor make it hold what it likes.

Real PrefillService and DecodeService over NIXL on loopback; the hostile peer is a plain side-channel client
(or a raw ZeroMQ socket for frames no client would build), with a real decode endpoint where it must pass the
handshake first.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import zmq

from glm_pd_common.errors import ProtocolError
from glm_pd_common.handoff.decode.service import LoadJob
from glm_pd_common.handoff.prefill.caps import PeerCaps
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient
from tests.support.services import PAGE_TOKENS, Decode, Prefill, endpoint, handshaken, wait_for

V = PROTOCOL_VERSION


def nested(depth: int) -> bytes:
    """A 'renew' frame whose id list is nested ``depth`` arrays deep (a few KB)."""
    head = b"\x83\xa4type\xa5renew\xa1v" + bytes([V]) + b"\xabrequest_ids"
    return head + b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_a_deeply_nested_frame_is_a_protocol_error(depth: int) -> None:
    with pytest.raises(ProtocolError, match="undecodable"):
        protocol.decode(nested(depth))


def test_text_past_its_bound_is_refused_without_echoing_it() -> None:
    frame = protocol.encode(
        protocol.TransferRequest(v=V, request_id="x" * (2 << 20), num_tokens=1, prefix_tokens=0, src_pages=[],
                                 dst_pages=[])
    )  # fmt: skip
    with pytest.raises(ProtocolError) as refused:
        protocol.decode(frame)
    assert "length <= 512" in str(refused.value) and len(str(refused.value)) < 200


class Flood:
    """A stranger sending nested frames as fast as its socket takes them, until stopped."""

    def __init__(self, port: int) -> None:
        self.sent, self._stop = 0, threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 1000)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        frame = nested(1_000)
        while not self._stop.is_set():
            try:
                self._sock.send(frame, zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:
                time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close()
        self._ctx.term()


def test_a_flood_of_nested_frames_leaves_expiry_and_loads_running(small_spec, caplog) -> None:
    """While a stranger floods prefill with frames nested 1,000 deep, a lease still expires (each bad frame used to
    throw the whole service step away, expiry included: a 2 s lease expired after 22.5 s) and a healthy decode's
    load completes. The flood keeps going until both have been seen; refusals are logged in batches."""
    lease_s = 1.0
    prefill, decode = Prefill(small_spec, lease_s=lease_s), Decode(small_spec)
    flood = Flood(prefill.service.port)
    try:
        wait_for(lambda: flood.sent, lambda n: n > 100, 30.0)
        prefill.service.grant("unclaimed", prefill.table[:2])
        ended = prefill.finished("unclaimed", 20 * lease_s)
        assert ended is not None and ended.outcome == "expired", ended
        result = decode.load(prefill, "healthy", 2 * PAGE_TOKENS)
        assert result.ok, result.reason
        assert flood.sent > 1000, "the flood stopped before the checks: it proved nothing"
    finally:
        flood.stop()
        decode.close()
        prefill.close()
    refusals = [r for r in caplog.records if "refused" in r.getMessage() and "side-channel" in r.getMessage()]
    assert len(refusals) < flood.sent / 10, f"{len(refusals)} log lines for {flood.sent} frames"


def _claim(client: SideChannelClient, request_id: str, pages: int) -> None:
    ids = list(range(pages))
    client.send(protocol.TransferRequest(v=V, request_id=request_id, num_tokens=pages * PAGE_TOKENS,
                                         prefix_tokens=0, src_pages=ids, dst_pages=ids))  # fmt: skip


def _refusal(client: SideChannelClient) -> str:
    reply = client.recv(10.0)
    assert isinstance(reply, protocol.Failed), reply
    return reply.reason


def test_claims_for_ids_never_granted_are_kept_within_their_caps(small_spec) -> None:
    caps = PeerCaps(early_claims=2, early_pages=1000)
    prefill = Prefill(small_spec, caps=caps)
    stranger = handshaken(small_spec, prefill.service.port, "stranger")
    try:
        _claim(stranger, "a", 10)
        _claim(stranger, "b", 10)
        held = wait_for(prefill.service.leftovers, lambda h: h["early_claims"] == 2, 10.0)
        assert held["early_claims"] == 2, held
        _claim(stranger, "c", 10)
        assert "at most 2 claims per decode" in _refusal(stranger)
        other = handshaken(small_spec, prefill.service.port, "other")
        _claim(other, "d", 600)  # 40 + 1,200 page ids: past the 1,000 all waiting claims may hold
        assert "1000 page ids in all" in _refusal(other)
        assert prefill.service.leftovers()["early_claims"] == 2
        other.close()
    finally:
        stranger.close()
        prefill.close()


def test_decode_peers_and_subscriptions_stay_within_their_caps(small_spec) -> None:
    prefill = Prefill(small_spec, streamed=True, caps=PeerCaps(peers=1, subscriptions=1))
    first = handshaken(small_spec, prefill.service.port, "first")
    try:
        _, local = endpoint(small_spec, "second", 10.0)
        second = SideChannelClient("127.0.0.1", prefill.service.port)
        second.send(local.hello(local.transport.metadata()))
        assert "at most 1 decode peers" in _refusal(second)
        second.close()
        first.send(protocol.Subscribe(v=V, request_id="t1", num_tokens=100))
        assert isinstance(first.recv(10.0), protocol.Progress)  # nothing computed yet: no tokens, no pages
        first.send(protocol.Subscribe(v=V, request_id="t2", num_tokens=100))
        assert "at most 1 streamed subscriptions" in _refusal(first)
        assert prefill.service.leftovers()["streams"] == 1
    finally:
        first.close()
        prefill.close()


def test_a_huge_request_id_is_neither_answered_nor_logged_whole(small_spec, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    prefill = Prefill(small_spec)
    client = handshaken(small_spec, prefill.service.port, "long-ids")
    try:
        _claim(client, "x" * (4 << 20), 1)
        client.send(protocol.Done(v=V, request_id="after"))  # answered or kept: the service went on
        held = wait_for(prefill.service.leftovers, lambda h: h["early_claims"] == 1, 10.0)
        assert held["early_claims"] == 1, held
        assert client.waiting() == []  # the long id was never echoed back
        assert max(len(r.getMessage()) for r in caplog.records) < 4096
    finally:
        client.close()
        prefill.close()


def test_a_real_load_is_unaffected_by_the_caps(small_spec) -> None:
    prefill, decode = Prefill(small_spec, caps=PeerCaps(early_claims=1, early_pages=64)), Decode(small_spec)
    try:
        table = prefill.table[:3]
        decode.service.submit(LoadJob("early", prefill.remote, table, np.arange(3), 3 * PAGE_TOKENS, 0))
        wait_for(prefill.service.leftovers, lambda h: h["early_claims"] == 1, 10.0)
        prefill.service.grant("early", table)
        results = wait_for(decode.service.results, bool, 30.0)
        assert results and results[0].ok, results
    finally:
        decode.close()
        prefill.close()


def test_a_claim_for_the_wrong_pages_changes_nothing(small_spec) -> None:
    """A peer claims a live lease naming pages it does not hold: refused, and the lease stays unclaimed, so the
    real decode's renewals still count (a claimed lease ignores them and lives only the transfer's bound, 1 s
    here) and its claim after three such bounds is served."""
    prefill = Prefill(small_spec, lease_s=3.0, timeout_s=1.0)
    stranger = handshaken(small_spec, prefill.service.port, "stranger")
    owner = handshaken(small_spec, prefill.service.port, "owner")
    try:
        table = prefill.table[:2]
        prefill.service.grant("live", table)
        wait_for(prefill.service.leftovers, lambda h: h["leases"] == 1, 10.0)
        wrong = [int(p) for p in prefill.table[2:4]]
        stranger.send(protocol.TransferRequest(v=V, request_id="live", num_tokens=2 * PAGE_TOKENS, prefix_tokens=0,
                                               src_pages=wrong, dst_pages=[0, 1]))  # fmt: skip
        assert "not the pages it holds" in _refusal(stranger)
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            owner.send(protocol.Renew(v=V, request_ids=["live"]))
            time.sleep(0.3)
        owner.send(protocol.TransferRequest(v=V, request_id="live", num_tokens=2 * PAGE_TOKENS, prefix_tokens=0,
                                            src_pages=[int(p) for p in table], dst_pages=[0, 1]))  # fmt: skip
        reply = owner.recv(10.0)
        assert isinstance(reply, protocol.Claimed), reply
    finally:
        stranger.close()
        owner.close()
        prefill.close()

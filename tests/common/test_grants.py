"""A lease or a streamed transfer belongs to the decode that acted on it first; a peer holding the credential but
not the grant can neither take it over nor end it, nor evict that decode by borrowing its agent name.

Real PrefillService and DecodeService over NIXL on loopback; the other decode is a handshaken side-channel client
with an endpoint of its own (another engine id), driven by hand.
"""

from __future__ import annotations

import time

import numpy as np

from glm_pd_common.handoff.decode.service import LoadJob
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient
from tests.support.services import PAGE_TOKENS, Decode, Prefill, claim, endpoint, handshaken, rivals, wait_for

V = PROTOCOL_VERSION


def served(client: SideChannelClient) -> None:
    """Return once prefill has served everything ``client`` sent so far: one service thread answers each
    connection's messages in order, so the answer to a query sent last comes after them."""
    client.send(protocol.Query(v=V, engine_id="barrier"))
    assert isinstance(client.recv(10.0), protocol.Hello)


def refused(client: SideChannelClient) -> str:
    reply = client.recv(10.0)
    assert isinstance(reply, protocol.Failed) and reply.code == "refused_peer", reply
    return reply.reason


def test_another_decode_can_neither_claim_nor_release_nor_abort_a_claimed_lease(small_spec) -> None:
    with rivals(small_spec) as (prefill, owner, other):
        table = prefill.table[:2]
        prefill.service.grant("r", table)
        assert isinstance(claim(owner, "r", table), protocol.Claimed)
        assert isinstance(claim(other, "r", table), protocol.Failed)
        other.send(protocol.Done(v=V, request_id="r"))
        assert "granted to another decode" in refused(other)
        other.send(protocol.Abort(v=V, request_id="r", reason="stolen"))
        assert "granted to another decode" in refused(other)
        assert prefill.service.leftovers()["leases"] == 1 and prefill.service.finished() == []
        owner.send(protocol.Done(v=V, request_id="r"))
        assert isinstance(owner.recv(10.0), protocol.Released)
        assert prefill.finished("r", 5.0).outcome == "released"


def test_renewals_from_another_decode_do_not_hold_a_lease(small_spec) -> None:
    """The owner renews once (making the lease its own) and stops; another decode renewing every 0.1 s must not
    keep the pages: the lease expires about one lease after the owner's renewal."""
    lease_s = 1.0
    with rivals(small_spec, lease_s=lease_s) as (prefill, owner, other):
        prefill.service.grant("r", prefill.table[:2])
        wait_for(prefill.service.leftovers, lambda h: h["leases"] == 1, 10.0)
        owner.send(protocol.Renew(v=V, request_ids=["r"]))
        served(owner)  # the owner's renewal came first
        ended = None
        deadline = time.monotonic() + 10 * lease_s
        while ended is None and time.monotonic() < deadline:
            other.send(protocol.Renew(v=V, request_ids=["r"]))
            ended = prefill.finished("r", 0.1)
        assert ended is not None and ended.outcome == "expired", ended


def test_an_abort_before_the_grant_drops_only_the_senders_own_claim(small_spec) -> None:
    with rivals(small_spec) as (prefill, owner, other):
        table = prefill.table[:2]
        src = [int(p) for p in table]
        owner.send(protocol.TransferRequest(v=V, request_id="early", num_tokens=2 * PAGE_TOKENS, prefix_tokens=0,
                                            src_pages=src, dst_pages=[0, 1]))  # fmt: skip
        wait_for(prefill.service.leftovers, lambda h: h["early_claims"] == 1, 10.0)
        other.send(protocol.Abort(v=V, request_id="early", reason="not mine"))
        served(other)  # the abort came before the grant below
        prefill.service.grant("early", table)
        assert isinstance(owner.recv(10.0), protocol.Claimed)


def test_another_decode_can_neither_subscribe_to_nor_abort_a_streamed_transfer(small_spec) -> None:
    with rivals(small_spec, streamed=True) as (prefill, owner, other):
        owner.send(protocol.Subscribe(v=V, request_id="t", num_tokens=2 * PAGE_TOKENS))
        assert isinstance(owner.recv(10.0), protocol.Progress)
        other.send(protocol.Subscribe(v=V, request_id="t", num_tokens=2 * PAGE_TOKENS))
        assert "belongs to that decode" in refused(other)
        other.send(protocol.Abort(v=V, request_id="t", reason="stolen"))
        assert "granted to another decode" in refused(other)
        prefill.service.open_stream("t", 2 * PAGE_TOKENS)
        prefill.service.grant_stream("t-lease", "t", prefill.table[:2], 2 * PAGE_TOKENS)
        progress = owner.recv(10.0)
        while isinstance(progress, protocol.Progress) and not progress.lease_id:
            progress = owner.recv(10.0)
        assert isinstance(progress, protocol.Progress) and progress.lease_id == "t-lease", progress
        assert other.waiting() == []  # it was never sent the pages or the lease id


def test_a_hello_borrowing_a_live_decodes_agent_name_evicts_nothing(small_spec) -> None:
    """Another peer's hello under a live decode's agent name is refused, and the decode keeps loading; the decode
    itself on a new connection (its hellos carry its process's proof) replaces its old connection at once."""
    prefill, decode = Prefill(small_spec, idle_s=30.0), Decode(small_spec, "decode-0")
    try:
        assert decode.load(prefill, "before", 2 * PAGE_TOKENS).ok
        _, impostor = endpoint(small_spec, "decode-0", 10.0)
        client = SideChannelClient("127.0.0.1", prefill.service.port)
        client.send(impostor.hello(impostor.transport.metadata(), b"\x00" * 32))
        assert "connected and live" in refused(client)
        client.close()
        result = decode.load(prefill, "after", 2 * PAGE_TOKENS)
        assert result.ok, result.reason
        proof = decode.service._links.proof("prefill-0", 0)
        again = SideChannelClient("127.0.0.1", prefill.service.port)
        again.send(decode.local.hello(decode.local.transport.metadata(), proof))
        assert isinstance(again.recv(10.0), protocol.Hello)
        assert prefill.service.leftovers()["decode_peers"] == 1  # the old connection was replaced
        again.close()
    finally:
        decode.close()
        prefill.close()


def test_a_decode_pointed_at_a_lease_of_another_decode_fails_cleanly(small_spec) -> None:
    """Through the real decode service: the lease another decode claimed is refused as a peer refusal, and
    nothing of decode's is left behind."""
    prefill, decode = Prefill(small_spec), Decode(small_spec, "decode-0")
    owner = handshaken(small_spec, prefill.service.port, "owner")
    try:
        table = prefill.table[:2]
        prefill.service.grant("taken", table)
        assert isinstance(claim(owner, "taken", table), protocol.Claimed)
        decode.service.submit(LoadJob("taken", prefill.remote, table, np.arange(2), 2 * PAGE_TOKENS, 0))
        results = wait_for(decode.service.results, bool, 30.0)
        assert results and not results[0].ok and results[0].code == "refused_peer", results
        assert "granted to another decode" in results[0].reason
    finally:
        owner.close()
        decode.close()
        prefill.close()


def test_renewing_another_decodes_streamed_transfer_does_not_take_its_lease(small_spec) -> None:
    """Renewals may name a transfer id; one naming a transfer another decode subscribed to is ignored, so it
    cannot make the lease its own before the subscriber claims it."""
    with rivals(small_spec, streamed=True) as (prefill, owner, other):
        owner.send(protocol.Subscribe(v=V, request_id="t", num_tokens=2 * PAGE_TOKENS))
        assert isinstance(owner.recv(10.0), protocol.Progress)
        prefill.service.open_stream("t", 2 * PAGE_TOKENS)
        prefill.service.grant_stream("t-lease", "t", prefill.table[:2], 2 * PAGE_TOKENS)
        progress = owner.recv(10.0)
        while isinstance(progress, protocol.Progress) and not progress.lease_id:
            progress = owner.recv(10.0)
        other.send(protocol.Renew(v=V, request_ids=["t"]))
        served(other)  # its renewal came before the owner's claim
        assert isinstance(claim(owner, "t-lease", prefill.table[:2]), protocol.Claimed)

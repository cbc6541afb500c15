"""Staged streamed reads, from a hostile decode's side: prefill cuts a span into slots only for a subscriber of
the transfer, only over tokens it announced written and the pages the claim's rule gives, and its slot pair goes
back when decode ends the read, the transfer ends or decode is forgotten (real services on NIXL, decodes driven
by hand)."""

from __future__ import annotations

from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient
from tests.support.services import PAGE_TOKENS, Prefill, endpoint, rivals, wait_for

V = PROTOCOL_VERSION
SLOT = 8192


def _read(transfer: str, pages: list[int], upto: int, slot_bytes: int = SLOT) -> protocol.StreamRead:
    """Tokens ``[0, upto)`` from prefill's ``pages`` into decode pages 0, 1, ..."""
    return protocol.StreamRead(v=V, request_id=transfer, num_tokens=upto, prefix_tokens=0, src_pages=pages,
                               dst_pages=list(range(len(pages))), slot_bytes=slot_bytes)  # fmt: skip


def _next(client: SideChannelClient, want: type) -> protocol.Message:
    """The next answer that is not a keepalive ``Progress``."""
    while isinstance(reply := client.recv(10.0), protocol.Progress) and want is not protocol.Progress:
        pass
    assert isinstance(reply, want), reply
    return reply


def _written(client: SideChannelClient, tokens: int) -> None:
    """Wait until prefill announced ``tokens`` written (as a decode reads only what it was told of)."""
    while _next(client, protocol.Progress).ready_tokens < tokens:
        pass


def _refused(client: SideChannelClient, code: str) -> str:
    reply = _next(client, protocol.Failed)
    assert reply.code == code, reply
    return reply.reason


def _pairs_lent(prefill: Prefill, n: int) -> bool:
    return wait_for(prefill.service.leftovers, lambda h: h["staging_pairs"] == n, 5.0)["staging_pairs"] == n


def test_slots_of_a_stream_are_cut_only_for_its_subscriber_over_what_was_written(small_spec) -> None:
    with rivals(small_spec, streamed=True, slot_bytes=SLOT, pairs=1) as (prefill, owner, other):
        table = [int(p) for p in prefill.table[:4]]
        prefill.service.open_stream("t", 4 * PAGE_TOKENS)
        owner.send(protocol.Subscribe(v=V, request_id="t", num_tokens=4 * PAGE_TOKENS))
        prefill.service.advance_stream("t", prefill.table[:2], 2 * PAGE_TOKENS)
        _written(owner, 2 * PAGE_TOKENS)

        other.send(_read("t", table[:2], 2 * PAGE_TOKENS))  # not its subscription
        assert "holds no subscription to that transfer" in _refused(other, "refused_peer")
        owner.send(_read("t", table[:3], 3 * PAGE_TOKENS))  # a page not written yet
        assert f"tokens up to {3 * PAGE_TOKENS} asked; prefill has written {2 * PAGE_TOKENS}" in _refused(
            owner, "invalid_params"
        )
        owner.send(_read("t", [table[1], table[0]], 2 * PAGE_TOKENS))  # pages other than the rule's
        assert "source pages are not the pages it holds" in _refused(owner, "invalid_params")
        owner.send(_read("t", table[:2], 2 * PAGE_TOKENS, 2 * SLOT))
        assert f"slots of {2 * SLOT} B: this rank's slots hold {SLOT} B" in _refused(owner, "invalid_params")
        assert _pairs_lent(prefill, 0)  # every refusal left nothing open

        owner.send(_read("t", table[:2], 2 * PAGE_TOKENS))
        owner.send(protocol.Gather(v=V, request_id="t", slot=0))
        assert _next(owner, protocol.Gathered).slot == 0
        assert _pairs_lent(prefill, 1)
        other.send(protocol.Gather(v=V, request_id="t", slot=1))  # another decode's read: nothing gathered
        assert "no claimed lease or subscription of this decode" in _refused(other, "lease_expired")
        owner.send(_read("t", table[:2], 2 * PAGE_TOKENS))  # one read of a transfer at a time per decode
        assert "already reads this request staged" in _refused(owner, "invalid_params")
        owner.send(protocol.ReadDone(v=V, request_id="t"))
        assert _pairs_lent(prefill, 0)

        owner.send(_read("t", table[:2], 2 * PAGE_TOKENS))  # the next read after it ended
        owner.send(protocol.Gather(v=V, request_id="t", slot=0))
        assert _next(owner, protocol.Gathered).slot == 0
        prefill.service.end_stream("t", "preempted")  # the transfer ends with the read open: the pair goes back
        assert "preempted" in _refused(owner, "aborted")
        assert _pairs_lent(prefill, 0)
        owner.send(protocol.Gather(v=V, request_id="t", slot=1))
        assert "no claimed lease or subscription" in _refused(owner, "lease_expired")
        assert prefill.service.leftovers()["streams"] == 0


def test_a_decode_forgotten_mid_read_gives_its_pair_back(small_spec) -> None:
    """A subscriber that opened a read and then said hello again (a restart on the same connection): prefill
    forgets what the old one held, as it forgets a silent one, and the pair goes back to others."""
    with rivals(small_spec, streamed=True, slot_bytes=SLOT, pairs=1) as (prefill, owner, _):
        prefill.service.open_stream("t", 2 * PAGE_TOKENS)
        owner.send(protocol.Subscribe(v=V, request_id="t", num_tokens=2 * PAGE_TOKENS))
        prefill.service.advance_stream("t", prefill.table[:2], 2 * PAGE_TOKENS)
        _written(owner, 2 * PAGE_TOKENS)
        owner.send(_read("t", [int(p) for p in prefill.table[:2]], 2 * PAGE_TOKENS))
        owner.send(protocol.Gather(v=V, request_id="t", slot=0))
        assert _next(owner, protocol.Gathered).slot == 0  # the read holds the only pair now
        _, again = endpoint(small_spec, "owner-again", 10.0)
        owner.send(again.hello(again.transport.metadata()))
        assert isinstance(_next(owner, protocol.Hello), protocol.Hello)
        held = wait_for(prefill.service.leftovers, lambda h: h["staging_pairs"] == 0, 30.0)
        assert held["staging_pairs"] == 0, held

"""The side channel's non-blocking drain, which a streamed load uses to read everything already announced as one
batch, the server's wake-up, which lets an engine's call cut the serving thread's wait short, and a wait that
keeps what it read past for another wait on the same link (real ZeroMQ sockets on loopback)."""

from __future__ import annotations

import threading
import time

import pytest

from glm_pd_common.handoff.decode.links import PrefillLink, PrefillLinks
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.sidechannel import (
    SideChannelClient,
    SideChannelServer,
    SideChannelTimeout,
    pending,
    recv_any,
)


def test_pending_returns_every_waiting_message_in_order() -> None:
    server = SideChannelServer("127.0.0.1")
    clients = [SideChannelClient("127.0.0.1", server.port) for _ in range(2)]
    try:
        assert pending(clients) == []
        idents = []
        for n, client in enumerate(clients):
            client.send(protocol.Heartbeat(v=protocol.PROTOCOL_VERSION, engine_id=f"d{n}", seq=0))
            idents.append(server.recv(5.0)[0])
        sent = {0: [1, 2, 3], 1: [4]}
        for i, seqs in sent.items():
            for seq in seqs:
                server.send(idents[i], protocol.Heartbeat(v=protocol.PROTOCOL_VERSION, engine_id="p", seq=seq))
        deadline = time.monotonic() + 5.0
        got: list[tuple[int, int]] = []
        while len(got) < 4 and time.monotonic() < deadline:
            got += [(i, msg.seq) for i, msg in pending(clients)]  # type: ignore[union-attr]
        assert sorted(got) == [(0, 1), (0, 2), (0, 3), (1, 4)]
        assert [seq for i, seq in got if i == 0] == [1, 2, 3], got
        assert pending(clients) == []  # all drained; nothing left to wait for
    finally:
        for client in clients:
            client.close()
        server.close()


def test_a_wake_from_another_thread_ends_the_servers_wait_and_messages_still_arrive() -> None:
    server = SideChannelServer("127.0.0.1")
    client = SideChannelClient("127.0.0.1", server.port)
    waited: list[float] = []

    def wait_long() -> None:
        t0 = time.monotonic()
        with pytest.raises(SideChannelTimeout):
            server.recv(60.0)
        waited.append(time.monotonic() - t0)

    try:
        thread = threading.Thread(target=wait_long)
        thread.start()
        time.sleep(0.2)  # the thread is inside its wait
        server.wake()
        thread.join(timeout=30)
        assert waited and waited[0] < 30, "the wait ran on past the wake"
        server.wake()
        server.wake()  # wakes before a wait: the next wait ends at once, once, for all of them
        t0 = time.monotonic()
        with pytest.raises(SideChannelTimeout):
            server.recv(60.0)
        assert time.monotonic() - t0 < 30, "a wake that came before the wait did not end it"
        with pytest.raises(SideChannelTimeout):
            server.recv(0.05)  # that wake is spent: this wait runs to its timeout
        client.send(protocol.Heartbeat(v=protocol.PROTOCOL_VERSION, engine_id="d", seq=7))
        _, msg = server.recv(10.0)
        assert isinstance(msg, protocol.Heartbeat) and msg.seq == 7
    finally:
        client.close()
        server.close()
    server.wake()  # an engine call after close is a no-op, never a write to a released fd


def test_a_wait_for_one_answer_keeps_what_other_waits_on_the_link_expect() -> None:
    """A staged streamed read waits for its slot's ``Gathered`` while the same transfer's ``Progress`` and its
    lease's ``Claimed`` arrive: both come back to the next receive, in arrival order; an answer to nobody is
    dropped."""
    server = SideChannelServer("127.0.0.1")
    client = SideChannelClient("127.0.0.1", server.port)
    v = protocol.PROTOCOL_VERSION
    try:
        client.send(protocol.Heartbeat(v=v, engine_id="d", seq=0))
        ident = server.recv(5.0)[0]
        progress = protocol.Progress(v=v, request_id="t", num_tokens=9, ready_tokens=4, first_page=0, pages=[3])
        claimed = protocol.Claimed(v=v, request_id="t#0")
        for msg in (
            progress,
            protocol.Released(v=v, request_id="stale"),  # a late answer to an earlier request
            claimed,
            protocol.Gathered(v=v, request_id="t", slot=0, offset=0),
        ):
            server.send(ident, msg)
        links = PrefillLinks(None, 5.0, lambda: None)  # type: ignore[arg-type]  # ask needs no endpoint
        link = PrefillLink(client, None, "", "")  # type: ignore[arg-type]
        gather = protocol.Gather(v=v, request_id="t", slot=0)
        got = links.ask(link, gather, "t", (protocol.Gathered,), send=False, keep=frozenset({"t#0"}))
        assert got == protocol.Gathered(v=v, request_id="t", slot=0, offset=0)
        assert recv_any([client], 5.0, lambda: None) == (0, progress)
        assert client.recv(5.0) == claimed
        assert pending([client]) == []
    finally:
        client.close()
        server.close()

"""The side channel's non-blocking drain, which a streamed load uses to read everything already announced as one
batch (real ZeroMQ sockets on loopback)."""

from __future__ import annotations

import time

from glm_pd_common.handoff import protocol
from glm_pd_common.handoff.sidechannel import SideChannelClient, SideChannelServer, pending


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

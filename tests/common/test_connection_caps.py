"""A prefill side channel holds at most its cap of connections: peers that connect and never say hello, credential
holders included, cannot use up its file descriptors and lock decodes out for good.

A real PrefillService and DecodeService over NIXL on loopback, authenticated with a deployment key; the idle peers
are raw ZeroMQ sockets holding the key that complete the handshake and send nothing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.prefill.caps import PeerCaps
from glm_pd_common.handoff.wire.sidechannel import SideChannelServer
from glm_pd_common.handoff.wire.trust import Trust, load_credential, make_credential
from tests.support.services import PAGE_TOKENS, Decode, Prefill, wait_for
from tests.support.strangers import curve, handshake

CAP = 3


@pytest.fixture
def deployment(tmp_path: Path) -> Trust:
    return Trust(load_credential(str(make_credential(tmp_path / "keys", "deployment"))))


class IdlePeers:
    """Connections of the deployment that complete the handshake and then say nothing (ZeroMQ answers the
    server's pings, so heartbeats keep them)."""

    def __init__(self, trust: Trust, port: int) -> None:
        self._trust, self._port = trust, port
        self._ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []

    def open(self) -> None:
        """One more connection, returned once its handshake succeeded (the server counted it before)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._trust.dial(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(f"tcp://127.0.0.1:{self._port}")
        assert monitor.poll(10_000), "an idle peer's handshake did not succeed"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        sock.disable_monitor()
        monitor.close(0)
        self.socks.append(sock)

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self._ctx.term()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _glm_pd_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("glm-pd"))


def test_idle_connections_fill_the_cap_and_a_decode_loads_again_once_they_leave(
    small_spec, deployment: Trust, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``CAP`` idle authenticated connections held, a decode's handshake is refused (prefill says why, the
    decode's load fails as a refused peer); once they close, the count returns to nothing and the same decode
    loads. The descriptors the connections held, and the services' threads, return with them."""
    threads = _glm_pd_threads()
    prefill = Prefill(small_spec, trust=deployment, caps=PeerCaps(connections=CAP))
    decode = Decode(small_spec, trust=deployment, timeout_s=5.0)
    idle = IdlePeers(deployment, prefill.service.port)
    try:
        fds = _open_fds()
        for _ in range(CAP):
            idle.open()
        assert prefill.service.server.connections() == CAP
        refused = decode.load(prefill, "crowded", 2 * PAGE_TOKENS)
        assert not refused.ok and refused.code == "refused_peer", (refused.code, refused.reason)
        assert "connections it allows" in refused.reason, refused.reason
        assert any(f"its cap of {CAP} connections" in r.getMessage() for r in caplog.records)
        assert prefill.service.leftovers()["decode_peers"] == 0  # nobody was admitted past the cap
        idle.close()
        left = wait_for(prefill.service.server.connections, lambda n: n == 0, 30.0)
        assert left == 0, f"{left} connection(s) still counted after every idle peer closed"
        # ZeroMQ reports a disconnection just before it closes the descriptor
        held = wait_for(_open_fds, lambda n: n <= fds, 10.0)
        assert held <= fds, f"{held - fds} descriptor(s) still open after every idle peer closed"
        result = decode.load(prefill, "after", 2 * PAGE_TOKENS)
        assert result.ok, result.reason
    finally:
        decode.close()
        prefill.close()
    assert _glm_pd_threads() == threads


def test_connections_that_come_and_go_are_not_counted(deployment: Trust) -> None:
    """Peers that connect, complete the handshake and leave, over and over, leave the count at nothing: a cap
    of one still admits the next peer."""
    server = SideChannelServer("127.0.0.1", trust=deployment, max_connections=1)
    assert deployment.credential is not None
    key = deployment.credential
    try:
        for _ in range(8):
            assert handshake("127.0.0.1", server.port, curve(key.public, key.public, key.secret), wait_s=10.0) == (
                "succeeded"
            )
        left = wait_for(server.connections, lambda n: n == 0, 30.0)
        assert left == 0, f"{left} connection(s) still counted after 8 came and went"
        idle = IdlePeers(deployment, server.port)
        try:
            idle.open()
            assert server.connections() == 1
            assert handshake("127.0.0.1", server.port, curve(key.public, key.public, key.secret)) == "refused"
        finally:
            idle.close()
    finally:
        server.close()


def test_an_open_side_channel_counts_nothing() -> None:
    """Without a credential no authenticator runs to refuse a handshake with, so nothing is counted (see
    ``wire.trust``)."""
    server = SideChannelServer("127.0.0.1", max_connections=1)
    try:
        assert server.connections() is None
    finally:
        server.close()


def test_the_cap_on_connections_is_a_positive_integer() -> None:
    assert PeerCaps.from_settings({"connections": 8}, "caps").connections == 8
    with pytest.raises(ConfigError, match="cap on connections must be an integer of at least 1"):
        PeerCaps(connections=0)


def test_a_server_whose_port_is_taken_leaves_no_thread_behind(deployment: Trust) -> None:
    first = SideChannelServer("127.0.0.1", trust=deployment)
    threads = _glm_pd_threads()
    try:
        with pytest.raises(zmq.ZMQError, match="in use"):
            SideChannelServer("127.0.0.1", first.port, trust=deployment)
        assert _glm_pd_threads() == threads
    finally:
        first.close()

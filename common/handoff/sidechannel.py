"""The side channel between peers: protocol messages over ZeroMQ, bounded waits, bound to one address.

Prefill serves (ROUTER), decode connects (DEALER). Every receive has a timeout, every message is decoded
by ``protocol.decode`` (size cap, version, shape) before anyone acts on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from glm_pd_common.errors import GlmPdError, ProtocolError
from glm_pd_common.handoff import protocol


class SideChannelTimeout(GlmPdError):
    """No message arrived in time: the peer is gone, hung or unreachable."""


class SideChannelServer:
    def __init__(self, host: str, port: int = 0) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 2000)  # let the last answer (released / failed) reach the peer
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host = host

    def recv(self, timeout_s: float) -> tuple[bytes, protocol.Message]:
        """(peer identity, message); malformed messages raise ProtocolError with the identity attached."""
        if not self._sock.poll(int(timeout_s * 1000)):
            raise SideChannelTimeout(f"no message on {self.host}:{self.port} within {timeout_s:.1f} s")
        frames = self._sock.recv_multipart()
        if len(frames) != 2:
            raise ProtocolError(f"side channel frame count {len(frames)}, expected 2")
        return frames[0], protocol.decode(frames[1])

    def send(self, identity: bytes, message: protocol.Message) -> None:
        self._sock.send_multipart([identity, protocol.encode(message)])

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


class SideChannelClient:
    def __init__(self, host: str, port: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self._sock.connect(f"tcp://{host}:{port}")
        self.address = f"{host}:{port}"

    def send(self, message: protocol.Message) -> None:
        self._sock.send(protocol.encode(message))

    def recv(self, timeout_s: float, progress: Callable[[], object] | None = None) -> protocol.Message:
        """Wait for the peer's answer. ``progress`` runs every few ms meanwhile: the peer's answer may need
        this side's transport to make progress first (NIXL/UCX connection set-up is two-sided)."""
        deadline = time.monotonic() + timeout_s
        while not self._sock.poll(2 if progress else int(timeout_s * 1000)):
            if progress is None or time.monotonic() > deadline:
                raise SideChannelTimeout(f"no answer from {self.address} within {timeout_s:.1f} s")
            progress()
        return protocol.decode(self._sock.recv())

    def waiting(self) -> list[protocol.Message]:
        """Every message that has already arrived, in order; never waits."""
        out = []
        while self._sock.poll(0):
            out.append(protocol.decode(self._sock.recv()))
        return out

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


def recv_any(
    clients: list[SideChannelClient], timeout_s: float, progress: Callable[[], object]
) -> tuple[int, protocol.Message]:
    """The next message from any of ``clients`` (its index, the message); ``progress`` runs every few ms."""
    poller = zmq.Poller()
    for client in clients:
        poller.register(client._sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        ready = dict(poller.poll(2))
        for i, client in enumerate(clients):
            if client._sock in ready:
                return i, protocol.decode(client._sock.recv())
        if time.monotonic() > deadline:
            raise SideChannelTimeout(f"no message from {[c.address for c in clients]} within {timeout_s:.1f} s")
        progress()


def pending(clients: list[SideChannelClient]) -> list[tuple[int, protocol.Message]]:
    """Every message already waiting on ``clients`` (index, message), in arrival order per client; never waits."""
    return [(i, msg) for i, client in enumerate(clients) for msg in client.waiting()]

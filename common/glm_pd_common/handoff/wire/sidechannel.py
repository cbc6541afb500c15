"""The side channel between peers: protocol messages over ZeroMQ, bounded waits, bound to one address.

Prefill serves (ROUTER), decode connects (DEALER), both authenticated as ``trust`` says (CURVE with the
deployment's key; none on loopback or where the operator chose ``insecure``). Every receive has a timeout,
every message is decoded by ``protocol.decode`` (size cap, version, shape) before anyone acts on it, and a
client learns at once that the server failed the handshake (it is not the deployment's, or refused us).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import zmq
from zmq.utils.monitor import recv_monitor_message

from glm_pd_common.errors import AuthenticationFailed, GlmPdError, ProtocolError
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.trust import MAX_CONNECTIONS, OPEN, Trust


class SideChannelTimeout(GlmPdError):
    """No message arrived in time: the peer is gone, hung or unreachable."""


class SideChannelServer:
    """The serving socket, and a wake-up the serving thread waits on beside it: another thread that hands the
    server's thread work (an engine's grant) calls ``wake`` so that work is picked up now, not when the wait
    for peers' messages times out. With a credential it admits handshakes while it holds at most
    ``max_connections`` connections."""

    def __init__(self, host: str, port: int = 0, trust: Trust = OPEN, max_connections: int = MAX_CONNECTIONS) -> None:
        trust.check_host(host, "side channel host")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 2000)  # let the last answer (released / failed) reach the peer
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self._gate = trust.serve(self._ctx, self._sock, max_connections, host)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self._sock.close(0)  # the port is taken: no thread of this server outlives the error
            self._gate.close()
            self._ctx.term()
            raise
        self.host = host
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()  # a wake never writes to the fd number after close released it
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_fd, zmq.POLLIN)

    def recv(self, timeout_s: float) -> tuple[bytes, protocol.Message]:
        """(peer identity, message); malformed messages raise ProtocolError with the identity attached. A
        ``wake`` ends the wait early, as a timeout does: no message came."""
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._wake_fd in ready:
            os.eventfd_read(self._wake_fd)  # resets the count: one look at the queues covers every wake so far
        if self._sock not in ready:
            raise SideChannelTimeout(f"no message on {self.host}:{self.port} within {timeout_s:.1f} s")
        frames = self._sock.recv_multipart()
        if len(frames) != 2:
            raise ProtocolError(f"side channel frame count {len(frames)}, expected 2")
        return frames[0], protocol.decode(frames[1])

    def send(self, identity: bytes, message: protocol.Message) -> None:
        self._sock.send_multipart([identity, protocol.encode(message)])

    def wake(self) -> None:
        """Cut the serving thread's current (or next) wait short; thread-safe, never blocks, a no-op once closed."""
        with self._wake_lock:
            if self._wake_fd >= 0:
                os.eventfd_write(self._wake_fd, 1)

    def connections(self) -> int | None:
        """The connections this server holds now, handshaking or not (None: not counted without a credential)."""
        return None if self._gate.connections is None else len(self._gate.connections)

    def close(self) -> None:
        self._sock.close(0)
        self._gate.close()
        self._ctx.term()
        with self._wake_lock:
            os.close(self._wake_fd)
            self._wake_fd = -1


# What a client's monitor reports when the server it dialled refused our handshake: final, raised at once.
_HANDSHAKE_REFUSED = {
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): (
        "refused this side's handshake (not holding the deployment's credential, or holding all the connections it "
        "allows)"
    ),
    int(
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    ): "does not speak this side's security mechanism (one side has no credential)",
}
# A handshake cut short: a server without the deployment's secret key cannot answer, but a reset connection
# looks the same, and ZeroMQ retries; it is named if the wait then times out.
_HANDSHAKE_CUT = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class SideChannelClient:
    def __init__(self, host: str, port: int, trust: Trust = OPEN) -> None:
        trust.check_host(host, "peer")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        trust.dial(self._sock)
        self._monitor = self._sock.get_monitor_socket(sum(_HANDSHAKE_REFUSED) + _HANDSHAKE_CUT)
        self._cut = False  # a handshake with the server was cut short (named if the wait times out)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(f"tcp://{host}:{port}")
        self.address = f"{host}:{port}"
        # Messages a wait for one answer read past that belong to another wait on this link (a streamed
        # transfer's progress read while a slot's answer was awaited): the next receive returns them first.
        self._kept: deque[protocol.Message] = deque()

    def send(self, message: protocol.Message) -> None:
        self._sock.send(protocol.encode(message))

    def _ready(self, wait_ms: int) -> bool:
        """Whether an answer waits, after up to ``wait_ms``; a failed handshake raises at once."""
        ready = dict(self._poller.poll(wait_ms))
        if self._monitor in ready:
            self._check_handshake()
        return self._sock in ready

    def _check_handshake(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event in _HANDSHAKE_REFUSED:
                raise AuthenticationFailed(f"peer {self.address} {_HANDSHAKE_REFUSED[event]}: nothing was sent to it")
            self._cut = True

    def _timeout(self, timeout_s: float) -> SideChannelTimeout:
        if self._cut:
            return SideChannelTimeout(
                f"no answer from {self.address} within {timeout_s:.1f} s: its handshakes were cut short (a peer "
                f"without the deployment's credential cannot complete one)"
            )
        return SideChannelTimeout(f"no answer from {self.address} within {timeout_s:.1f} s")

    def put_back(self, messages: Iterable[protocol.Message]) -> None:
        """Return messages already received, in their order, ahead of any not yet read."""
        self._kept.extendleft(reversed(list(messages)))

    def recv(self, timeout_s: float, progress: Callable[[], object] | None = None) -> protocol.Message:
        """Wait for the peer's answer (one put back first). ``progress`` runs every few ms meanwhile: the
        peer's answer may need this side's transport to make progress first (NIXL/UCX connection set-up is
        two-sided)."""
        if self._kept:
            return self._kept.popleft()
        deadline = time.monotonic() + timeout_s
        while not self._ready(2 if progress else max(int((deadline - time.monotonic()) * 1000), 0)):
            if time.monotonic() > deadline:
                raise self._timeout(timeout_s)
            if progress is not None:
                progress()
        return protocol.decode(self._sock.recv())

    def waiting(self) -> list[protocol.Message]:
        """Every message that has already arrived (those put back first), in order; never waits."""
        out = list(self._kept)
        self._kept.clear()
        while self._ready(0):
            out.append(protocol.decode(self._sock.recv()))
        return out

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()


def recv_any(
    clients: list[SideChannelClient], timeout_s: float, progress: Callable[[], object]
) -> tuple[int, protocol.Message]:
    """The next message from any of ``clients`` (its index, the message; one put back first); ``progress``
    runs every few ms."""
    for i, client in enumerate(clients):
        if client._kept:
            return i, client._kept.popleft()
    poller = zmq.Poller()
    for client in clients:
        poller.register(client._sock, zmq.POLLIN)
        poller.register(client._monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        ready = dict(poller.poll(2))
        for i, client in enumerate(clients):
            if client._monitor in ready:
                client._check_handshake()
            if client._sock in ready:
                return i, protocol.decode(client._sock.recv())
        if time.monotonic() > deadline:
            raise SideChannelTimeout(f"no message from {[c.address for c in clients]} within {timeout_s:.1f} s")
        progress()


def pending(clients: list[SideChannelClient]) -> list[tuple[int, protocol.Message]]:
    """Every message already waiting on ``clients`` (index, message), in arrival order per client; never waits."""
    return [(i, msg) for i, client in enumerate(clients) for msg in client.waiting()]

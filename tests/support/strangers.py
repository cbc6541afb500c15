"""A stranger's knock on a ZeroMQ port: how its handshake ends, seen from its own socket's monitor."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION

OUTCOMES = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "cut short",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
}


def curve(server_key: bytes, public: bytes, secret: bytes) -> dict[int, bytes]:
    """A CURVE client's options: the server key it expects, and the key pair it presents."""
    return {zmq.CURVE_SERVERKEY: server_key, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}


def handshake(host: str, port: int, options: dict[int, bytes], kind: int = zmq.DEALER, wait_s: float = 5.0) -> str:
    """How a client with ``options`` (none: no security) fares at ``host:port`` within ``wait_s``: one of
    ``OUTCOMES``' values, or "nothing". It sends a query; a DEALER must get no answer back."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in options.items():
        sock.setsockopt(option, value)
    monitor = sock.get_monitor_socket()
    sock.connect(f"tcp://{host}:{port}")
    try:
        sock.send(protocol.encode(protocol.Query(v=PROTOCOL_VERSION, engine_id="stranger")), zmq.NOBLOCK)
    except zmq.Again:
        pass  # the handshake already failed: ZeroMQ dropped the connection's queue, and a send would wait forever
    outcome = "nothing"
    deadline = time.monotonic() + wait_s
    while outcome == "nothing" and monitor.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
        outcome = OUTCOMES.get(recv_monitor_message(monitor)["event"], "nothing")
    answered = kind == zmq.DEALER and sock.poll(500)
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)
    ctx.term()
    assert not answered, "the stranger got an answer"
    return outcome

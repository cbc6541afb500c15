"""Who may speak on a glm-pd side channel: the deployment credential, and where running without one is allowed.

A deployment (every prefill and decode that hand off to each other) shares one CURVE key pair. Each side
channel server proves it holds the secret key (CurveZMQ: a client only completes the handshake with the server
whose public key it expects) and admits, through ZeroMQ's ZAP, only clients presenting the same public key,
which they can only do holding its secret. Nothing, not even a refusal, is exchanged before that: an unknown
peer's connection is closed by ZeroMQ during the handshake. An HTTP service of the deployment (SGLang's
bootstrap server) asks instead for a bearer token derived from the secret key. Without a credential the side
channel is open to whoever can reach it, so that is allowed on loopback, or where the operator said ``insecure``.

What a connection may hold: one that has not completed its handshake within HANDSHAKE_S is closed, one whose peer
stops answering ZMTP pings is closed, and a server admits a handshake only while it holds at most its cap of
connections (``LiveConnections``), so nobody, a credential holder included, can use up the process's file
descriptors. An idle authenticated peer that answers pings keeps its connection (a descriptor and about 40 KB)
until it leaves: ZeroMQ cannot close one peer of a socket, and the cap bounds what all of them hold. Without a
credential there is no cap: pyzmq's authenticator admits an unauthenticated handshake without asking a callback,
ZeroMQ has no other way to refuse or close one connection, and whoever reaches an open side channel can read and
write the KV cache anyway.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import select
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from glm_pd_common.counted_log import CountedLog
from glm_pd_common.errors import ConfigError

logger = logging.getLogger(__name__)

ENV_SOURCE = "env:"  # a credential source "env:NAME": the variable NAME holds the secret key (Z85, 40 characters)
ZAP_DOMAIN = "glm-pd"
HANDSHAKE_S = 5.0  # a connection that has not completed its handshake by then is closed (ZeroMQ's default: 30 s)
HEARTBEAT_S = 5.0  # ZMTP pings on an idle connection; one silent for 3 intervals is closed
MAX_CONNECTIONS = 4096  # a server's live connections, handshaking or not (4 per decode rank prefill serves by default)
BEARER_LABEL = b"glm-pd bootstrap v1"  # what the bearer token is derived for; a new label makes a new token


@dataclass(frozen=True)
class Credential:
    """A deployment's CURVE key pair (Z85 text); the secret never appears in a repr or a log."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes, source: str) -> Credential:
        try:
            return cls(zmq.curve_public(secret), secret)
        except (zmq.ZMQError, ValueError) as exc:
            raise ConfigError(f"credential {source}: not a CURVE secret key (40 Z85 characters): {exc}") from None


def load_credential(source: str) -> Credential:
    """The credential named by ``source``: ``env:NAME`` (that variable holds the secret key), else a key file
    as ``glm-pd keygen`` writes (ZeroMQ's certificate format, holding both keys)."""
    if source.startswith(ENV_SOURCE):
        name = source[len(ENV_SOURCE) :]
        value = os.environ.get(name, "").strip()
        if not value:
            raise ConfigError(f"credential {source}: the environment variable {name} is not set")
        return Credential.from_secret(value.encode(), source)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(f"credential {source}: no such file (make one with `glm-pd keygen`)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"credential {source}: not a key file: {exc}") from None
    if not secret:
        raise ConfigError(f"credential {source} holds a public key only: use the *.key_secret file")
    credential = Credential.from_secret(secret, source)
    if credential.public != public:
        raise ConfigError(f"credential {source}: its public key does not belong to its secret key")
    return credential


def make_credential(directory: Path, name: str) -> Path:
    """Write a new deployment key pair under ``directory``; the file to hand every peer (readable by its owner
    only) is returned."""
    directory.mkdir(parents=True, exist_ok=True)
    secret_file = Path(directory) / f"{name}.key_secret"
    if secret_file.exists():
        raise ConfigError(f"{secret_file} exists; a deployment's key is replaced on purpose, not by accident")
    _, written = zmq.auth.create_certificates(str(directory), name)
    os.chmod(written, 0o600)
    return Path(written)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


@dataclass(frozen=True)
class Trust:
    """How this process's side channels authenticate: with ``credential``, or (on loopback, or where the
    operator set ``insecure``) not at all."""

    credential: Credential | None = None
    insecure: bool = False

    @classmethod
    def from_settings(cls, credential: str, insecure: bool) -> Trust:
        return cls(load_credential(credential) if credential else None, insecure)

    @property
    def authenticated(self) -> bool:
        return self.credential is not None

    def bearer_token(self) -> str | None:
        """The token this deployment's HTTP services ask of their clients (None without a credential): BLAKE2b
        keyed with the secret key over a fixed label, so only holders can make it and it does not reveal the key."""
        if self.credential is None:
            return None
        return hashlib.blake2b(BEARER_LABEL, key=self.credential.secret).hexdigest()

    def admits_bearer(self, presented: str) -> bool:
        """Whether ``presented`` is this deployment's bearer token, compared in constant time (anything is,
        without a credential)."""
        token = self.bearer_token()
        return token is None or hmac.compare_digest(presented.encode("utf-8", "replace"), token.encode())

    def check_host(self, host: str, role: str) -> None:
        """Refuse to bind (or dial) ``host`` unauthenticated unless it is loopback or the operator said so."""
        if self.credential is None and not self.insecure and not is_loopback(host):
            raise ConfigError(
                f"{role} {host} is not a loopback address and no credential is set: anyone who can reach it could "
                f"read and write this engine's KV cache. Make a key with `glm-pd keygen DIR`, give every prefill and "
                f"decode its *.key_secret file as `credential`, or set `insecure` to run unauthenticated"
            )

    def server_options(self) -> dict[int, int | bytes]:
        """The socket options of a CURVE server admitting this deployment's key through ZAP (none without one);
        the context also needs the ``authenticator``."""
        if self.credential is None:
            return {}
        return {
            zmq.CURVE_SECRETKEY: self.credential.secret,
            zmq.CURVE_PUBLICKEY: self.credential.public,
            zmq.CURVE_SERVER: 1,
            zmq.ZAP_DOMAIN: ZAP_DOMAIN.encode(),
        }

    def client_options(self) -> dict[int, int | bytes]:
        """The socket options of a CURVE client that only completes a handshake with this deployment's server."""
        if self.credential is None:
            return {}
        return {
            zmq.CURVE_SERVERKEY: self.credential.public,
            zmq.CURVE_PUBLICKEY: self.credential.public,
            zmq.CURVE_SECRETKEY: self.credential.secret,
        }

    def authenticator(
        self, context: zmq.Context, connections: LiveConnections | None = None
    ) -> ThreadAuthenticator | None:
        """ZAP for ``context``'s CURVE servers, admitting only this deployment's key, and (given ``connections``)
        only while that server holds at most its cap; runs until stopped (stop it before terminating ``context``)."""
        if self.credential is None:
            return None
        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, _DeploymentKey(self.credential.public, connections))
        return auth

    def serve(self, context: zmq.Context, sock: zmq.Socket, max_connections: int, name: str) -> Gate:
        """Make ``sock`` (not bound yet, the only server of ``context``) a server admitting only this deployment,
        while it holds at most ``max_connections``; ``name`` names its counting thread."""
        _keep_alive(sock)
        for option, value in self.server_options().items():
            sock.setsockopt(option, value)
        return self.guard(context, sock, max_connections, name)

    def guard(self, context: zmq.Context, sock: zmq.Socket, max_connections: int, name: str) -> Gate:
        """The authenticator and connection count of ``sock``, a server made with ``server_options`` (by
        ``serve``, or by an engine's own function); it must not be known to any peer yet."""
        connections = LiveConnections(sock, max_connections, name) if self.credential is not None else None
        return Gate(self.authenticator(context, connections), connections)

    def dial(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not connected yet) a client of this deployment's servers only."""
        _keep_alive(sock)
        for option, value in self.client_options().items():
            sock.setsockopt(option, value)


OPEN = Trust()  # no credential: loopback only (the tests' and a single host's default)


# A connection must finish its handshake within HANDSHAKE_S, and one whose peer stops answering pings is closed:
# neither a silent stranger nor a vanished peer holds a connection.
KEEP_ALIVE: dict[int, int] = {
    zmq.HANDSHAKE_IVL: int(HANDSHAKE_S * 1000),
    zmq.HEARTBEAT_IVL: int(HEARTBEAT_S * 1000),
    zmq.HEARTBEAT_TIMEOUT: int(3 * HEARTBEAT_S * 1000),
}


def _keep_alive(sock: zmq.Socket) -> None:
    for option, value in KEEP_ALIVE.items():
        sock.setsockopt(option, value)


class LiveConnections:
    """The connections a server socket holds now (handshaking or not), from its monitor's events, for ZAP to refuse
    handshakes past ``cap``.

    The count is the set of the descriptors ZeroMQ reported accepted and not yet disconnected or closed. A
    reconnecting peer's new connection has a descriptor of its own while the old one is open, and ZeroMQ reports
    a disconnection before it closes the descriptor, so a number the kernel hands out again is reported accepted
    only after it left the set; a connection closed without a report would leave its number until the kernel
    hands it out again, counting one too many, never one too few. A thread reads the events as they come (ZeroMQ's
    I/O thread blocks once a monitor's queue is full), and ``full`` reads whatever is queued first, under the same
    lock: the asking connection's acceptance was reported before its handshake began, so it is always counted.
    """

    def __init__(self, sock: zmq.Socket, cap: int, name: str) -> None:
        self.cap = cap
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self._live: set[int] = set()
        self._lock = threading.Lock()  # the monitor socket is read by this thread and by ZAP's, one at a time
        self._stop_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name=f"glm-pd-connections-{name}", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            self._read()
            return len(self._live)

    def full(self) -> bool:
        """Whether more than ``cap`` connections are live, the one asking included."""
        return len(self) > self.cap

    def close(self) -> None:
        """Stop counting, once ``sock`` has closed (ZeroMQ ends its monitor with it) and nothing asks ``full``."""
        os.eventfd_write(self._stop_fd, 1)
        self._thread.join()
        os.close(self._stop_fd)
        self._monitor.close(0)

    def _read(self) -> None:
        """Apply every event queued (the lock held); ``poll`` reads ZMQ_EVENTS, which rearms the descriptor the
        thread waits on."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._live.add(int(event["value"]))
            else:
                self._live.discard(int(event["value"]))

    def _run(self) -> None:
        waiter = select.poll()
        waiter.register(self._monitor.fileno(), select.POLLIN)
        waiter.register(self._stop_fd, select.POLLIN)
        while not any(fd == self._stop_fd for fd, _ in waiter.poll()):
            with self._lock:
                self._read()


@dataclass(frozen=True)
class Gate:
    """What guards a server socket: its authenticator and the count of its connections (neither without a
    credential)."""

    auth: ThreadAuthenticator | None
    connections: LiveConnections | None

    def close(self) -> None:
        """After the socket closed: ZeroMQ completes a CURVE handshake unchecked while no authenticator runs."""
        if self.auth is not None:
            self.auth.stop()  # joins its thread: nothing asks the count after this
        if self.connections is not None:
            self.connections.close()


class _DeploymentKey:
    """ZAP's CURVE check (pyzmq's credentials provider): the client's public key must be the deployment's, and the
    server (given its ``connections``) must hold at most its cap. Denials are logged once a second with their
    count: a stranger knocking cannot flood the log."""

    def __init__(self, public: bytes, connections: LiveConnections | None) -> None:
        self._public = public
        self._connections = connections
        self.denied = CountedLog(logger, "glm-pd side channel: refused %d handshake(s) without this deployment's key%s")
        self.crowded = CountedLog(logger, "glm-pd side channel: refused %d handshake(s) of the deployment: %s")

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key != self._public:
            self.denied.note()
            return False
        if self._connections is not None and self._connections.full():
            self.crowded.note(f"the server holds its cap of {self._connections.cap} connections (caps.connections)")
            return False
        return True

"""Decode's connections to prefill ranks: handshake, discovery of a streamed prefill's shape, asking and waiting.

One ``PrefillLink`` per (prefill engine, rank): a side-channel client, the validated hello and the transport
agent loaded from it. A link's client is touched only by the decode lane of its engine (``engine``); the table
itself is shared, and ``forget`` drops every rank of an engine (other lanes may add theirs meanwhile).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from glm_pd_common.errors import ConfigError, LayoutMismatch, ProtocolError
from glm_pd_common.handoff.decode.loads import Refused, RemotePrefill
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import Endpoint, PeerView, accept_hello, hello_proof
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient


@dataclass
class PrefillLink:
    client: SideChannelClient
    view: PeerView
    agent: str
    engine: str  # the prefill engine's address: its lane is the only thread touching ``client``


class PrefillLinks:
    """The links a decode rank holds; ``progress`` runs while a wait blocks (the transport's progress)."""

    def __init__(self, local: Endpoint, timeout_s: float, progress: Callable[[], None]) -> None:
        self.local = local
        self.timeout_s = timeout_s
        self._progress = progress
        self._links: dict[tuple[str, int], PrefillLink] = {}
        self._discovered: dict[tuple[str, int], RemotePrefill] = {}  # streamed params' host:port -> prefill
        self._lock = threading.Lock()  # ``_discovered``: any lane may learn or forget a prefill
        self._session = secrets.token_bytes(32)  # this process's: proves a new connection is still us (``proof``)

    def __len__(self) -> int:
        return len(self._links)

    def all(self) -> list[PrefillLink]:
        return list(self._links.values())

    def connected(self, remote: RemotePrefill, rank: int) -> PrefillLink | None:
        """The link to ``rank`` of ``remote`` if it is up; never handshakes."""
        return self._links.get((remote.engine_id, rank))

    def get(self, remote: RemotePrefill, rank: int, progress: Callable[[], None] | None = None) -> PrefillLink:
        """The link to ``rank`` of ``remote``, handshaking first when there is none (a refused hello names why).
        ``progress`` runs while the handshake waits in place of the transport's (a cancellable load's raises)."""
        key = (remote.engine_id, rank)
        if key in self._links:
            return self._links[key]
        client = SideChannelClient(remote.host_of(rank), remote.base_port + rank, self.local.trust)
        try:
            client.send(self.local.hello(self.local.transport.metadata(), self.proof(remote.engine_id, rank)))
            reply = client.recv(self.timeout_s, progress=progress or self._progress)
            if isinstance(reply, protocol.Failed):
                raise Refused(
                    f"prefill {remote.engine_id} rank {rank} refused the handshake: {reply.reason}", reply.code
                )
            if not isinstance(reply, protocol.Hello):
                raise ProtocolError(f"prefill {remote.engine_id} rank {rank} answered {type(reply).__name__}")
            try:
                view = accept_hello(
                    self.local.spec, reply, backend=self.local.transport.backend, role="prefill", local_role="decode"
                )
            except (LayoutMismatch, ProtocolError, ConfigError) as exc:  # its hello, not the request, is wrong
                raise Refused(str(exc), "refused_peer") from exc
            if view.engine_id != remote.engine_id or view.shape.tp_rank != rank:
                raise ProtocolError(
                    f"{client.address} is {view.engine_id} rank "
                    f"{view.shape.tp_rank}, not {remote.engine_id} rank {rank}"
                )
            agent = self.local.transport.add_peer(view.agent_metadata, view.spans)
        except Exception:
            client.close()
            raise
        self._links[key] = PrefillLink(client, view, agent, remote.address)
        return self._links[key]

    def proof(self, engine_id: str, rank: int) -> bytes:
        """What our hellos to that prefill rank carry (``hello_proof``)."""
        return hello_proof(self._session, f"{engine_id}/{rank}")

    def known(self, remote: RemotePrefill, progress: Callable[[], None] | None = None) -> RemotePrefill:
        """A streamed request's params name prefill's host and port only: rank 0's hello says the rest. ``progress``
        runs while the query waits (as in ``get``)."""
        if remote.tp_size:
            return remote
        key = (remote.host, remote.base_port)
        with self._lock:
            known = self._discovered.get(key)
        if known is not None:
            return known
        client = SideChannelClient(remote.host, remote.base_port, self.local.trust)
        try:
            client.send(protocol.Query(v=PROTOCOL_VERSION, engine_id=self.local.engine_id))
            reply = client.recv(self.timeout_s, progress=progress)
        finally:
            client.close()
        if isinstance(reply, protocol.Failed):
            raise Refused(f"prefill at {client.address} refused: {reply.reason}", reply.code)
        if not isinstance(reply, protocol.Hello) or reply.shape.tp_rank != 0:
            raise ProtocolError(f"{client.address} is not a prefill's rank 0 (it answered {type(reply).__name__})")
        known = RemotePrefill(reply.engine_id, remote.host, remote.base_port, reply.shape.tp_size, reply.shape.sharding)
        with self._lock:
            self._discovered[key] = known
        return known

    def forget(self, remote: RemotePrefill) -> None:
        """Drop every link to ``remote`` and what was learnt of it: it may have restarted under another id or shape."""
        with self._lock:
            for key in [k for k, v in self._discovered.items() if v.engine_id == remote.engine_id]:
                del self._discovered[key]
        for key in [k for k in list(self._links) if k[0] == remote.engine_id]:  # other lanes add theirs
            link = self._links.pop(key)
            link.client.close()
            self.local.transport.remove_peer(link.agent)

    def ask(
        self,
        link: PrefillLink,
        msg: protocol.Message,
        request_id: str,
        want: tuple[type, ...],
        *,
        send: bool = True,
        keep: frozenset[str] = frozenset(),
    ) -> Any:
        """Send (unless sent already) and wait for this request's answer; a ``Failed`` one raises ``Refused`` with
        prefill's reason. What arrives meanwhile for a request in ``keep``, and what prefill sends this request
        unasked (a streamed transfer's ``Progress``, a claim's ``SourceDigests``, read while a slot is awaited),
        is put back for its own wait; a late answer to an earlier request is skipped."""
        if send:
            link.client.send(msg)
        kept: list[protocol.Message] = []
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                reply = link.client.recv(max(deadline - time.monotonic(), 0.001), progress=self._progress)
                about = getattr(reply, "request_id", None)
                if about != request_id:
                    if about in keep:
                        kept.append(reply)
                    continue
                if isinstance(reply, protocol.Failed):
                    raise Refused(
                        f"prefill {link.view.engine_id} refused {type(msg).__name__}: {reply.reason}", reply.code
                    )
                if isinstance(reply, want):
                    return reply
                if isinstance(reply, (protocol.Progress, protocol.SourceDigests)):
                    kept.append(reply)
                    continue
                raise ProtocolError(f"prefill answered {type(reply).__name__} to {type(msg).__name__}")
        finally:
            link.client.put_back(kept)

    def close(self) -> None:
        for link in self._links.values():
            link.client.close()
        self._links.clear()

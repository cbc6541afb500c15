"""The decode peers a prefill rank has accepted: who they are, when each was last heard, and which new hello may
join them. A hello is admitted within the cap on peers, and one under a live peer's agent name only if it repeats
that peer's proof (the same decode process on a new connection): another peer borrowing the name evicts nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from glm_pd_common.errors import GlmPdError, ProtocolError
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import Endpoint, PeerView, accept_hello, same_proof


@dataclass
class DecodePeer:
    identity: bytes  # its side-channel identity
    peer: PeerView
    agent: str  # its agent in our transport
    last_seen: float = 0.0
    proof: bytes = b""  # its hello's: a later hello under its agent name must repeat it (or find it silent)


class DecodePeers:
    """By side-channel identity; ``idle_s``: past this silence a peer is gone (a live one heartbeats)."""

    def __init__(self, cap: int, idle_s: float) -> None:
        self.cap, self.idle_s = cap, idle_s
        self._by_ident: dict[bytes, DecodePeer] = {}

    def __len__(self) -> int:
        return len(self._by_ident)

    def __contains__(self, ident: object) -> bool:
        return ident in self._by_ident

    def __getitem__(self, ident: bytes) -> DecodePeer:
        return self._by_ident[ident]

    def __iter__(self) -> Iterator[DecodePeer]:
        return iter(list(self._by_ident.values()))

    def engine(self, ident: bytes) -> str:
        """The decode engine ``ident`` belongs to (what leases and streams are owned by)."""
        return self._by_ident[ident].peer.engine_id

    def seen(self, ident: bytes, now: float) -> None:
        if ident in self._by_ident:
            self._by_ident[ident].last_seen = now

    def full(self, ident: bytes) -> str:
        """Why a hello from ``ident`` cannot join (the cap), or ""."""
        if ident not in self._by_ident and len(self._by_ident) >= self.cap:
            return f"prefill serves at most {self.cap} decode peers at once"
        return ""

    def impostor(self, ident: bytes, agent: str, proof: bytes, now: float) -> str:
        """Why a hello under ``agent`` from ``ident`` must not evict the live peer of that name, or ""."""
        for other in self._by_ident.values():
            if other.agent != agent or other.identity == ident:
                continue
            if not same_proof(proof, other.proof) and now - other.last_seen <= self.idle_s:
                return (
                    f"decode agent {protocol.clip(agent, 80)} is connected and live; a hello under its name that "
                    f"cannot prove to be it evicts nothing (a restarted decode is accepted once the old connection "
                    f"has been silent {self.idle_s:.0f} s)"
                )
        return ""

    def named(self, agent: str) -> list[bytes]:
        return [p.identity for p in self._by_ident.values() if p.agent == agent]

    def add(self, peer: DecodePeer) -> None:
        self._by_ident[peer.identity] = peer

    def pop(self, ident: bytes) -> DecodePeer | None:
        return self._by_ident.pop(ident, None)

    def silent(self, now: float) -> list[DecodePeer]:
        return [p for p in self._by_ident.values() if now - p.last_seen > self.idle_s]


def admit(
    peers: DecodePeers,
    local: Endpoint,
    ident: bytes,
    hello: protocol.Hello,
    now: float,
    forget: Callable[[bytes, str], None],
) -> str:
    """Make a hello's decode a peer: within the cap, its hello checked, never evicting a live peer it cannot prove
    to be, its agent loaded (``forget`` drops what it replaces: this connection's earlier peer and the agent's
    older connections). Returns why it was refused ("" when admitted); a refused hello evicts nobody."""
    if full := peers.full(ident):
        return full
    try:
        peer = accept_hello(local.spec, hello, backend=local.transport.backend, role="decode", local_role="prefill")
    except GlmPdError as exc:
        return str(exc)
    if why := peers.impostor(ident, peer.agent_name, hello.proof, now):
        return why
    forget(ident, "it said hello again")
    try:
        for other in peers.named(peer.agent_name):
            forget(other, "its agent said hello on a new connection (a restart or a re-handshake)")
        agent = local.transport.add_peer(peer.agent_metadata, peer.spans)
        if agent != peer.agent_name:
            local.transport.remove_peer(agent)
            raise ProtocolError(f"decode {hello.engine_id} says agent {peer.agent_name!r}, its metadata {agent!r}")
    except GlmPdError as exc:
        return str(exc)
    peers.add(DecodePeer(ident, peer, agent, now, hello.proof))
    return ""

"""The decode ranks a prefill rank has accepted, and which new registration may join or replace one.

SGLang's rank sockets are PULL: a message does not say who sent it, and every deployment member holds the same
key. So a registration under a registered agent's name replaces it only if it repeats that agent's proof (the
same decode process registering again after SGLang resumed its memory); any other evicts nothing. Agent names
carry a random part per process (``agent_name``), so a restarted decode registers as a new agent, and no peer
can load a damaged blob under a name before its owner (NIXL 1.5.1 keeps such a name unusable). The table is
capped: past the cap, the least recently used agent that no room is waiting for makes way.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import same_proof
from glm_pd_sglang import wire


def agent_name(mode: str, host: str, port: int) -> str:
    """A rank's transport agent name: where it listens, and a random part no other process can guess."""
    return f"glmpd-{mode}-{host}-{port}-{secrets.token_hex(8)}"


@dataclass
class Accepted:
    registration: wire.Registration
    proof: bytes
    used: float = field(default_factory=time.monotonic)  # last registered or named by a room


class Registrations:
    """Accepted decode registrations by agent name, at most ``cap`` of them."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._by_agent: dict[str, Accepted] = {}

    def __len__(self) -> int:
        return len(self._by_agent)

    def __contains__(self, agent: object) -> bool:
        return agent in self._by_agent

    def all(self) -> list[wire.Registration]:
        return [a.registration for a in self._by_agent.values()]

    def impostor(self, agent: str, proof: bytes) -> str:
        """Why a registration under ``agent`` must not replace the registered one, or ""."""
        known = self._by_agent.get(agent)
        if known is None or same_proof(proof, known.proof):
            return ""
        return (
            f"decode agent {protocol.clip(agent, 80)} is registered; a registration under its name that cannot "
            "prove to be it replaces nothing"
        )

    def make_way(self, agent: str, waited_for: set[str]) -> tuple[str | None, str]:
        """Room for ``agent``: ``(agent to evict or None, "")``, or ``(None, why not)`` when every registered
        agent is one a room waits for."""
        if agent in self._by_agent or len(self._by_agent) < self.cap:
            return None, ""
        idle = [(a.used, name) for name, a in self._by_agent.items() if name not in waited_for]
        if not idle:
            return None, f"prefill serves at most {self.cap} decode ranks at once, each with a room in progress"
        return min(idle)[1], ""

    def add(self, agent: str, registration: wire.Registration, proof: bytes) -> None:
        self._by_agent[agent] = Accepted(registration, proof)

    def touch(self, agent: str) -> None:
        if agent in self._by_agent:
            self._by_agent[agent].used = time.monotonic()

    def pop(self, agent: str) -> None:
        self._by_agent.pop(agent, None)

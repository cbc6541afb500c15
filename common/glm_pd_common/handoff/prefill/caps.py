"""What remote peers can make prefill hold, each bounded before anything is kept.

A claim that arrives before its grant, a subscription before its transfer opens and a decode's handshake are
all kept on a peer's word: without a bound, four 16 MB claims for ids never granted pinned 500 MB for a whole
timeout. Past a cap the message is refused by name and nothing is kept; a live request is never evicted for it.
Connections are capped before any message: past ``connections`` a handshake is refused (with a credential only,
see ``wire.trust``), so peers that never say hello cannot use up the process's file descriptors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.trust import MAX_CONNECTIONS


@dataclass(frozen=True)
class PeerCaps:
    peers: int = 1024  # decode ranks handshaken at once (a cluster's decode ranks, with room for restarts)
    early_claims: int = 256  # claims and confirmations one decode keeps waiting for grants
    early_pages: int = 1 << 21  # page ids all waiting claims hold together (a 1M-token claim carries ~32k)
    subscriptions: int = 16384  # streamed subscriptions, all decodes together
    connections: int = MAX_CONNECTIONS  # side-channel connections, handshaking or not, said hello or not

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int or value < 1:
                raise ConfigError(f"prefill's cap on {name} must be an integer of at least 1, got {value!r}")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], where: str) -> PeerCaps:
        """Caps from an operator's settings (``where`` names them in errors); the others keep their defaults."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"{where} has unknown cap(s) {unknown}; prefill's caps are {sorted(known)}")
        return cls(**settings)


DEFAULT_CAPS = PeerCaps()

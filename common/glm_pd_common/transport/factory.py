"""Which backend a transport config names, imported only when asked for: each pulls a native library."""

from __future__ import annotations

from glm_pd_common.transport.base import Transport, TransportConfig


def create_transport(agent_name: str, config: TransportConfig) -> Transport:
    if config.backend == "nixl":
        from glm_pd_common.transport.nixl import NixlTransport

        return NixlTransport(agent_name, config)
    from glm_pd_common.transport.mooncake import MooncakeTransport

    return MooncakeTransport(agent_name, config)

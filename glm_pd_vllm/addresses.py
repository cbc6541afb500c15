"""Where each prefill rank listens, so that an instance whose ranks span nodes can be served.

GLM-5.x-FP8 (about 712 GB of weights) needs TP 16 over two nodes on H100s: one host for every rank is then
wrong for half of them. Each worker binds the address of its own node and publishes it through vLLM's handshake
metadata (``get_handshake_metadata``: EngineCore collects it from every worker once the caches are registered and
hands it to the scheduler's connector); the scheduler relays the list to decode in ``kv_transfer_params``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.trust import is_loopback
from glm_pd_vllm.config import HOST_ENV


@dataclass(frozen=True)
class RankAddress(KVConnectorHandshakeMetadata):
    """One worker's side channel as decode must dial it."""

    tp_rank: int
    host: str
    port: int


def check_bindable(host: str, nodes: int) -> None:
    """Refuse, at start-up, a side-channel host decode cannot be told: a wildcard names no address, and a loopback
    one reaches only the node decode dials from, which is wrong for ranks on another node of the instance."""
    try:
        unspecified = ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_unspecified
    except ValueError:
        unspecified = False  # a name
    if unspecified:
        raise ConfigError(
            f"side_channel_host {host!r} binds every interface but is no address decode can dial; set the node's "
            f"own address (kv_connector_extra_config['side_channel_host'], or {HOST_ENV} on each node)"
        )
    if is_loopback(host) and nodes > 1:
        raise ConfigError(
            f"this instance spans {nodes} nodes but its side channel is {host!r}: decode could not reach the ranks "
            f"of the other nodes; set {HOST_ENV} on each node to that node's address"
        )


def rank_hosts(addresses: dict[int, RankAddress], tp_size: int, base_port: int) -> tuple[str, ...]:
    """Each rank's host, in rank order, from the workers' metadata (keyed by TP rank). Decode dials rank r at
    ``base_port + r``: a missing rank or a port off that rule is refused by name."""
    missing = sorted(set(range(tp_size)) - set(addresses))
    if missing:
        raise ConfigError(f"no side-channel address from TP rank(s) {missing} of {tp_size}")
    for rank, address in sorted(addresses.items()):
        if address.tp_rank != rank or address.port != base_port + rank:
            raise ConfigError(
                f"TP rank {rank} publishes rank {address.tp_rank} at port {address.port}, not port "
                f"{base_port + rank} (base {base_port} + rank)"
            )
    return tuple(addresses[rank].host for rank in range(tp_size))

"""A transport forgets a peer whole: its announced regions and the library's agent, so it can load again."""

import pytest

from glm_pd_common.errors import TransferFailed
from glm_pd_common.transport.base import Span, TransportConfig
from glm_pd_common.transport.factory import create_transport


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_remove_peer_unloads_the_agent_so_a_restarted_peer_loads(backend) -> None:
    config = TransportConfig(backend=backend, allow_tcp=True, timeout_s=5)
    local, first, restarted = (create_transport(n, config) for n in ("local", "peer", "peer"))
    try:
        span = [Span("x", 1 << 20, 4096)]
        assert local.add_peer(first.metadata(), span) == "peer"
        assert local.remote_peers() == ["peer"]
        local.remove_peer("peer")
        local.remove_peer("never-loaded")  # unknown: nothing to do
        assert local.remote_peers() == []
        with pytest.raises(TransferFailed, match="unknown peer"):
            local.post("peer", "READ", [0], [1 << 20], [1])
        # NIXL refuses other metadata under a loaded name (NIXL_ERR_NOT_ALLOWED): only a real unload lets it in.
        assert local.add_peer(restarted.metadata(), span) == "peer"
        assert local.remote_peers() == ["peer"]
    finally:
        for t in (local, first, restarted):
            t.close()

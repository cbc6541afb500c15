"""The handoff: versioned wire, handshake, leases, states, side channel, and the prefill and decode services.

This is the layer that holds threads and sockets; it plans and checks through ``glm_pd_common.layout``.
"""

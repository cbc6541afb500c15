"""The handoff, the layer that holds threads and sockets: a wire (``wire``: protocol, side channel, handshake) under
two wings that never import each other, prefill's (``prefill``: leases, readiness, streams) and decode's
(``decode``: loads, renewals, feeds, its links to prefills), and what both wings share (lanes, recent ids, the
fault-injection interface). It plans and checks through ``glm_pd_common.layout``.
"""

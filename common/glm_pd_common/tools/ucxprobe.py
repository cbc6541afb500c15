"""A tiny loopback READ over NIXL between this process and a peer process, for ``glm-pd doctor``.

Run under ``UCX_PROTO_INFO=y`` so UCX prints the protocol and transports it really selects; the doctor
parses that output. TCP is allowed here: the probe observes what would be used, it does not serve.
"""

from __future__ import annotations

import base64
import json
import select
import subprocess
import sys

import numpy as np

from glm_pd_common.tools.flat import flat_region
from glm_pd_common.transport.base import Span, TransportConfig
from glm_pd_common.transport.factory import create_transport

PROBE_BYTES = 4 << 20


def serve() -> int:
    """The passive side: one flat buffer registered and announced, progressed (``notifs``) until stdin closes."""
    buf = np.ones(PROBE_BYTES, dtype=np.uint8)
    transport = create_transport("probe-peer", TransportConfig(backend="nixl", allow_tcp=True, timeout_s=30))
    region = flat_region(buf)
    transport.register([region])
    announce = {"metadata": base64.b64encode(transport.metadata()).decode(),
                "regions": [[region.kind, region.layer_id, region.base_addr, region.size_bytes]]}  # fmt: skip
    print("PEER " + json.dumps(announce), flush=True)
    while True:
        transport.notifs()  # UCX progresses only when polled, as an engine's loop polls it
        if not select.select([sys.stdin], [], [], 0.001)[0]:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        spans = [Span(f"{k}[{lay}]", base, size) for k, lay, base, size in cmd["spans"]]
        transport.add_peer(base64.b64decode(cmd["add_peer"]), spans)
    transport.close()
    return 0


def main() -> int:
    """The active side: start the passive one, READ its buffer once, report."""
    peer = subprocess.Popen(
        [sys.executable, "-m", "glm_pd_common.tools.ucxprobe", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdin is not None and peer.stdout is not None  # both are PIPEs
        hello = next(json.loads(ln[5:]) for ln in peer.stdout if ln.startswith("PEER "))
        buf = np.zeros(PROBE_BYTES, dtype=np.uint8)
        transport = create_transport("probe", TransportConfig(backend="nixl", allow_tcp=True, timeout_s=30))
        region = flat_region(buf)
        transport.register([region])
        spans = [Span(f"{k}[{lay}]", base, size) for k, lay, base, size in hello["regions"]]
        agent = transport.add_peer(base64.b64decode(hello["metadata"]), spans)
        peer.stdin.write(
            json.dumps(
                {
                    "add_peer": base64.b64encode(transport.metadata()).decode(),
                    "spans": [[region.kind, region.layer_id, region.base_addr, region.size_bytes]],
                }
            )
            + "\n"
        )
        peer.stdin.flush()
        remote = spans[-1]
        xfer = transport.post(
            agent, "READ", np.array([buf.ctypes.data]), np.array([remote.base_addr]), np.array([PROBE_BYTES])
        )
        transport.wait(xfer)
        transport.release(xfer)
        transport.close()
        print(json.dumps({"probe": "ok", "bytes": PROBE_BYTES}))
        return 0
    finally:
        peer.kill()
        peer.wait()


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main())

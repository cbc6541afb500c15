"""A tiny loopback READ and WRITE over NIXL between this process and a peer process, for ``glm-pd doctor``.

Run under ``UCX_PROTO_INFO=y`` so UCX prints the protocol and transports it really selects (parsed by
``transport.datapath``). Host memory, or GPU memory (``--memory cuda --device N``: a buffer on GPU N in both
processes, allocated through the CUDA driver). TCP is allowed here: the probe observes what would be
used, it does not serve.
"""

from __future__ import annotations

import argparse
import base64
import json
import select
import subprocess
import sys
from collections.abc import Callable

import numpy as np

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.regions import Region
from glm_pd_common.tools.cuda_driver import CudaDevice
from glm_pd_common.tools.flat import flat_region, flat_span
from glm_pd_common.transport.base import Op, Span, TransportConfig
from glm_pd_common.transport.factory import create_transport

PROBE_BYTES = 4 << 20
OPERATIONS: tuple[Op, ...] = ("READ", "WRITE")  # pull (vLLM) reads prefill's pages; push (SGLang) writes decode's


def _buffer(memory: str, device: int) -> tuple[Region, Callable[[], object]]:
    """A PROBE_BYTES buffer in ``memory`` (GPU ``device``) as a region, and what keeps it alive."""
    if memory == "cuda":
        return flat_span(_cuda_alloc(device, PROBE_BYTES), PROBE_BYTES, "VRAM", device), lambda: None
    host = np.ones(PROBE_BYTES, dtype=np.uint8)
    return flat_region(host), lambda: host


def _cuda_alloc(device: int, size: int) -> int:
    """``size`` bytes on GPU ``device`` through the CUDA driver; freed when the probe process exits."""
    try:
        return CudaDevice(device).alloc(size)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None


def _announce(transport, region: Region) -> dict:
    return {"metadata": base64.b64encode(transport.metadata()).decode(),
            "span": [region.base_addr, region.size_bytes, region.mem_kind, region.device_id]}  # fmt: skip


def _span(announced: dict) -> Span:
    base, size, mem_kind, device_id = announced["span"]
    return Span("probe", base, size, mem_kind, device_id)


def serve(memory: str, device: int) -> int:
    """The passive side: one buffer registered and announced, progressed (``notifs``) until stdin closes."""
    region, _keep = _buffer(memory, device)
    transport = create_transport("probe-peer", TransportConfig(backend="nixl", allow_tcp=True, timeout_s=30))
    transport.register([region])
    print("PEER " + json.dumps(_announce(transport, region)), flush=True)
    while True:
        transport.notifs()  # UCX progresses only when polled, as an engine's loop polls it
        if not select.select([sys.stdin], [], [], 0.001)[0]:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        transport.add_peer(base64.b64decode(cmd["metadata"]), [_span(cmd)])
    transport.close()
    return 0


def probe(memory: str, device: int) -> int:
    """The active side: start the passive one, READ its buffer once and WRITE it once, report."""
    peer = subprocess.Popen(
        [sys.executable, "-m", "glm_pd_common.tools.ucxprobe", "--serve", "--memory", memory, "--device", str(device)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdin is not None and peer.stdout is not None  # both are PIPEs
        hello = next((json.loads(ln[5:]) for ln in peer.stdout if ln.startswith("PEER ")), None)
        if hello is None:
            print(f"the probe's peer process exited ({peer.wait()}) before announcing its {memory} buffer")
            return 1
        region, _keep = _buffer(memory, device)
        transport = create_transport("probe", TransportConfig(backend="nixl", allow_tcp=True, timeout_s=30))
        transport.register([region])
        remote = _span(hello)
        agent = transport.add_peer(base64.b64decode(hello["metadata"]), [remote])
        peer.stdin.write(json.dumps(_announce(transport, region)) + "\n")
        peer.stdin.flush()
        for op in OPERATIONS:
            xfer = transport.post(
                agent, op, np.array([region.base_addr]), np.array([remote.base_addr]), np.array([PROBE_BYTES])
            )
            transport.wait(xfer)
            transport.release(xfer)
        transport.close()
        print(json.dumps({"probe": "ok", "memory": memory, "bytes": PROBE_BYTES, "operations": OPERATIONS}))
        return 0
    finally:
        peer.kill()
        peer.wait()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m glm_pd_common.tools.ucxprobe")
    parser.add_argument("--memory", choices=("host", "cuda"), default="host")
    parser.add_argument("--device", type=int, default=0, help="the GPU both sides' buffers are on (--memory cuda)")
    parser.add_argument("--serve", action="store_true", help="the passive side (started by the active one)")
    args = parser.parse_args()
    return serve(args.memory, args.device) if args.serve else probe(args.memory, args.device)


if __name__ == "__main__":
    sys.exit(main())

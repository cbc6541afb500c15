"""The smoke's prefill process: VRAM caches on NIXL, the core's PrefillService, and a deliberately slow writer.

Driven by JSON lines on stdin, answering ``SMOKE {json}`` lines on stdout (``tests/gpu/smoke.py`` starts it):
``write`` fills a request's pages with a stale pattern, then queues a GPU sleep and the final pattern on the
stream, records a ``torch.cuda.Event`` and grants the pages at once (no host sync), with the event as the
grant's ``ready`` or, for the ungated control, without it;
``finished`` reports lease outcomes; ``exit`` closes everything. Run: ``python -m tests.gpu.prefill_child JOB``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch

from glm_pd_common.handoff.prefill.lease import Finished
from glm_pd_common.handoff.prefill.service import PrefillService
from glm_pd_common.handoff.wire.handshake import Endpoint
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.transport.base import TransportConfig
from glm_pd_common.transport.factory import create_transport
from tests.gpu.vram import VramCaches, cuda_device, glm53_spec


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write("SMOKE " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def sleep_cycles_per_s() -> float:
    """Calibrate ``torch.cuda._sleep`` (it spins for a cycle count; the SM clock varies by machine and load)."""
    cycles = 200_000_000
    for _ in range(2):  # the first round also lifts the clocks from idle
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    return cycles / seconds


class Writer:
    def __init__(self, job: dict[str, Any]) -> None:
        self.device = cuda_device()
        spec = glm53_spec()
        self.caches = VramCaches(spec, page_tokens=job["page_tokens"], num_pages=job["num_pages"], device=self.device)
        self.transport = create_transport("smoke-prefill-tp0", TransportConfig(allow_tcp=True, timeout_s=60))
        self.transport.register(self.caches.regions)
        local = Endpoint(
            "smoke-prefill", spec, self.caches.regions, self.transport, PeerShape(job["page_tokens"], 1, 0)
        )
        self.service = PrefillService(local, host="127.0.0.1", port=0, lease_s=120.0, timeout_s=60.0)
        self.cycles_per_s = sleep_cycles_per_s()
        self.ended: list[Finished] = []
        self.timings: dict[str, tuple[torch.cuda.Event, torch.cuda.Event]] = {}

    def write(self, cmd: dict[str, Any]) -> dict[str, Any]:
        pages = torch.as_tensor(cmd["pages"], dtype=torch.int64, device=self.device)
        self.caches.fill(cmd["stale_seed"], pages)
        torch.cuda.synchronize()  # the stale bytes are in place before the slow write starts
        start, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(int(cmd["sleep_s"] * self.cycles_per_s))
        self.caches.fill(cmd["final_seed"], pages)
        ready.record()
        self.timings[cmd["request_id"]] = (start, ready)
        table = np.asarray(cmd["pages"], dtype=np.int64)
        pending = not ready.query()
        if cmd["gate"] == "ready":  # no claim is answered before the event completes (issue 14 item 8)
            self.service.grant(cmd["request_id"], table, ready=ready)
        else:  # the control: the pages are exposed while the GPU may still be writing them
            self.service.grant(cmd["request_id"], table)
        return {"granted": cmd["request_id"], "pending_at_grant": pending, "gating": cmd["gate"]}

    def finished(self) -> dict[str, Any]:
        self.ended += self.service.finished()
        write_s = {}
        for rid, (start, ready) in self.timings.items():
            ready.synchronize()
            write_s[rid] = start.elapsed_time(ready) / 1e3
        return {
            "finished": {f.request_id: [f.outcome, f.detail] for f in self.ended},
            "write_s": write_s,
            "leftovers": self.service.leftovers(),
        }

    def close(self) -> None:
        self.service.close()
        self.transport.close()


def main() -> None:
    job = json.loads(sys.argv[1])
    writer = Writer(job)
    say(
        {
            "port": writer.service.port,
            "device_id": writer.caches.device_id,
            "regions": len(writer.caches.regions),
            "cache_bytes": writer.caches.total_bytes,
            "data_path": writer.transport.info().data_path,
            "sleep_cycles_per_s": writer.cycles_per_s,
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "write":
            say(writer.write(cmd))
        elif cmd["op"] == "finished":
            say(writer.finished())
        elif cmd["op"] == "exit":
            break
    writer.close()
    say({"closed": True})


if __name__ == "__main__":
    main()

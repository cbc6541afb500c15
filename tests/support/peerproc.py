"""A passive loopback peer: a separate process with its own transport and GLM-5.3 caches.

The transport tests and ``benchmarks/transport_bench.py`` drive it by JSON lines on stdin (add_peer,
send_notif, check, notifs, exit); it answers JSON lines on stdout marked ``PEER``. Between commands it keeps
calling ``notifs()`` so UCX progresses, as an engine's poll loop does. Optionally it also registers one flat
buffer (``flat_bytes``) for single-run measurements. Run: ``python -m tests.support.peerproc JOB``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import select
import sys
from pathlib import Path
from typing import Any

import numpy as np

from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.flat import flat_region
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.base import Span, TransportConfig
from glm_pd_common.transport.factory import create_transport
from tests.support.lines import LineReader


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write("PEER " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    job = json.loads(sys.argv[1])
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    caches = HostCaches(spec, page_tokens=job["page_tokens"], num_pages=job["num_pages"])
    table = np.asarray(job["table"], dtype=np.int64)
    if job["fill"]:
        caches.write_tokens(table, 0, job["tokens"], seed=job["seed"])
    config = TransportConfig(backend=job["backend"], allow_tcp=True, timeout_s=job.get("timeout_s", 20))
    transport = create_transport("peer", config)
    regions: list[Region] = list(caches.regions)
    flat = None
    if job.get("flat_bytes"):
        flat = np.ones(job["flat_bytes"], dtype=np.uint8)
        regions.append(flat_region(flat))
    transport.register(regions)
    say(
        {
            "metadata": base64.b64encode(transport.metadata()).decode(),
            "regions": [[r.kind, r.layer_id, r.base_addr, r.size_bytes] for r in regions],
            "info": dataclasses.asdict(transport.info()),
        }
    )
    got = []
    while True:
        got.extend(transport.notifs())
        ready, _, _ = select.select([sys.stdin], [], [], 0.001)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        if "add_peer" in cmd:
            spans = [Span(f"{k}[{lay}]", base, size) for k, lay, base, size in cmd["spans"]]
            name = transport.add_peer(base64.b64decode(cmd["add_peer"]), spans)
            say({"added": name})
        elif "send_notif" in cmd:
            transport.send_notif(cmd["send_notif"], base64.b64decode(cmd["payload"]))
            say({"sent": True})
        elif "check" in cmd:
            say({"mismatched": caches.mismatched_tokens(table, cmd["start"], cmd["end"], seed=job["seed"])})
        elif "notifs" in cmd:
            got.extend(transport.notifs())
            say({"notifs": [[p, base64.b64encode(m).decode()] for p, m in got]})
        elif "exit" in cmd:
            break
    transport.close()
    say({"closed": True})


if __name__ == "__main__":
    main()


class PeerProcess:
    """The driving side: starts a peer process and talks to it (used by the tests and the benchmark)."""

    def __init__(self, job: dict[str, Any]) -> None:
        import os
        import subprocess

        self.job = job
        cmd = [sys.executable, "-m", "tests.support.peerproc", json.dumps(job)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parents[2]
        )
        self.lines = LineReader(self.proc.stdout)  # type: ignore[arg-type]  # PIPE: never None
        hello = self.read()
        self.metadata = base64.b64decode(hello["metadata"])
        self.announced: list[list[Any]] = hello["regions"]
        self.spans = [Span(f"{k}[{lay}]", base, size) for k, lay, base, size in self.announced]

    def cache_regions(self) -> list[Region]:
        """The peer's GLM-5.3 cache regions as plan inputs (the flat buffer, if any, left out)."""
        from glm_pd_common.layout.regions import build_regions
        from glm_pd_common.tools.flat import FLAT_LAYER_ID

        spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
        addrs = {(k, lay): base for k, lay, base, _ in self.announced if lay != FLAT_LAYER_ID}
        return build_regions(
            spec.geometry,
            spec.row,
            spec.indexer,
            page_tokens=self.job["page_tokens"],
            num_pages=self.job["num_pages"],
            main_addrs={lay: a for (k, lay), a in addrs.items() if k == "main"},
            indexer_addrs={lay: a for (k, lay), a in addrs.items() if k == "indexer"},
        )

    def read(self, timeout_s: float = 120) -> dict[str, Any]:
        """The peer's next ``PEER`` answer; an error if it exits or stays silent past ``timeout_s``."""
        line = self.lines.next_matching(lambda ln: ln.startswith("PEER "), timeout_s)
        if line is None:
            raise RuntimeError(f"peer exited (rc {self.proc.poll()})")
        return json.loads(line[5:])

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.read()

    def introduce(self, metadata: bytes, regions: list[Region]) -> dict[str, Any]:
        """Give the peer our transport metadata and regions (what a hello carries)."""
        spans = [[r.kind, r.layer_id, r.base_addr, r.size_bytes] for r in regions]
        return self.ask({"add_peer": base64.b64encode(metadata).decode(), "spans": spans})

    def close(self) -> int:
        """Ask the peer to release everything and exit; returns its exit code (killed if it hangs)."""
        try:
            if self.proc.poll() is None and self.ask({"exit": True}) == {"closed": True}:
                return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

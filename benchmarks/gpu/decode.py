"""The parent process as decode: its caches, flat buffer, agents, staging buffer and ``DecodeService``, the
prefill child, and the one-time exchanges between them (the raw agents, decode's region addresses for push)."""

from __future__ import annotations

import argparse
import base64
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gpu.child import Child
from benchmarks.gpu.environment import UcxLog
from benchmarks.gpu.memory import memory_kind
from benchmarks.gpu.ranks import (
    DECODE,
    DECODE_AGENT,
    PAGE_TOKENS,
    POOL_SLACK_PAGES,
    RAW_DECODE,
    SEED,
    TIMEOUT_S,
    endpoint,
    page_tables,
    span_of,
    transports,
)


class Decode:
    """Decode's side of the bench; ``staging.mode`` is set per load (``always`` for a staged row, ``never``
    otherwise), as ``decode.verify_digests`` is: one service and one link serve every row."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from glm_pd_common.handoff.decode.service import DecodeService
        from glm_pd_common.layout.pages import num_pages_for
        from glm_pd_common.layout.plan import build_plan

        self.args = args
        self.started = time.monotonic()
        self.log = UcxLog(workdir / "ucx-decode.log")
        self.child_log = workdir / "ucx-prefill.log"
        self.kind = memory_kind(args.memory)
        self.pages = num_pages_for(args.tokens, PAGE_TOKENS)
        self.pool_pages = self.pages + POOL_SLACK_PAGES
        self.tables = page_tables(self.pages, self.pool_pages, SEED)
        self.caches = self.kind.caches(self.pool_pages)
        whole = np.arange(self.pages, dtype=np.int64)
        plan = build_plan(
            self.caches.regions, self.caches.regions, whole, whole, num_tokens=args.tokens, prefix_tokens=0
        )
        self.nbytes = plan.num_bytes  # the request, as the core plans it
        self.flat, self.flat_buf = self.kind.flat(self.nbytes)
        sizes = {"slot_bytes": args.slot_mib << 20, "staging_bytes": args.staging_mib << 20}
        job = {
            "memory": args.memory,
            "pages": self.pages,
            "pool_pages": self.pool_pages,
            "bytes": self.nbytes,
            "seed": SEED,
            "ucx_log": str(self.child_log),
            **sizes,
        }
        self.child = Child(job)
        try:
            self.raw, self.transport = transports(self.caches, self.flat, (RAW_DECODE, DECODE_AGENT), "READ")
            regions = self.caches.regions
            self.staging = self.kind.staging(
                self.transport, regions, size_bytes=sizes["staging_bytes"], slot_bytes=sizes["slot_bytes"]
            )
            local = endpoint(
                DECODE, self.kind.endpoint_extras(self.caches.regions), self.caches, self.transport, self.staging
            )
            self.decode = DecodeService(local, timeout_s=TIMEOUT_S, verify_digests=False)
        except BaseException:
            self.child.close()
            raise
        self._ids = 0
        self.setup_s = time.monotonic() - self.started

    def connect(self) -> None:
        """Each raw agent loads the other; prefill learns decode's region addresses (push plans into them)."""
        from glm_pd_common.transport.base import Span

        hello = self.child.hello
        self.remote_span = Span("flat", *hello["raw_span"])
        self.raw_peer = self.raw.add_peer(base64.b64decode(hello["raw_metadata"]), [self.remote_span])
        metadata = base64.b64encode(self.raw.metadata()).decode()
        self.child.ask({"op": "raw_peer", "metadata": metadata, "span": span_of(self.flat)})
        addrs = [r.base_addr for r in self.caches.regions]
        self.child.ask({"op": "decode_regions", "addrs": addrs, "device_id": self.caches.regions[0].device_id})

    def next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    def result(self, request_id: str) -> Any:
        """The load's result, once decode's service reports it; a failed load raises with its code and reason."""
        deadline = time.monotonic() + TIMEOUT_S * 1.5
        while time.monotonic() < deadline:
            for result in self.decode.results(0.05):
                if result.request_id == request_id:
                    if not result.ok:
                        raise RuntimeError(f"load {request_id} failed ({result.code}): {result.reason}")
                    return result
        raise TimeoutError(f"no result for load {request_id} within {TIMEOUT_S * 1.5:.0f} s")

    def close(self) -> None:
        self.decode.close()
        self.child.close()
        self.transport.close()
        self.raw.close()

"""The prefill process: caches, a flat buffer and a staging buffer, ``PrefillService`` (streamed), and the parent's
commands, a JSON line each answered by one (``child.Child`` is the parent's end).

Prefill runs in a process of its own, as in a deployment: two agents in one process would share UCX's worker
and its choice of path.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import select
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.gpu.environment import UcxLog, flush_c_stdio
from benchmarks.gpu.memory import memory_kind
from benchmarks.gpu.ranks import (
    CHUNKS,
    DECODE_AGENT,
    PAGE_TOKENS,
    PREFILL,
    PREFILL_AGENT,
    RAW_PREFILL,
    TIMEOUT_S,
    endpoint,
    page_tables,
    span_of,
    transports,
)

if TYPE_CHECKING:
    import numpy as np

    from glm_pd_common.layout.plan import TransferPlan
    from glm_pd_common.layout.regions import Region

CHILD_TAG = "BENCH "  # marks the answers among whatever else reaches the child's stdout


class Prefill:
    """The child's state and the commands it serves."""

    def __init__(self, job: dict[str, Any]) -> None:
        from glm_pd_common.handoff.prefill.service import PrefillService

        self.kind = memory_kind(job["memory"])
        self.caches = self.kind.caches(job["pool_pages"])
        self.flat, self._flat_buf = self.kind.flat(job["bytes"])
        self.raw, self.transport = transports(self.caches, self.flat, (RAW_PREFILL, PREFILL_AGENT), "WRITE")
        self.staging = self.kind.staging(
            self.transport, self.caches.regions, size_bytes=job["staging_bytes"], slot_bytes=job["slot_bytes"]
        )
        extras = self.kind.endpoint_extras(self.caches.regions)
        local = endpoint(PREFILL, extras, self.caches, self.transport, self.staging)
        self.service = PrefillService(
            local, host="127.0.0.1", port=0, lease_s=TIMEOUT_S, timeout_s=TIMEOUT_S, streamed=True
        )
        self.tables = page_tables(job["pages"], job["pool_pages"], job["seed"])
        self.decode_regions: list[Region] = []
        self.ended: list[Any] = []

    def hello(self) -> dict[str, Any]:
        info = self.transport.info()
        return {
            "port": self.service.port,
            "raw_metadata": base64.b64encode(self.raw.metadata()).decode(),
            "raw_span": span_of(self.flat),
            "reported_path": info.path,
            "data_path": info.data_path,
        }

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "raw_peer":
            from glm_pd_common.transport.base import Span

            self.raw.add_peer(base64.b64decode(cmd["metadata"]), [Span("flat", *cmd["span"])])
            return {}
        if op == "decode_regions":
            self.decode_regions = [
                dataclasses.replace(r, base_addr=addr, device_id=cmd["device_id"])
                for r, addr in zip(self.caches.regions, cmd["addrs"], strict=True)
            ]
            return {}
        if op == "grant":
            self.service.grant(cmd["request_id"], self.tables[cmd["pool"]][0][: cmd["pages"]])
            return {}
        if op == "push":
            return self.push(cmd["pool"], cmd["tokens"], cmd.get("staging"))
        if op == "open_stream":
            self.service.open_stream(cmd["transfer_id"], cmd["tokens"])
            return {}
        if op == "produce":
            return self.produce(cmd["transfer_id"], cmd["pool"], cmd["tokens"], cmd["chunk_s"])
        if op == "finished":
            self.ended += self.service.finished()
            return {"outcomes": sorted({f.outcome for f in self.ended}), "leftovers": self.service.leftovers()}
        raise ValueError(f"unknown command {op!r}")

    def push(self, pool: str, tokens: int, lent: dict[str, Any] | None) -> dict[str, Any]:
        """SGLang's posting: prefill's plan into decode's pages, WRITE, one chunk of the whole request: one batch,
        or through the staging pair decode ``lent`` (``staged_push.push_slots``, as SGLang's manager calls it)."""
        from glm_pd_common.layout.pages import num_pages_for
        from glm_pd_common.layout.plan import build_plan

        pages = num_pages_for(tokens, PAGE_TOKENS)
        src, dst = (t[:pages] for t in self.tables[pool])
        plan = build_plan(self.caches.regions, self.decode_regions, src, dst, num_tokens=tokens, prefix_tokens=0)
        if lent is not None:
            return self.push_staged(plan, lent)
        t0 = time.perf_counter()
        xfer = self.transport.post_plan(DECODE_AGENT, plan, "WRITE")  # loaded by the service's handshake
        try:
            self.transport.wait(xfer)
        finally:
            self.transport.release(xfer)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "bytes": sum(xfer.completed_bytes_by_kind.values()), "runs": plan.num_runs}

    def push_staged(self, plan: TransferPlan, lent: dict[str, Any]) -> dict[str, Any]:
        """The plan through one of this rank's pairs into the pair decode lent; each written slot is said to the
        parent, which answers once it landed it."""
        from glm_pd_common.handoff.staged_push import lent_slots, push_slots
        from glm_pd_common.transport.staging import staged_runs

        pair = self.staging.pairs.take()
        if pair is None:
            raise RuntimeError("prefill has no staging pair free")
        try:
            t0 = time.perf_counter()
            slot_bytes = min(self.staging.slot_bytes, lent["slot_bytes"])
            there = lent_slots(lent["offsets"], lent["base"], lent["size"], slot_bytes)
            runs = staged_runs(plan, slot_bytes)
            replies = ParentReplies()
            try:
                push_slots(self.transport, DECODE_AGENT, self.staging, pair, there, runs, TIMEOUT_S, replies)
            except Exception:
                replies.drain()
                raise
            seconds = time.perf_counter() - t0
        finally:
            self.staging.pairs.give(pair)
        return {"seconds": seconds, "bytes": plan.num_bytes, "runs": plan.num_runs, "slots": runs.num_slots}

    def produce(self, transfer_id: str, pool: str, tokens: int, chunk_s: float) -> dict[str, Any]:
        """The streamed writer: ``CHUNKS`` chunks at ``chunk_s`` each, each announced behind its ready event, then
        the lease; answers once the last chunk's event completed, with every chunk's end on the monotonic clock."""
        table = self.tables[pool][0]
        pace = self.kind.pace(chunk_s)
        step = -(-tokens // CHUNKS)
        done = 0
        ready = None
        while done < tokens:
            upto = min(done + step, tokens)
            ready = pace.chunk()
            first, end = -(-done // PAGE_TOKENS), -(-upto // PAGE_TOKENS)
            self.service.advance_stream(transfer_id, table[first:end], upto, ready=ready)
            done = upto
        pages = table[: -(-tokens // PAGE_TOKENS)]
        self.service.grant_stream(f"{transfer_id}#0", transfer_id, pages, tokens, ready=ready)
        return {"chunk_ends": pace.finish()}

    def close(self) -> None:
        self.service.close()
        self.transport.close()
        self.raw.close()


class ParentReplies:
    """``staged_push.SlotReplies`` over the parent's pipe: a line out per written slot, a line back per freed one
    (in order: the parent answers each slot it is told of, refused or not)."""

    def __init__(self) -> None:
        self.unread = 0  # answers the parent sent (or is sending) that were not read

    def landed(self, k: int, last: bool, addrs: np.ndarray, lengths: np.ndarray) -> None:
        say({"landed": k, "last": last})
        self.unread += 1

    def freed(self, k: int) -> None:
        line = sys.stdin.readline()
        self.unread -= 1
        answer = json.loads(line) if line else {}
        if answer.get("freed") != k:
            raise RuntimeError(f"the parent answered {line.strip()!r} where slot {k} was to be freed")
        if answer["error"]:
            raise RuntimeError(f"decode refused slot {k}: {answer['error']}")

    def drain(self) -> None:
        """After a failed push: the answers still coming, read, so the next command is read as one."""
        while self.unread > 0 and sys.stdin.readline():
            self.unread -= 1


def say(obj: dict[str, Any]) -> None:
    flush_c_stdio()  # the parent reads this process's UCX log once it has the answer
    sys.stdout.write(CHILD_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def child_main(job: dict[str, Any]) -> int:
    """Serve the parent's commands until stdin closes or ``exit``. Between commands the raw agent is progressed: a
    peer's operation on it completes only while it is polled."""
    UcxLog(Path(job["ucx_log"]))
    prefill = Prefill(job)
    say(prefill.hello())
    try:
        while True:
            prefill.raw.notifs()
            if not select.select([sys.stdin], [], [], 0.001)[0]:
                continue
            line = sys.stdin.readline()
            if not line:
                break  # the parent is gone
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            try:
                say(prefill.handle(cmd))
            except Exception as exc:  # the parent raises it with this row's name
                say({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        prefill.close()
    return 0

"""One run of each kind of row, over decode's side (``decode.Decode``): the raw one-descriptor operation, the
memory's copy and gather, a digest, a pull (direct or staged), a push, a streamed load."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.gpu.ranks import PAGE_TOKENS, PREFILL, SETTLE_S
from benchmarks.gpu.rows import Sample

if TYPE_CHECKING:
    from benchmarks.gpu.decode import Decode
    from glm_pd_common.transport.base import Op
    from glm_pd_common.transport.memory import MemoryReader


def raw(d: Decode, op: Op, nbytes: int) -> Sample:
    """One descriptor of ``nbytes`` between the flat buffers: the ceiling."""
    t0 = time.perf_counter()
    xfer = d.raw.post(
        d.raw_peer, op, np.array([d.flat.base_addr]), np.array([d.remote_span.base_addr]), np.array([nbytes])
    )
    try:
        d.raw.wait(xfer)
    finally:
        d.raw.release(xfer)
    return Sample(time.perf_counter() - t0, nbytes, 1)


def copy(d: Decode, scratch: Any) -> Sample:
    """The memory's own copy of the request's bytes."""
    return Sample(d.kind.copy_s(scratch, d.flat_buf), d.nbytes, 1)


def gather(d: Decode, scratch: Any, row_bytes: int, order: np.ndarray) -> Sample:
    """The memory's own gather of the request's bytes as shuffled rows of ``row_bytes`` (one indexed copy)."""
    return Sample(d.kind.gather_s(scratch, d.flat_buf, row_bytes, order), order.size * row_bytes, order.size)


def digest(d: Decode, reader: MemoryReader, row_bytes: int, order: np.ndarray) -> Sample:
    """One digest of the request's bytes as shuffled rows of ``row_bytes`` (as a shuffled pool's pages are read),
    waited for; a reader that changed how it digests mid-row (a kernel that failed over) raises."""
    kernel = getattr(reader, "kernel", None)
    offsets, lengths = order * row_bytes, np.full(order.size, row_bytes, dtype=np.int64)
    t0 = time.perf_counter()
    reader.digest(d.flat, offsets, lengths)
    seconds = time.perf_counter() - t0
    if getattr(reader, "kernel", None) is not kernel:
        raise RuntimeError("the digest kernel failed; torch's ops digested instead")
    return Sample(seconds, order.size * row_bytes, order.size)


def pull(d: Decode, pool: str, digests: bool, staged: bool = False, pages: int | None = None) -> Sample:
    """One load: prefill grants, decode loads, through the staging slots or not (``pages``: fewer than the
    request's, for a warm-up). A load that did not move as asked raises: a staged row must stage every byte."""
    from glm_pd_common.handoff.decode.loads import LoadJob, RemotePrefill

    pages = pages or d.pages
    rid = d.next_id("staged" if staged else "pull")
    d.child.ask({"op": "grant", "request_id": rid, "pool": pool, "pages": pages})
    d.decode.verify_digests = digests  # read by each claim
    d.staging.mode = "always" if staged else "never"  # read by each claim
    src, dst = (t[:pages] for t in d.tables[pool])
    remote = RemotePrefill(PREFILL, "127.0.0.1", d.child.hello["port"], 1)
    d.decode.submit(LoadJob(rid, remote, src, dst, min(pages * PAGE_TOKENS, d.args.tokens), 0))
    result = d.result(rid)
    moved = sum(result.bytes_by_kind.values())
    if result.staged_bytes != (moved if staged else 0):
        raise RuntimeError(f"load {rid} staged {result.staged_bytes} of {moved} B (staged={staged})")
    load_s = result.phases.get("claim", 0.0) + result.phases.get("pull", 0.0)
    return Sample(result.seconds, moved, result.runs, result.batches, {"load_s": load_s})


def push(d: Decode, pool: str, tokens: int, staged: bool = False) -> Sample:
    """Prefill WRITEs its plan into decode's pages; decode's agent is progressed meanwhile. Staged, decode lends
    one of its pairs and lands each slot prefill says it wrote (``staged_push.land_slot``), cut from the same
    plan (where a slot's bytes go needs no message); a slot it refuses fails the row."""
    from glm_pd_common.handoff.staged_push import land_slot
    from glm_pd_common.layout.pages import num_pages_for
    from glm_pd_common.layout.plan import build_plan
    from glm_pd_common.transport.staging import staged_runs

    cmd = {"op": "push", "pool": pool, "tokens": tokens}
    if not staged:
        got = d.child.ask(cmd, d.transport.notifs)
        return Sample(got["seconds"], got["bytes"], got["runs"])
    pages = num_pages_for(tokens, PAGE_TOKENS)
    src, dst = (t[:pages] for t in d.tables[pool])
    regions = d.caches.regions  # prefill's have the same layout: the plan's decode side is what lands here
    plan = build_plan(regions, regions, src, dst, num_tokens=tokens, prefix_tokens=0)
    runs = staged_runs(plan, d.staging.slot_bytes)
    pair = d.staging.pairs.take()
    if pair is None:
        raise RuntimeError("decode has no staging pair free")
    refused: list[str] = []

    def landed(said: dict[str, Any]) -> dict[str, Any]:
        """Every slot prefill says it wrote is answered, refused where it cannot land (prefill waits for each)."""
        k = said["landed"]
        try:
            error = land_slot(d.staging, regions, dst, pair, k, *runs.side(k, "dst"))
        except Exception as exc:  # e.g. a slot beyond the plan's: refused by name, as a bench reports
            error = f"{type(exc).__name__}: {exc}"
        refused.extend([f"slot {k}: {error}"] if error else [])
        return {"freed": k, "error": error}

    span = d.staging.span
    lent = [d.staging.slot_offset(pair, 0), d.staging.slot_offset(pair, 1)]
    staging = {"offsets": lent, "base": span.base_addr, "size": span.size_bytes, "slot_bytes": d.staging.slot_bytes}
    try:
        got = d.child.ask({**cmd, "staging": staging}, d.transport.notifs, landed)
    finally:
        d.staging.pairs.give(pair)
    if refused or got["slots"] != runs.num_slots:
        raise RuntimeError(f"staged push: {got['slots']} of {runs.num_slots} slots; refused {refused[:2]}")
    return Sample(got["seconds"], got["bytes"], got["runs"], got["slots"])


def streamed(d: Decode, chunk_s: float, staged: bool = False) -> Sample:
    """One streamed load of the shuffled pool, posted directly (``staged``: each announced span through both
    ranks' staging slots): decode subscribes, prefill writes and announces its chunks. Its seconds are the exposed
    handoff: decode's load end minus the last chunk's end."""
    from glm_pd_common.handoff.decode.loads import LoadJob, RemotePrefill

    tid, port = d.next_id("stream"), d.child.hello["port"]
    d.child.ask({"op": "open_stream", "transfer_id": tid, "tokens": d.args.tokens})
    d.decode.verify_digests = False
    d.staging.mode = "always" if staged else "never"
    where = RemotePrefill(f"127.0.0.1:{port}", "127.0.0.1", port, 0)  # a streamed request's params: the address
    job = LoadJob(tid, where, np.empty(0, np.int64), d.tables["shuffled"][1], d.args.tokens, 0, stream_id=tid)
    d.decode.submit(job)
    time.sleep(SETTLE_S)
    produce = {"op": "produce", "transfer_id": tid, "pool": "shuffled", "tokens": d.args.tokens, "chunk_s": chunk_s}
    ends = d.child.ask(produce)["chunk_ends"]
    result = d.result(tid)
    load_end = job.submitted_at + sum(v for k, v in result.phases.items() if k != "release")
    extra = {"read_s": result.seconds, "chunk_s": chunk_s, "writer_s": ends[-1] - ends[0] + chunk_s}
    return Sample(load_end - ends[-1], sum(result.bytes_by_kind.values()), result.runs, result.batches, extra)

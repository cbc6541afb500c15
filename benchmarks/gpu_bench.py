"""How glm-pd's handoff compares with raw NIXL and with the GPU's own copies, on one GPU (issue 28).

Two processes on one GPU, as ``tests/gpu/smoke.py`` runs them: this one is decode, a child (this module with
``--child``) is prefill. Both hold GLM-5.3 caches of ``--tokens`` (default 131,072: 7.17 GB a request) in glm-pd's
page layout, sized from ``layout.spec`` (nothing here restates a byte count the core computes). Rows, all from one
run so their ratios stand side by side:

- ``raw``: one NIXL descriptor of the request's byte count between two flat buffers, WRITE and READ (the ceiling);
- ``copy`` / ``gather``: the memory's own reference: a copy of the same bytes, and an ``index_select`` of the
  same bytes as shuffled main pages (``row_bytes`` × 64 tokens each), within this process;
- ``pull``: vLLM's path, ``DecodeService`` READing from ``PrefillService``, on a contiguous and a shuffled page
  pool, digests off and on. Its seconds are the read (every batch posted and waited for); ``load_s`` adds the
  claim's round trip and, with digests, prefill's digests and decode's check, so digests cost
  ``load_s(on) - load_s(off)``;
- ``push``: SGLang's path: prefill posts the request's plan as one batch of WRITEs (``Transport.post_plan(...,
  "WRITE")``, as ``glm_pd_sglang/transfer.py`` does per chunk), on both pools;
- ``streamed``: prefill's writer makes 16 chunks at a steady pace (a GPU sleep each, standing in for the forward;
  on host memory a host sleep), records each chunk's CUDA event and announces it with it
  (``advance_stream(..., ready=event)``), then grants the lease; decode loads with a ``stream_id``. Its seconds are
  the exposed handoff: decode's load end minus the last chunk's event (both on the system's monotonic clock).
  The pace defaults to the shuffled pull's read over 16, so prefill writes about as fast as the link moves it.

Each row is the median of ``--repeats`` runs (fewer where a row's runs pass ``--row-budget-s``), after warm-ups that
connect the agents and map every region. ``of ceiling`` is a row's rate over the faster raw rate, ``of raw op`` over
the raw rate of its own operation. The UCX path of each NIXL row is what ``UCX_PROTO_INFO=y`` printed for the agent
that posted it (its process's log, parsed by ``transport.datapath``). The issue's targets are printed beside the
measured ratios with PASS/FAIL, never asserted. Prints a table and writes JSON (``--json``, default
``benchmarks/results/gpu_bench.json``; also ``$OUT/gpu_bench.json`` when ``OUT`` is set) with the environment.

``--memory host`` runs every row on DRAM (small ``--tokens``): the same services, the CPU's copies. Run
``scripts/gpu_bench.sh`` on the GPU machine. Exit status: 0 ran, 77 skipped (no CUDA, torch, NIXL or a package).
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import dataclasses
import functools
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from glm_pd_common.layout.regions import Region
    from glm_pd_common.transport.base import Op
    from glm_pd_common.transport.datapath import Selection

SKIP_RC = 77
REPO = Path(__file__).resolve().parents[1]
PAGE_TOKENS = 64  # CUDA DSA pages (FACTS §2)
POOL_SLACK_PAGES = 64  # each side's pool holds this many pages more than the request
CHUNKS = 16  # streamed: 131,072 tokens in 8,192-token chunks, the engines' own prefill chunk on an H100/H200
SEED = 28
TIMEOUT_S = 120.0  # a transfer, a load, a child's answer
SETTLE_S = 0.3  # a streamed load subscribes meanwhile
DECODE, PREFILL = "bench-decode", "bench-prefill"  # engine ids
DECODE_AGENT, PREFILL_AGENT = DECODE + "-tp0", PREFILL + "-tp0"  # their services' NIXL agents
RAW_DECODE, RAW_PREFILL = "bench-raw-decode", "bench-raw-prefill"  # the flat buffers' agents
CHILD_TAG = "BENCH "

# Transfer modes measured on each pool, in order, each run by ``Bench.transfer``'s runner of that name. The staged
# path (pages gathered into a GPU staging buffer, then few descriptors on the wire) is being built now: its rows
# join as "staged" here (with its operation; digests off, both pools) and a runner beside ``pull`` and ``push``;
# the first target below already judges them, and the contiguous target takes every mode listed.
MODES: dict[str, Op] = {"pull": "READ", "push": "WRITE"}  # mode: the NIXL operation it posts
DIGEST_MODES: tuple[str, ...] = ("pull",)  # measured with digests on too (decode checks prefill's digests)
POOLS = ("contiguous", "shuffled")

# The issue's targets, printed beside the measured ratios (never asserted)
STAGED_SHUFFLED_MIN = 0.25  # of the raw one-descriptor ceiling
CONTIGUOUS_MIN = 0.90
DIGESTS_MAX = 0.05  # of the transfer's time
STREAMED_MAX = 0.15  # exposed handoff over pull's whole read


# -- pure helpers (tests/common/test_gpu_bench.py) ---------------------------------------------------------------
def page_tables(pages: int, pool_pages: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Prefill's and decode's page tables of one request per pool: ``contiguous`` (pages in order: one run per
    region) and ``shuffled`` (each side a random draw from its whole pool: hardly two neighbours merge)."""
    rng = np.random.default_rng(seed)
    ordered = np.arange(pages, dtype=np.int64)
    shuffled = (rng.permutation(pool_pages)[:pages], rng.permutation(pool_pages)[:pages])
    return {"contiguous": (ordered, ordered.copy()), "shuffled": shuffled}


def chosen_path(log: str, agent: str, op: str, memory: str) -> Selection | None:
    """What UCX printed (``UCX_PROTO_INFO=y``) for ``agent``'s latest ``op`` on ``memory`` to a peer: UCX names
    each table's endpoint after the worker, which NIXL names after the agent."""
    from glm_pd_common.transport.datapath import between_peers, parse

    mine = [s for s in parse(log) if s.endpoint.split(" ")[0] == agent]
    return between_peers(mine, op, memory)


@dataclass
class Row:
    case: str  # raw | copy | gather | a mode of MODES | streamed
    pool: str = ""  # contiguous | shuffled; "" where no page table is involved
    digests: bool = False
    op: str = ""  # READ | WRITE: the NIXL operation (which raw rate is its own); "" for the memory's copies
    bytes: int = 0
    seconds: float = 0.0  # the median run (streamed: the exposed handoff)
    runs: int = 0  # descriptors posted (copy: 1, gather: rows)
    batches: int = 0
    path: str = ""  # UCX's path for this row's operation in one word (datapath.PATHS), or the copy's engine
    path_detail: str = ""
    each_s: list[float] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)  # load_s, read_s, chunk_s, ...
    skipped: str = ""

    @property
    def gbps(self) -> float | None:
        if self.skipped or self.case == "streamed" or self.seconds <= 0:
            return None
        return self.bytes / self.seconds / 1e9


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None  # the ratio, or None where its rows were not measured
    limit: str  # e.g. ">= 90 %"
    ok: bool | None
    detail: str = ""


def raw_rates(rows: list[Row]) -> dict[str, float]:
    """GB/s of the raw one-descriptor rows, by operation."""
    return {r.op: r.gbps for r in rows if r.case == "raw" and r.gbps}


def ratios(row: Row, raw: dict[str, float]) -> tuple[float | None, float | None]:
    """(of the ceiling: the faster raw rate, of the raw rate of the row's own operation)."""
    if row.gbps is None or not raw:
        return None, None
    own = raw.get(row.op)
    return row.gbps / max(raw.values()), (row.gbps / own if own else None)


def _find(rows: list[Row], case: str, pool: str = "", digests: bool = False) -> Row | None:
    return next((r for r in rows if (r.case, r.pool, r.digests) == (case, pool, digests) and not r.skipped), None)


def _at_least(name: str, value: float | None, limit: float, missing: str) -> Target:
    if value is None:
        return Target(name, None, f">= {limit:.0%}", None, missing)
    return Target(name, value, f">= {limit:.0%}", value >= limit)


def _at_most(name: str, value: float | None, limit: float, missing: str) -> Target:
    if value is None:
        return Target(name, None, f"<= {limit:.0%}", None, missing)
    return Target(name, value, f"<= {limit:.0%}", value <= limit)


def targets(rows: list[Row], paths: list[tuple[str, str, str]]) -> list[Target]:
    """The issue's targets over the measured rows; ``paths``: (who and op, glm-pd's reported path, UCX's)."""
    raw = raw_rates(rows)

    def of_ceiling(row: Row | None) -> float | None:
        return None if row is None else ratios(row, raw)[0]

    staged = _find(rows, "staged", "shuffled")
    out = [_at_least("staged shuffled of raw", of_ceiling(staged), STAGED_SHUFFLED_MIN, "no staged rows (MODES)")]
    for mode in MODES:
        row = _find(rows, mode, "contiguous")
        out.append(_at_least(f"{mode} contiguous of raw", of_ceiling(row), CONTIGUOUS_MIN, "not measured"))
    for mode in DIGEST_MODES:
        for pool in POOLS:
            off, on = _find(rows, mode, pool), _find(rows, mode, pool, True)
            cost = None
            if off is not None and on is not None and off.seconds > 0:
                cost = (on.extra["load_s"] - off.extra["load_s"]) / off.seconds
            out.append(_at_most(f"{mode} {pool}: digests of transfer", cost, DIGESTS_MAX, "not measured"))
    streamed, pull = _find(rows, "streamed", "shuffled"), _find(rows, "pull", "shuffled")
    exposed = streamed.seconds / pull.seconds if streamed and pull and pull.seconds > 0 else None
    out.append(_at_most("streamed exposure of pull", exposed, STREAMED_MAX, "not measured"))
    for who, reported, observed in paths:
        ok = bool(observed) and reported == observed
        detail = f"glm-pd reports {reported!r}, UCX_PROTO_INFO shows {observed or 'no table'!r}"
        out.append(Target(f"{who}: reported path is UCX's", None, "equal", ok, detail))
    return out


# -- where the caches live ----------------------------------------------------------------------------------------
class HostKind:
    """DRAM caches (numpy), the CPU's copies, a host sleep per streamed chunk."""

    ucx = "host"  # UCX's name for the memory type in its tables
    engine = "numpy"

    def describe(self) -> dict[str, Any]:
        return {"memory": "host (DRAM)", "numpy": np.__version__}

    def caches(self, num_pages: int) -> Any:
        from glm_pd_common.tools.hostmem import HostCaches

        return HostCaches(spec(), page_tokens=PAGE_TOKENS, num_pages=num_pages)

    def flat(self, nbytes: int) -> tuple[Region, Any]:
        from glm_pd_common.tools.flat import flat_region

        buf = self.scratch(nbytes)
        return flat_region(buf), buf

    def endpoint_extras(self, regions: list[Region]) -> dict[str, Any]:
        return {}

    def scratch(self, nbytes: int) -> Any:
        return np.ones(nbytes, dtype=np.uint8)  # touched: no page faults inside a measurement

    def copy_s(self, dst: Any, src: Any) -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    def gather_s(self, dst: Any, src: Any, row_bytes: int, order: np.ndarray) -> float:
        rows = order.size
        t0 = time.perf_counter()
        np.take(
            src[: rows * row_bytes].reshape(rows, row_bytes),
            order,
            axis=0,
            out=dst[: rows * row_bytes].reshape(rows, row_bytes),
        )
        return time.perf_counter() - t0

    def pace(self, chunk_s: float) -> Pace:
        return HostPace(chunk_s)


class Pace(Protocol):
    """A streamed writer's clock: ``chunk`` makes one chunk and returns its ready event (None: ready now);
    ``finish`` waits for the last and gives every chunk's end on the monotonic clock."""

    def chunk(self) -> Any: ...

    def finish(self) -> list[float]: ...


class HostPace:
    """A streamed writer's chunks on the host: each ends after a sleep, announced at once (nothing to wait for)."""

    def __init__(self, chunk_s: float) -> None:
        self.chunk_s = chunk_s
        self.ends: list[float] = []

    def chunk(self) -> Any:
        time.sleep(self.chunk_s)
        self.ends.append(time.monotonic())
        return None

    def finish(self) -> list[float]:
        return self.ends


class CudaKind(HostKind):
    """VRAM caches (torch, one tensor per region as vLLM allocates them), torch's copies, a GPU sleep per chunk."""

    ucx = "cuda"
    engine = "torch"

    def __init__(self) -> None:
        import torch

        from tests.gpu.vram import cuda_device

        self.torch = torch
        self.device = cuda_device()
        self._cycles_per_s = 0.0

    def describe(self) -> dict[str, Any]:
        torch = self.torch
        return {
            "memory": f"cuda:{self.device.index} (VRAM)",
            "gpu": torch.cuda.get_device_name(self.device),
            "driver": _nvidia_smi("driver_version"),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
        }

    def caches(self, num_pages: int) -> Any:
        from tests.gpu.vram import VramCaches

        return VramCaches(spec(), page_tokens=PAGE_TOKENS, num_pages=num_pages, device=self.device)

    def flat(self, nbytes: int) -> tuple[Region, Any]:
        from glm_pd_common.tools.flat import flat_span

        buf = self.scratch(nbytes)
        return flat_span(buf.data_ptr(), nbytes, "VRAM", self.device.index), buf

    def endpoint_extras(self, regions: list[Region]) -> dict[str, Any]:
        from glm_pd_common.transport.devices import thread_device
        from glm_pd_common.transport.memory import reader_for

        return {
            "memory": reader_for([r.mem_kind for r in regions], self.torch),
            "on_thread": thread_device(regions, self.torch),
        }

    def scratch(self, nbytes: int) -> Any:
        return self.torch.ones(nbytes, dtype=self.torch.uint8, device=self.device)

    def _synced(self, work: Callable[[], object]) -> float:
        self.torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        work()
        self.torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def copy_s(self, dst: Any, src: Any) -> float:
        return self._synced(lambda: dst.copy_(src))

    def gather_s(self, dst: Any, src: Any, row_bytes: int, order: np.ndarray) -> float:
        rows = order.size
        index = self.torch.as_tensor(order, device=self.device)
        source, out = src[: rows * row_bytes].view(rows, row_bytes), dst[: rows * row_bytes].view(rows, row_bytes)
        return self._synced(lambda: self.torch.index_select(source, 0, index, out=out))

    def pace(self, chunk_s: float) -> Pace:
        if not self._cycles_per_s:
            from tests.gpu.prefill_child import sleep_cycles_per_s

            self._cycles_per_s = sleep_cycles_per_s()
        return CudaPace(self.torch, chunk_s, self._cycles_per_s)


class CudaPace:
    """A streamed writer's chunks on the GPU: a sleep kernel each, then an event that gates its announcement. The
    chunks' end times come from the events' timings against a start event synchronized on the host clock."""

    def __init__(self, torch: Any, chunk_s: float, cycles_per_s: float) -> None:
        self.torch = torch
        self.cycles = int(chunk_s * cycles_per_s)
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        self.start.synchronize()
        self.start_at = time.monotonic()
        self.events: list[Any] = []

    def chunk(self) -> Any:
        self.torch.cuda._sleep(self.cycles)
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return event

    def finish(self) -> list[float]:
        self.events[-1].synchronize()
        return [self.start_at + self.start.elapsed_time(e) / 1e3 for e in self.events]


def memory_kind(name: str) -> HostKind:
    return CudaKind() if name == "cuda" else HostKind()


def spec() -> Any:
    from glm_pd_common.layout.geometry import ModelGeometry
    from glm_pd_common.layout.spec import CacheSpec

    return CacheSpec.create(ModelGeometry.preset("glm-5.3"))


def _nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


# -- both processes --------------------------------------------------------------------------------------------
class UcxLog:
    """This process's UCX log, where ``UCX_PROTO_INFO=y`` prints its tables. UCX writes to the C ``stdout``: file
    descriptor 1 goes to ``path`` before UCX loads, and Python's ``sys.stdout`` to a copy of the old descriptor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        sys.stdout.flush()
        kept = os.dup(1)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.close(fd)
        sys.stdout = os.fdopen(kept, "w", buffering=1)

    def text(self) -> str:
        flush_c_stdio()
        return self.path.read_text(errors="replace")


def flush_c_stdio() -> None:
    """UCX's log lines sit in the C library's buffer until flushed."""
    ctypes.CDLL(None).fflush(None)


def transports(kind: HostKind, caches: Any, flat: Region, names: tuple[str, str], posts: Op) -> tuple[Any, Any]:
    """A flat buffer's raw agent and the caches' service agent (``posts``: its operation, whose GPU path it probes
    at registration and reports)."""
    from glm_pd_common.transport.base import TransportConfig
    from glm_pd_common.transport.factory import create_transport

    raw = create_transport(names[0], TransportConfig(allow_tcp=True, timeout_s=TIMEOUT_S))
    raw.register([flat])
    service = create_transport(names[1], TransportConfig(allow_tcp=True, timeout_s=TIMEOUT_S, posts=posts))
    service.register(caches.regions)
    return raw, service


def endpoint(engine_id: str, kind: HostKind, caches: Any, transport: Any) -> Any:
    from glm_pd_common.handoff.wire.handshake import Endpoint
    from glm_pd_common.layout.fingerprint import PeerShape

    extras = kind.endpoint_extras(caches.regions)
    return Endpoint(engine_id, spec(), caches.regions, transport, PeerShape(PAGE_TOKENS, 1, 0), **extras)


def span_of(region: Region) -> list[Any]:
    return [region.base_addr, region.size_bytes, region.mem_kind, region.device_id]


# -- the prefill child ------------------------------------------------------------------------------------------
class Prefill:
    """The child: caches and a flat buffer, ``PrefillService`` (streamed) and the commands the parent sends."""

    def __init__(self, job: dict[str, Any]) -> None:
        from glm_pd_common.handoff.prefill.service import PrefillService

        self.kind = memory_kind(job["memory"])
        self.caches = self.kind.caches(job["pool_pages"])
        self.flat, self._flat_buf = self.kind.flat(job["bytes"])
        self.raw, self.transport = transports(self.kind, self.caches, self.flat, (RAW_PREFILL, PREFILL_AGENT), "WRITE")
        local = endpoint(PREFILL, self.kind, self.caches, self.transport)
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
            return self.push(cmd["pool"], cmd["tokens"])
        if op == "open_stream":
            self.service.open_stream(cmd["transfer_id"], cmd["tokens"])
            return {}
        if op == "produce":
            return self.produce(cmd["transfer_id"], cmd["pool"], cmd["tokens"], cmd["chunk_s"])
        if op == "finished":
            self.ended += self.service.finished()
            return {"outcomes": sorted({f.outcome for f in self.ended}), "leftovers": self.service.leftovers()}
        raise ValueError(f"unknown command {op!r}")

    def push(self, pool: str, tokens: int) -> dict[str, Any]:
        """SGLang's posting: prefill's plan into decode's pages, WRITE, one batch (one chunk of the whole request)."""
        from glm_pd_common.layout.pages import num_pages_for
        from glm_pd_common.layout.plan import build_plan

        pages = num_pages_for(tokens, PAGE_TOKENS)
        src, dst = (t[:pages] for t in self.tables[pool])
        plan = build_plan(self.caches.regions, self.decode_regions, src, dst, num_tokens=tokens, prefix_tokens=0)
        agent = DECODE_AGENT  # loaded by the service's handshake with decode
        t0 = time.perf_counter()
        xfer = self.transport.post_plan(agent, plan, "WRITE")
        try:
            self.transport.wait(xfer)
        finally:
            self.transport.release(xfer)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "bytes": sum(xfer.completed_bytes_by_kind.values()), "runs": plan.num_runs}

    def produce(self, transfer_id: str, pool: str, tokens: int, chunk_s: float) -> dict[str, Any]:
        """The streamed writer: ``CHUNKS`` chunks at ``chunk_s`` each, each announced behind its ready event, then
        the lease; answers once the last chunk's event completed, with every chunk's end on the monotonic clock."""
        table = self.tables[pool][0]
        pace = self.kind.pace(chunk_s)
        step = -(-tokens // CHUNKS)
        done = 0
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


def say(obj: dict[str, Any]) -> None:
    flush_c_stdio()  # the parent reads this process's UCX log once it has the answer
    sys.stdout.write(CHILD_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def child_main(job: dict[str, Any]) -> int:
    """Serve the parent's commands (a JSON line each, answered by one) until stdin closes or ``exit``. Between
    commands the raw agent is progressed: a peer's operation on it completes only while it is polled."""
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


# -- the decode parent ------------------------------------------------------------------------------------------
class Child:
    """The prefill process, spoken to by JSON lines; killed if it does not leave when told."""

    def __init__(self, job: dict[str, Any]) -> None:
        from tests.support.lines import LineReader

        cmd = [sys.executable, "-m", "benchmarks.gpu_bench", "--child", json.dumps(job)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.lines = LineReader(self.proc.stdout)  # type: ignore[arg-type]  # a PIPE: never None
        self.hello = self._read(300, None)

    def _read(self, timeout_s: float, progress: Callable[[], object] | None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            wait_s = 0.002 if progress is not None else timeout_s
            try:
                line = self.lines.next_matching(lambda ln: ln.startswith(CHILD_TAG), wait_s)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the prefill process did not answer within {timeout_s:.0f} s") from None
                if progress is not None:
                    progress()
        if line is None:
            raise RuntimeError(f"the prefill process exited (rc {self.proc.wait()})")
        answer = json.loads(line[len(CHILD_TAG) :])
        if "error" in answer:
            raise RuntimeError(f"prefill: {answer['error']}")
        return answer

    def ask(self, cmd: dict[str, Any], progress: Callable[[], object] | None = None) -> dict[str, Any]:
        """``cmd``'s answer; ``progress`` runs while waiting (decode's agent, when prefill WRITEs into it)."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read(TIMEOUT_S * 2, progress)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Sample:
    seconds: float
    bytes: int
    runs: int
    batches: int = 1
    extra: dict[str, float] = field(default_factory=dict)


class Bench:
    """Decode's side and the rows, in one run."""

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
        job = {
            "memory": args.memory,
            "pages": self.pages,
            "pool_pages": self.pool_pages,
            "bytes": self.nbytes,
            "seed": SEED,
            "ucx_log": str(self.child_log),
        }
        self.child = Child(job)
        try:
            self.raw, self.transport = transports(self.kind, self.caches, self.flat, (RAW_DECODE, DECODE_AGENT), "READ")
            self.decode = DecodeService(
                endpoint(DECODE, self.kind, self.caches, self.transport), timeout_s=TIMEOUT_S, verify_digests=False
            )
        except BaseException:
            self.child.close()
            raise
        self.rows: list[Row] = []
        self._ids = 0
        self.setup_s = time.monotonic() - self.started

    # -- set-up and warm-ups --------------------------------------------------------------------------------
    def connect(self) -> None:
        """Each raw agent loads the other; one small pull (digests on, then off) handshakes the services and maps
        every region; one small push and raw op each way warm their paths. Nothing of this is measured."""
        from glm_pd_common.transport.base import Span

        hello = self.child.hello
        self.raw_peer = self.raw.add_peer(base64.b64decode(hello["raw_metadata"]), [Span("flat", *hello["raw_span"])])
        self.child.ask(
            {"op": "raw_peer", "metadata": base64.b64encode(self.raw.metadata()).decode(), "span": span_of(self.flat)}
        )
        self.remote_span = Span("flat", *hello["raw_span"])
        for digests in (True, False):
            self.load("contiguous", digests, pages=1)
        addrs = [r.base_addr for r in self.caches.regions]
        self.child.ask({"op": "decode_regions", "addrs": addrs, "device_id": self.caches.regions[0].device_id})
        self.child.ask({"op": "push", "pool": "contiguous", "tokens": PAGE_TOKENS}, self.transport.notifs)
        self.raw_op("WRITE", 4096)
        self.raw_op("READ", 4096)

    # -- the rows -------------------------------------------------------------------------------------------
    def measure(self, row: Row, run: Callable[[], Sample]) -> None:
        """``run`` up to ``--repeats`` times while the row's budget lasts (once at least), unless the run's
        deadline passed; the row gets the median run's figures. A row that fails says why; the others still run."""
        self.rows.append(row)
        if time.monotonic() - self.started > self.args.deadline_s:
            row.skipped = f"out of time (--deadline-s {self.args.deadline_s:.0f})"
            return
        samples: list[Sample] = []
        began = time.monotonic()
        try:
            while len(samples) < self.args.repeats:
                samples.append(run())
                spent = time.monotonic() - began
                if spent + spent / len(samples) > self.args.row_budget_s:
                    break
        except Exception as exc:  # reported in the row, as a bench reports (nothing here is asserted)
            row.skipped = f"failed: {type(exc).__name__}: {exc}"[:400]
            return
        median = sorted(samples, key=lambda s: s.seconds)[(len(samples) - 1) // 2]
        row.seconds, row.bytes, row.runs, row.batches = median.seconds, median.bytes, median.runs, median.batches
        row.each_s, row.extra = [s.seconds for s in samples], median.extra

    def raw_op(self, op: Op, nbytes: int) -> Sample:
        t0 = time.perf_counter()
        xfer = self.raw.post(
            self.raw_peer,
            op,
            np.array([self.flat.base_addr]),
            np.array([self.remote_span.base_addr]),
            np.array([nbytes]),
        )
        try:
            self.raw.wait(xfer)
        finally:
            self.raw.release(xfer)
        return Sample(time.perf_counter() - t0, nbytes, 1)

    def references(self) -> None:
        """The memory's own copies of the request's bytes: one copy, and a gather of shuffled main pages."""
        row_bytes = spec().row.row_bytes * PAGE_TOKENS
        rows = self.nbytes // row_bytes
        order = np.random.default_rng(SEED).permutation(rows)
        scratch = self.kind.scratch(self.nbytes)
        engine = self.kind.engine
        self.measure(Row("copy", path=engine), lambda: Sample(self.kind.copy_s(scratch, self.flat_buf), self.nbytes, 1))
        gather = Row("gather", pool="shuffled", path=engine, path_detail=f"{rows} rows of {row_bytes} B")
        self.measure(
            gather, lambda: Sample(self.kind.gather_s(scratch, self.flat_buf, row_bytes, order), rows * row_bytes, rows)
        )

    def load(self, pool: str, digests: bool, pages: int | None = None) -> Sample:
        """One pull: prefill grants, decode loads (``pages``: fewer than the request's, for a warm-up)."""
        from glm_pd_common.handoff.decode.loads import LoadJob, RemotePrefill

        pages = pages or self.pages
        self._ids += 1
        rid = f"pull-{self._ids}"
        self.child.ask({"op": "grant", "request_id": rid, "pool": pool, "pages": pages})
        self.decode.verify_digests = digests  # read by each claim: one service, one link, both settings
        src, dst = (t[:pages] for t in self.tables[pool])
        remote = RemotePrefill(PREFILL, "127.0.0.1", self.child.hello["port"], 1)
        tokens = min(pages * PAGE_TOKENS, self.args.tokens)
        self.decode.submit(LoadJob(rid, remote, src, dst, tokens, 0))
        result = self.result(rid)
        load_s = result.phases.get("claim", 0.0) + result.phases.get("pull", 0.0)
        return Sample(
            result.seconds, sum(result.bytes_by_kind.values()), result.runs, result.batches, {"load_s": load_s}
        )

    def result(self, request_id: str) -> Any:
        deadline = time.monotonic() + TIMEOUT_S * 1.5
        while time.monotonic() < deadline:
            for result in self.decode.results(0.05):
                if result.request_id == request_id:
                    if not result.ok:
                        raise RuntimeError(f"load {request_id} failed ({result.code}): {result.reason}")
                    return result
        raise TimeoutError(f"no result for load {request_id} within {TIMEOUT_S * 1.5:.0f} s")

    def push(self, pool: str) -> Sample:
        got = self.child.ask({"op": "push", "pool": pool, "tokens": self.args.tokens}, self.transport.notifs)
        return Sample(got["seconds"], got["bytes"], got["runs"])

    def streamed(self, chunk_s: float) -> Sample:
        """One streamed load of the shuffled pool: decode subscribes, prefill writes and announces its chunks."""
        from glm_pd_common.handoff.decode.loads import LoadJob, RemotePrefill

        self._ids += 1
        tid, port = f"stream-{self._ids}", self.child.hello["port"]
        self.child.ask({"op": "open_stream", "transfer_id": tid, "tokens": self.args.tokens})
        self.decode.verify_digests = False
        where = RemotePrefill(f"127.0.0.1:{port}", "127.0.0.1", port, 0)  # a streamed request's params: the address
        dst = self.tables["shuffled"][1]
        job = LoadJob(tid, where, np.empty(0, np.int64), dst, self.args.tokens, 0, stream_id=tid)
        self.decode.submit(job)
        time.sleep(SETTLE_S)
        ends = self.child.ask(
            {"op": "produce", "transfer_id": tid, "pool": "shuffled", "tokens": self.args.tokens, "chunk_s": chunk_s}
        )["chunk_ends"]
        result = self.result(tid)
        load_end = job.submitted_at + sum(v for k, v in result.phases.items() if k != "release")
        extra = {"read_s": result.seconds, "chunk_s": chunk_s, "writer_s": ends[-1] - ends[0] + chunk_s}
        return Sample(load_end - ends[-1], sum(result.bytes_by_kind.values()), result.runs, result.batches, extra)

    def transfer(self, mode: str, pool: str, digests: bool) -> Sample:
        runners: dict[str, Callable[[], Sample]] = {
            "pull": lambda: self.load(pool, digests),
            "push": lambda: self.push(pool),
        }
        return runners[mode]()

    def run(self) -> None:
        self.connect()
        self.measure(Row("raw", op="WRITE"), functools.partial(self.raw_op, "WRITE", self.nbytes))
        self.measure(Row("raw", op="READ"), functools.partial(self.raw_op, "READ", self.nbytes))
        self.references()
        for mode, op in MODES.items():
            for pool in POOLS:
                for digests in (False, True) if mode in DIGEST_MODES else (False,):
                    row = Row(mode, pool=pool, digests=digests, op=op)
                    self.measure(row, functools.partial(self.transfer, mode, pool, digests))
        pull = _find(self.rows, "pull", "shuffled")
        chunk_s = self.args.chunk_ms / 1e3 if self.args.chunk_ms else (pull.seconds / CHUNKS if pull else 0.05)
        self.measure(Row("streamed", pool="shuffled", op="READ"), lambda: self.streamed(chunk_s))
        self.attribute_paths()

    def attribute_paths(self) -> None:
        """Each NIXL row's path: what UCX printed for the agent that posted it (its process's log)."""
        mine, theirs = self.log.text(), self.child_log.read_text(errors="replace")
        for row in self.rows:
            if not row.op or row.skipped:
                continue
            log, agent = {"raw": (mine, RAW_DECODE), "push": (theirs, PREFILL_AGENT)}.get(
                row.case, (mine, DECODE_AGENT)
            )
            chosen = chosen_path(log, agent, row.op, self.kind.ucx)
            if chosen is None:
                row.path = "no UCX table"
            else:
                row.path, row.path_detail = chosen.path, f"{chosen.protocol} over {', '.join(chosen.transports)}"

    def paths(self) -> list[tuple[str, str, str]]:
        """(who and op, glm-pd's reported path, UCX's) for decode's READs and prefill's WRITEs."""
        out = []
        for who, reported, log, agent, op in (
            ("decode READ", self.transport.info().path, self.log.text(), DECODE_AGENT, "READ"),
            (
                "prefill WRITE",
                self.child.hello["reported_path"],
                self.child_log.read_text(errors="replace"),
                PREFILL_AGENT,
                "WRITE",
            ),
        ):
            chosen = chosen_path(log, agent, op, self.kind.ucx)
            out.append((who, reported, chosen.path if chosen else ""))
        return out

    def close(self) -> None:
        self.decode.close()
        self.child.close()
        self.transport.close()
        self.raw.close()

    def report(self) -> dict[str, Any]:
        s = spec()
        g = s.geometry
        main = [r for r in self.caches.regions if r.kind == "main"]
        indexer = [r for r in self.caches.regions if r.kind == "indexer"]
        raw = raw_rates(self.rows)
        rows = []
        for row in self.rows:
            of_ceiling, of_op = ratios(row, raw)
            rows.append({**dataclasses.asdict(row), "gbps": row.gbps, "of_ceiling": of_ceiling, "of_raw_op": of_op})
        return {
            "environment": environment(self.kind),
            "geometry": {
                "model": "glm-5.3",
                "cache_dtype": s.cache_dtype,
                "main_regions": len(main),
                "main_bytes_per_token": s.row.row_bytes,
                "indexer_regions": len(indexer),
                "indexer_bytes_per_token": s.indexer.row_bytes,
                "layers": len(g.all_layers),
                "tokens": self.args.tokens,
                "page_tokens": PAGE_TOKENS,
                "pages": self.pages,
                "pool_pages": self.pool_pages,
                "bytes_per_request": self.nbytes,
            },
            "setup_s": round(self.setup_s, 2),
            "total_s": round(time.monotonic() - self.started, 2),
            "repeats": self.args.repeats,
            "modes": dict(MODES),
            "rows": rows,
            "targets": [dataclasses.asdict(t) for t in targets(self.rows, self.paths())],
            "data_paths": {"decode": self.transport.info().data_path, "prefill": self.child.hello["data_path"]},
            "prefill_end": self.child.ask({"op": "finished"}),
            "decode_leftovers": self.decode.leftovers(),
        }


def environment(kind: HostKind) -> dict[str, Any]:
    return {
        **kind.describe(),
        "python": sys.version.split()[0],
        "nixl": _version("nixl"),
        "nixl_cu": _version("nixl-cu13") if _version("nixl-cu13") != "unknown" else _version("nixl-cu12"),
        "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
    }


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


# -- output -----------------------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def print_report(report: dict[str, Any]) -> None:
    env, geo = report["environment"], report["geometry"]
    print(
        f"{env.get('gpu', env['memory'])}, driver {env.get('driver', '-')}, torch {env.get('torch', '-')}, "
        f"nixl {env['nixl']}; UCX env {env['ucx_env'] or '(none)'}"
    )
    print(
        f"{geo['model']} {geo['cache_dtype']}: {geo['main_regions']} main regions × "
        f"{geo['main_bytes_per_token']} B/token, {geo['indexer_regions']} indexer × "
        f"{geo['indexer_bytes_per_token']} B/token; {geo['tokens']:,} tokens = "
        f"{geo['bytes_per_request'] / 1e9:.2f} GB; pool {geo['pool_pages']} pages of {geo['page_tokens']}; "
        f"setup {report['setup_s']} s, total {report['total_s']} s"
    )
    print(
        f"{'row':<9} {'pool':<10} {'dig':<3} {'op':<5} {'MB':>9} {'runs':>8} {'batch':>5} {'seconds':>9} "
        f"{'GB/s':>8} {'of ceil':>8} {'of op':>7}  UCX path"
    )
    for r in report["rows"]:
        head = f"{r['case']:<9} {r['pool']:<10} {'on' if r['digests'] else 'off':<3} {r['op']:<5}"
        if r["skipped"]:
            print(f"{head} skipped: {r['skipped']}")
            continue
        gbps = "—" if r["gbps"] is None else f"{r['gbps']:.2f}"
        note = ", ".join(f"{k} {v:.4f}" for k, v in r["extra"].items())
        print(
            f"{head} {r['bytes'] / 1e6:>9.1f} {r['runs']:>8,} {r['batches']:>5} {r['seconds']:>9.4f} {gbps:>8} "
            f"{_pct(r['of_ceiling']):>8} {_pct(r['of_raw_op']):>7}  {r['path']}"
            + (f": {r['path_detail']}" if r["path_detail"] else "")
            + (f"  ({note})" if note else "")
        )
    print(f"{'target':<38} {'measured':>9} {'limit':>7}  verdict")
    for t in report["targets"]:
        verdict = "n/a" if t["ok"] is None else ("PASS" if t["ok"] else "FAIL")
        print(
            f"{t['name']:<38} {_pct(t['measured']):>9} {t['limit']:>7}  {verdict}"
            + (f"  {t['detail']}" if t["detail"] else "")
        )


def unavailable(memory: str) -> str | None:
    """Why the bench cannot run here, or None (on a GPU: the smoke's reasons)."""
    if memory == "cuda":
        from tests.gpu.smoke import unavailable as gpu_unavailable

        return gpu_unavailable()
    for module in ("msgspec", "xxhash", "zmq", "nixl._api"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{module} is not importable ({exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--tokens", type=int, default=131_072, help="tokens of the request (64-token pages)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row, the median reported")
    parser.add_argument("--row-budget-s", type=float, default=20.0, help="no further run of a row past this")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="rows not started by then are skipped")
    parser.add_argument("--chunk-ms", type=float, default=0.0, help="streamed chunk pace (default: pull's / 16)")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks/results/gpu_bench.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    os.environ.setdefault("UCX_PROTO_INFO", "y")  # before UCX loads, here and in the child
    reason = unavailable(args.memory)
    if reason is not None:
        print(f"SKIPPED: {reason}")
        return SKIP_RC
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still closes the child
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as workdir:
        bench = Bench(args, Path(workdir))
        try:
            bench.run()
            report = bench.report()
        finally:
            bench.close()
    print_report(report)
    paths = [args.json] + ([Path(os.environ["OUT"]) / "gpu_bench.json"] if os.environ.get("OUT") else [])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        print(f"JSON written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

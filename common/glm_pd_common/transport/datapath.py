"""What UCX really chose to move bytes, read from its own ``UCX_PROTO_INFO=y`` tables, and whether glm-pd takes it.

UCX prints one table the first time it selects protocols for an operation between two memory types: a header
naming the operation (``remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0]``), then rows of
message-size range | protocol | transports. KV pages are kilobytes and more, so the row that reaches ``inf`` is
the path the bulk of a handoff takes. The layout differs between UCX releases (the operation on the endpoint's
row or on a row of its own, a ``Range | Description | Config`` title or none): only the cells are read.

A GPU cache moves well by ``cuda_ipc`` (one node) or an RDMA transport (GPUDirect); ``software emulation`` (UCX
runs the RMA as messages, e.g. READ between GPUs without NVLink) or plain tcp moves it at a fraction of a GB/s,
and nothing else says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Collection
from dataclasses import dataclass

from glm_pd_common.transport.base import ALLOW_TCP, Op

_OPERATION = re.compile(
    r"remote memory (?P<op>read|write) by ucp_(?:get|put)\*(?:\([^)]*\))? "
    r"(?:into|from) (?P<local>[a-z]+)[^ ]* (?:memory )?(?:from|to) (?P<remote>[a-z]+)"
)
_RANGE = re.compile(r"^(?:\d+(?:\.\d+)?[KMGT]?|inf)(?:\.\.(?:\d+(?:\.\d+)?[KMGT]?|inf))?$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*/[A-Za-z0-9_:.\-\[\]]+)")
_EMULATION = "software emulation"
RDMA_TRANSPORTS = ("rc", "dc", "ud", "srd")  # verbs (mlx5 and generic) and EFA
SHARED_MEMORY = ("cma", "sysv", "posix", "knem", "xpmem", "self")


# The path in one word, as metrics label it: what UCX chose for GPU memory, else RDMA or TCP by the transport's devices
PATHS = ("rdma", "cuda_ipc", "shared memory", "tcp", "emulation", "unknown")


@dataclass(frozen=True)
class Selection:
    """UCX's choice for the largest messages of one operation between two memory types."""

    endpoint: str  # UCX's endpoint configuration, e.g. "ucp_context_0 intra-node cfg#1"
    operation: str  # "READ" (ucp_get) or "WRITE" (ucp_put), as NIXL names them
    local: str  # memory type of this side's buffer: host, cuda, rocm
    remote: str  # of the peer's
    protocol: str  # UCX's words, e.g. "zero-copy", "software emulation", "multi-frag copy-in"
    transports: tuple[str, ...]  # e.g. ("cuda_ipc/cuda",), ("tcp/lo", "tcp/eth0")

    @property
    def path(self) -> str:
        """The path in one word: cuda_ipc, rdma, shared memory, tcp or emulation (UCX's own fallback)."""
        if _EMULATION in self.protocol:
            return "emulation"
        names = {t.split("/")[0] for t in self.transports}  # rc_mlx5, cuda_ipc, tcp, cma, ...
        if any(n.split("_")[0] in RDMA_TRANSPORTS for n in names):
            return "rdma"
        if "cuda_ipc" in names:
            return "cuda_ipc"
        if "tcp" in names:
            return "tcp"
        return "shared memory" if names & set(SHARED_MEMORY) else "unknown"

    def describe(self) -> str:
        return (
            f"{self.operation} {self.local}->{self.remote}: {self.protocol} over {', '.join(self.transports) or '?'} "
            f"({self.endpoint})"
        )


def _cells(line: str) -> list[str]:
    """A table row's cells (a row copied without its closing bar too); [] for any other line."""
    if "|" not in line:
        return []
    row = line[line.index("|") + 1 :].rstrip()
    return [c.strip() for c in row.removesuffix("|").split("|")] if row.strip() else []


def parse(text: str) -> list[Selection]:
    """Every READ/WRITE table in ``text`` (UCX's log, any prefix per line), in order, by its bulk row."""
    out: list[Selection] = []
    endpoint, header, bulk = "", None, None
    for line in text.splitlines():
        cells = _cells(line)
        if not cells:
            continue
        found = next((m for c in cells if (m := _OPERATION.search(c))), None)
        if found is not None or (len(cells) == 1 and "cfg#" in cells[0]):
            if header is not None and bulk is not None:
                out.append(Selection(endpoint, *header, *bulk))
            header, bulk = None, None
            if "cfg#" in cells[0]:
                endpoint = cells[0]
            if found is not None:
                op = "READ" if found["op"] == "read" else "WRITE"
                header = (op, found["local"], found["remote"])
            continue
        if header is not None and len(cells) == 3 and _RANGE.match(cells[0]):
            protocol = cells[1].removeprefix("(?) ")
            transports = tuple(m.group(1) for m in _TRANSPORT.finditer(cells[2]))
            if cells[0].endswith("inf"):
                bulk = (protocol, transports)
    if header is not None and bulk is not None:
        out.append(Selection(endpoint, *header, *bulk))
    return out


def between_peers(selections: list[Selection], operation: str, memory: str) -> Selection | None:
    """The latest choice for ``operation`` on ``memory`` at both ends, to a peer (an agent's endpoint to itself,
    ``self``, is not what moves a handoff)."""
    matching = [
        s
        for s in selections
        if s.operation == operation and s.local == memory and s.remote == memory and " self " not in f" {s.endpoint} "
    ]
    return matching[-1] if matching else None


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    detail: str
    fix: str = ""
    intra_node: bool = False  # accepted for peers on this node only (GPU memory by cuda_ipc, no RDMA NIC)

    def message(self) -> str:
        return f"{self.detail}. Fix: {self.fix}" if self.fix else self.detail


def judge_gpu_path(selection: Selection, allow_tcp: bool) -> Verdict:
    """cuda_ipc and RDMA carry GPU caches; emulation and tcp are refused unless the operator allowed TCP."""
    detail = f"UCX moves GPU memory by {selection.describe()}"
    if selection.path in ("cuda_ipc", "rdma"):
        return Verdict(True, detail)
    if selection.path == "emulation" and selection.operation == "READ":
        fix = (
            "READ between GPUs without NVLink: UCX_RMA_PPLN_ENABLE=y (or UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y) lets "
            "cuda_ipc serve it; between hosts set UCX_NET_DEVICES to the RDMA ports and install the NIC driver"
        )
    else:
        fix = "set UCX_NET_DEVICES to the RDMA ports (e.g. mlx5_0:1), install the NIC driver and GPUDirect RDMA"
    if allow_tcp:
        return Verdict(True, detail + " (allowed: allow_tcp)", fix)
    return Verdict(False, detail + ": a fraction of a GB/s", fix + "; or accept it explicitly with allow_tcp")


def observe(memory: str, device: int = 0, timeout_s: float = 90.0) -> tuple[list[Selection], str]:
    """What UCX picks for a loopback READ and WRITE on ``memory`` (GPU ``device``) between two child processes
    of this node, run with UCX_PROTO_INFO=y (``glm_pd_common.tools.ucxprobe``); and why not, if the probe failed.
    Within one node only: between nodes UCX chooses among the NICs instead."""
    env = dict(os.environ, UCX_PROTO_INFO="y", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "glm_pd_common.tools.ucxprobe", "--memory", memory, "--device", str(device)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [], f"the loopback probe did not finish in {timeout_s:.0f} s"
    text = proc.stdout + proc.stderr
    return parse(text), "" if proc.returncode == 0 else f"probe exited {proc.returncode}: {text[-400:]}"


_RDMA_FIX = "install the NIC driver and rdma-core and expose /dev/infiniband (and the RDMA transports in UCX_TLS)"


def judge_without_rdma(
    why: str,
    memory_kinds: Collection[str],
    posts: Op | None,
    chosen: Selection | None,
    probe_error: str = "",
) -> Verdict:
    """A NIXL rank without an RDMA transport (``why``) and without allow_tcp. Host caches would move over tcp:
    refused. GPU caches move by cuda_ipc between processes of one node with no NIC at all, so they are accepted
    for peers on this node only (``intra_node``): for the operation this rank ``posts``, where the loopback probe
    saw UCX ``chosen`` take it (emulation or tcp refused as ``judge_gpu_path`` says; a probe that saw nothing
    refused, naming ``probe_error``); a rank that only serves its peer's operation leaves that to the peer."""
    if "VRAM" not in memory_kinds:
        return Verdict(
            False,
            f"UCX would move KV over TCP ({why}; the caches are in host memory): at ~1 GB/s a silent 50x slowdown",
            f"{_RDMA_FIX}; or allow TCP explicitly: {ALLOW_TCP}",
        )
    node_only = "peers on this node only (cuda_ipc needs no NIC; between nodes UCX would take tcp)"
    if posts is None:
        return Verdict(True, f"{why}: GPU memory served to {node_only}; the posting peer observes its path", "", True)
    if chosen is None:
        return Verdict(
            False,
            f"{why}, and the path UCX takes for {posts} between GPU buffers could not be observed "
            f"({probe_error or 'UCX printed no table for it'}): it may be tcp",
            f"run glm-pd doctor on this node to see the probe; {_RDMA_FIX}; or allow TCP explicitly: {ALLOW_TCP}",
        )
    verdict = judge_gpu_path(chosen, allow_tcp=False)
    if not verdict.accepted:
        return Verdict(False, f"{why}; {verdict.detail}", verdict.fix)
    return Verdict(True, f"{why}; {verdict.detail}: {node_only}", "", True)

"""The one transport interface the adapters use, and the checks every backend shares.

A backend moves bytes between registered regions of two agents; it never decides which bytes (the plan
does). Before any run is posted, every run is checked to lie inside a registered local region and inside
a region the peer announced; the peer's metadata blob is framed with a digest, so a corrupted or truncated
blob is refused here instead of reaching the library (a damaged NIXL blob can abort the process).
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np
import xxhash

from glm_pd_common.decoding import decode_as
from glm_pd_common.errors import ConfigError, ProtocolError, TransferFailed
from glm_pd_common.layout.plan import RegionRuns, TransferPlan
from glm_pd_common.layout.regions import Region
from glm_pd_common.transport.node import node_id

Op = Literal["READ", "WRITE"]
BACKENDS = ("nixl", "mooncake")


@dataclass(frozen=True)
class TransportConfig:
    """What a deployment chooses; parsed once from the engine's config (unknown keys refused upstream)."""

    backend: str = "nixl"
    host: str = "127.0.0.1"
    allow_tcp: bool = False
    timeout_s: float = 60.0
    devices: str = ""  # RDMA device names (Mooncake device_name / UCX ucx_devices), comma separated
    # The operation this rank posts (vLLM decode READs, SGLang prefill WRITEs): where its caches are in GPU memory,
    # the path UCX picks for it is observed when they are registered, and refused as ``datapath`` says.
    posts: Op | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"transport backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"transport timeout_s must be positive, got {self.timeout_s}")


@dataclass(frozen=True)
class TransportInfo:
    """What the library actually uses, reported so a silent TCP fallback is visible."""

    backend: str
    version: str
    data_path: str
    path: str  # ``datapath.PATHS``: the path in one word
    rdma: bool
    rdma_devices: tuple[str, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Span:
    """A registered address range (a local cache region, an engine's side buffer, or one a peer announced)."""

    name: str
    base_addr: int
    size_bytes: int
    mem_kind: str = "DRAM"
    device_id: int = 0


@dataclass
class Transfer:
    """One posted batch; backends keep their own handle in ``handle``."""

    peer: str
    op: Op
    num_runs: int
    num_bytes: int  # the descriptor lengths posted
    what: str
    handle: Any = None  # backend-specific (NIXL handles, a mooncake Future): each backend knows its own
    bytes_by_kind: dict[str, int] = field(default_factory=dict)  # posted descriptor lengths by region kind
    completed: bool = False  # set by ``poll`` once the backend reports the whole batch done

    @property
    def completed_bytes_by_kind(self) -> dict[str, int]:
        """What this batch moved, as the transport reported it: its posted lengths once done, else nothing."""
        return dict(self.bytes_by_kind) if self.completed else {}


class _Blob(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: str
    agent_name: str
    node: str  # ``node.node_id()`` of the agent's host: a transport limited to its own node compares it
    payload: bytes
    digest: int  # ``_digest(node, payload)``: a damaged frame is refused before the library sees the payload


def _digest(node: str, payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(node.encode()))


def rdma_devices() -> tuple[str, ...]:
    """RDMA devices the kernel exposes (what both UCX and Mooncake would find)."""
    try:
        return tuple(sorted(os.listdir("/sys/class/infiniband")))
    except OSError:
        return ()


# What lifts a refusal for want of RDMA, in each engine's words
ALLOW_TCP = (
    'glm-pd demo --allow-tcp; vLLM kv_connector_extra_config {"allow_tcp": true}; SGLang SGLANG_GLM_PD_ALLOW_TCP=1'
)


def tcp_refusal(backend: str, why: str) -> ConfigError:
    return ConfigError(
        f"{backend} would move KV over TCP ({why}); at ~1 GB/s that is a silent 50x slowdown. "
        f"Fix the RDMA set-up, or allow TCP explicitly: {ALLOW_TCP}."
    )


@dataclass(frozen=True)
class Placement:
    """Where one side's runs of a batch live. NIXL describes every run with its memory kind and the device it
    was registered on: a descriptor naming another device than its registration is not found."""

    mem_kind: str
    device_ids: np.ndarray  # one per run, uint64


def place_runs(addrs: np.ndarray, lengths: np.ndarray, spans: Sequence[Span], *, where: str) -> Placement:
    """Refuse any run that is not wholly inside one span, else say where each lives (vectorized: no per-run
    Python loop). One batch is one memory kind per side, as the libraries take it."""
    if addrs.size == 0:
        return Placement("DRAM", np.zeros(0, dtype=np.uint64))
    if not spans:
        raise TransferFailed(f"{where}: no registered regions to check {addrs.size} runs against")
    ordered = sorted(spans, key=lambda s: s.base_addr)
    bases = np.array([s.base_addr for s in ordered], dtype=np.int64)
    ends = bases + np.array([s.size_bytes for s in ordered], dtype=np.int64)
    idx = np.searchsorted(bases, addrs, side="right") - 1
    inside = (idx >= 0) & (lengths >= 0)
    inside &= addrs + lengths <= ends[np.clip(idx, 0, None)]
    if not np.all(inside):
        bad = int(np.argmin(inside))
        near = ordered[max(int(idx[bad]), 0)].name
        raise TransferFailed(
            f"{where}: run {bad} [{int(addrs[bad]):#x}, +{int(lengths[bad])}) is outside every registered region "
            f"(nearest {near}); refused before posting"
        )
    used = np.unique(idx)
    kinds = sorted({ordered[i].mem_kind for i in used})
    if len(kinds) > 1:
        raise TransferFailed(f"{where}: one batch spans memory kinds {', '.join(kinds)}; post each kind apart")
    devices = np.array([s.device_id for s in ordered], dtype=np.uint64)
    return Placement(kinds[0], devices[idx])


def describe_entries(entries: Sequence[RegionRuns]) -> str:
    if not entries:
        return "no regions"
    first, last = entries[0].dst, entries[-1].dst
    return first.name if len(entries) == 1 else f"{first.name}..{last.name} ({len(entries)} regions)"


class Transport(abc.ABC):
    """Register regions, exchange metadata, post batches of runs, poll, notify, close."""

    backend: str = ""

    def __init__(self, agent_name: str, config: TransportConfig) -> None:
        self.agent_name = agent_name
        self.config = config
        self.node = node_id()
        # Why this transport may pair only with agents on its own node ("": any node); a backend sets it
        self.node_only = ""
        self._local: list[Span] = []
        self._remote: dict[str, list[Span]] = {}

    # -- what backends implement ------------------------------------------------------------------
    @abc.abstractmethod
    def _register(self, regions: Sequence[Region | Span]) -> None: ...

    @abc.abstractmethod
    def _metadata(self) -> bytes: ...

    @abc.abstractmethod
    def _add_peer(self, agent_name: str, payload: bytes) -> None: ...

    @abc.abstractmethod
    def _remove_peer(self, agent_name: str) -> None: ...

    @abc.abstractmethod
    def _post(
        self,
        xfer: Transfer,
        local: np.ndarray,
        remote: np.ndarray,
        lengths: np.ndarray,
        notif: bytes | None,
        places: tuple[Placement, Placement],
    ) -> None:
        """Post the checked runs; ``places`` says where the local and the remote runs live."""

    @abc.abstractmethod
    def _poll(self, xfer: Transfer) -> bool: ...

    @abc.abstractmethod
    def _release(self, xfer: Transfer) -> None: ...

    @abc.abstractmethod
    def send_notif(self, peer: str, payload: bytes) -> None: ...

    @abc.abstractmethod
    def notifs(self) -> list[tuple[str, bytes]]:
        """New notifications as (peer, payload); also drives progress where the library needs it."""

    @abc.abstractmethod
    def info(self) -> TransportInfo: ...

    @abc.abstractmethod
    def _close(self) -> None: ...

    # -- the shared contract ----------------------------------------------------------------------
    def register(self, regions: Sequence[Region | Span]) -> None:
        """Register cache regions or plain spans (an engine's metadata buffers travel too)."""
        self._register(regions)
        self._local.extend(Span(r.name, r.base_addr, r.size_bytes, r.mem_kind, r.device_id) for r in regions)

    def metadata(self) -> bytes:
        """This agent's metadata, framed with its backend, name and digest for a peer's ``add_peer``."""
        payload = self._metadata()
        blob = _Blob(self.backend, self.agent_name, self.node, payload, _digest(self.node, payload))
        return msgspec.msgpack.encode(blob)

    def add_peer(self, metadata: bytes, regions: Sequence[Span]) -> str:
        """Load a peer from its framed metadata and the regions it announced; returns its agent name."""
        blob = decode_as(metadata, _Blob, f"{self.backend} peer metadata (corrupted or truncated)")
        if blob.backend != self.backend:
            raise ProtocolError(f"peer speaks transport {blob.backend!r}; this agent uses {self.backend!r}")
        if _digest(blob.node, blob.payload) != blob.digest:
            raise ProtocolError(f"{self.backend}: metadata of peer {blob.agent_name!r} fails its digest")
        if self.node_only and blob.node != self.node:
            raise ProtocolError(
                f"{self.backend}: peer {blob.agent_name!r} is on node {blob.node}, this agent on node {self.node} "
                f"(glm-pd doctor prints a node's id), and {self.node_only}. Fix: pair engines on one node, set up "
                f"RDMA on both nodes, or allow TCP explicitly: {ALLOW_TCP}"
            )
        try:
            self._add_peer(blob.agent_name, blob.payload)
        except Exception as exc:
            raise TransferFailed(f"{self.backend}: loading peer {blob.agent_name!r} failed: {exc}") from exc
        self._remote[blob.agent_name] = list(regions)
        return blob.agent_name

    def post(
        self,
        peer: str,
        op: Op,
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        lengths: np.ndarray,
        *,
        notif: bytes | None = None,
        what: str = "",
    ) -> Transfer:
        """Post one batch. Every run is bounds-checked on both sides first; nothing moves if one fails."""
        if op not in ("READ", "WRITE"):
            raise ValueError(f"op must be READ or WRITE, got {op!r}")
        if peer not in self._remote:
            raise TransferFailed(f"{self.backend} {op} {what}: unknown peer {peer!r} (no metadata loaded)")
        local = np.ascontiguousarray(local_addrs, dtype=np.int64)
        remote = np.ascontiguousarray(remote_addrs, dtype=np.int64)
        lens = np.ascontiguousarray(lengths, dtype=np.int64)
        if not local.shape == remote.shape == lens.shape:
            raise ValueError("local, remote and length arrays must have one shape")
        places = (
            place_runs(local, lens, self._local, where=f"{self.backend} {op} {what} local side"),
            place_runs(remote, lens, self._remote[peer], where=f"{self.backend} {op} {what} on peer {peer}"),
        )
        xfer = Transfer(peer, op, int(lens.size), int(lens.sum()), what)
        try:
            self._post(xfer, local, remote, lens, notif, places)
        except TransferFailed:
            raise
        except Exception as exc:
            raise TransferFailed(f"{self.backend} {op} of {what} with peer {peer} failed to post: {exc}") from exc
        return xfer

    def post_plan(
        self,
        peer: str,
        plan: TransferPlan,
        op: Op,
        *,
        entries: Sequence[RegionRuns] | None = None,
        notif: bytes | None = None,
    ) -> Transfer:
        """Post a plan's runs (or some of its entries) as one batch: READ pulls src->dst, WRITE pushes."""
        chosen = list(plan.entries) if entries is None else list(entries)
        src, dst, lens = plan.absolute_runs(chosen)
        local, remote = (dst, src) if op == "READ" else (src, dst)
        xfer = self.post(peer, op, local, remote, lens, notif=notif, what=describe_entries(chosen))
        # absolute_runs concatenates the entries' runs in order: split the posted lengths back by entry
        cuts = np.cumsum([e.num_runs for e in chosen])[:-1]
        for entry, part in zip(chosen, np.split(lens, cuts) if chosen else [], strict=True):
            kind = entry.dst.kind
            xfer.bytes_by_kind[kind] = xfer.bytes_by_kind.get(kind, 0) + int(part.sum())
        return xfer

    def poll(self, xfer: Transfer) -> bool:
        try:
            done = self._poll(xfer)
        except TransferFailed:
            raise
        except Exception as exc:
            raise TransferFailed(
                f"{self.backend} {xfer.op} of {xfer.what} with peer {xfer.peer} failed: {exc}"
            ) from exc
        xfer.completed = xfer.completed or done
        return done

    def wait(self, xfer: Transfer, timeout_s: float | None = None) -> None:
        """Block until done; a bounded wait: past the timeout the batch is released and TransferFailed raised."""
        deadline = time.monotonic() + (timeout_s or self.config.timeout_s)
        while not self.poll(xfer):
            if time.monotonic() > deadline:
                self.release(xfer)
                raise TransferFailed(
                    f"{self.backend} {xfer.op} of {xfer.what} with peer {xfer.peer} did not complete in "
                    f"{timeout_s or self.config.timeout_s:.1f} s ({xfer.num_runs} runs, {xfer.num_bytes} B)"
                )
            time.sleep(0.0002)

    def release(self, xfer: Transfer) -> None:
        if xfer.handle is not None:
            self._release(xfer)
            xfer.handle = None

    def remove_peer(self, peer: str) -> None:
        """Forget a peer: unload its agent from the library and its announced regions (unknown: no-op)."""
        if self._remote.pop(peer, None) is not None:
            self._remove_peer(peer)

    def remote_peers(self) -> list[str]:
        """Agents loaded now (what a leak check counts)."""
        return sorted(self._remote)

    def close(self) -> None:
        self._close()
        self._local.clear()
        self._remote.clear()

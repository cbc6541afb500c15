"""What one decode load is and how it ends: the job the adapter submits, the result it collects, and why a
failed load failed (``FAILURE_CODES``).

Kept apart from ``decode_service`` (the threads that run loads) so the adapters and tools that only build
jobs and read results need none of the service machinery.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from glm_pd_common.errors import (
    AuthenticationFailed,
    ChecksumMismatch,
    ConfigError,
    GlmPdError,
    LayoutMismatch,
    LeaseExpired,
    PageOutOfRange,
    PlanError,
    ProtocolError,
    TransferFailed,
)
from glm_pd_common.handoff.wire.protocol import FailureCode
from glm_pd_common.handoff.wire.sidechannel import SideChannelTimeout
from glm_pd_common.layout.shards import REPLICATED, Sharding


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prefill lives: its engine id, side-channel host, base port (rank r: +r), TP size,
    and how its ranks shard the caches (decode needs it to pick its sources before any handshake). A streamed
    request's params name only the host and port (``tp_size`` 0): decode asks rank 0 for the rest. ``hosts``
    holds each rank's own host where the instance spans nodes (empty: every rank is on ``host``)."""

    engine_id: str
    host: str
    base_port: int
    tp_size: int
    sharding: Sharding = REPLICATED
    hosts: tuple[str, ...] = ()

    def host_of(self, rank: int) -> str:
        return self.hosts[rank] if self.hosts else self.host

    @property
    def address(self) -> str:
        """Rank 0's side channel: one per prefill engine, known in pull and streamed params alike."""
        return f"{self.host}:{self.base_port}"


@dataclass(frozen=True)
class LoadJob:
    request_id: str
    remote: RemotePrefill
    remote_pages: np.ndarray  # prefill's whole page table for the request
    local_pages: np.ndarray  # decode's whole page table for the request
    num_tokens: int
    prefix_tokens: int  # decode's local prefix hit (page-aligned): those pages stay
    read: bool = True  # False: nothing to read (all tokens hit locally), only release prefill's pages
    remote_request_id: str = ""  # prefill's id for the request, when the engines name it differently
    stream_id: str = ""  # a streamed transfer: read while prefill runs (``remote_pages`` come from prefill)
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def lease_id(self) -> str:
        """Prefill's name for what decode claims, confirms or aborts (a streamed load: the transfer id)."""
        return self.stream_id or self.remote_request_id or self.request_id


@dataclass
class LoadResult:
    """How one load ended: what moved and how long each phase took, or why it failed (``code`` for metrics
    and policy, ``reason`` for people)."""

    request_id: str
    ok: bool
    reason: str = ""
    code: str = ""  # a failure's kind, one of protocol.FAILURE_CODES; "" when ok
    states: list[str] = field(default_factory=list)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    runs: int = 0
    runs_by_kind: dict[str, int] = field(default_factory=dict)
    batches: int = 0  # posted batches; a staged read's slots count one each
    staged_bytes: int = 0  # of the bytes moved, those that went through staging slots
    seconds: float = 0.0
    plan_ms: float = 0.0
    pages: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: queued, handshake, claim, pull, release


class Refused(GlmPdError):
    """Prefill refused, or we refused prefill's hello; ``code`` says which kind of refusal."""

    def __init__(self, message: str, code: FailureCode) -> None:
        super().__init__(message)
        self.code = code


def failure_code(exc: BaseException) -> FailureCode:
    """Why a load failed, by what raised: a refusal names its own kind; otherwise the error's class."""
    if isinstance(exc, Refused):
        return exc.code
    kinds: list[tuple[type[BaseException] | tuple[type[BaseException], ...], FailureCode]] = [
        (SideChannelTimeout, "timeout"),
        (TransferFailed, "transport"),
        (ChecksumMismatch, "digest"),
        (LeaseExpired, "lease_expired"),
        ((PlanError, PageOutOfRange, ConfigError), "invalid_params"),  # the request's params, not the peer
        ((LayoutMismatch, ProtocolError, AuthenticationFailed), "refused_peer"),
    ]
    return next((code for kind, code in kinds if isinstance(exc, kind)), "internal")


class Phases:
    """Seconds spent in each phase of one load, from the moment the engine submitted it."""

    def __init__(self, into: dict[str, float], since: float) -> None:
        self.into, self.last = into, since

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.into[phase], self.last = now - self.last, now

"""What one decode load is and how it ends: the job the adapter submits, the result it collects, why a
failed load failed (``FAILURE_CODES``), and the test hooks a job may carry.

Kept apart from ``decode_service`` (the threads that run loads) so the adapters and tools that only build
jobs and read results need none of the service machinery.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from glm_pd_common.errors import (
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

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prefill lives: its engine id, side-channel host, base port (rank r: +r), TP size,
    and how its ranks shard the caches (decode needs it to pick its sources before any handshake). A streamed
    request's params name only the host and port (``tp_size`` 0): decode asks rank 0 for the rest."""

    engine_id: str
    host: str
    base_port: int
    tp_size: int
    sharding: Sharding = REPLICATED

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
    test_fault: str = ""  # test hook, one of FAULTS ("kind" or "kind:seconds"); never set from remote input
    remote_request_id: str = ""  # prefill's id for the request, when the engines name it differently
    stream_id: str = ""  # a streamed transfer: read while prefill runs (``remote_pages`` come from prefill)
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def lease_id(self) -> str:
        """Prefill's name for what decode claims, confirms or aborts (a streamed load: the transfer id)."""
        return self.stream_id or self.remote_request_id or self.request_id


# Test hooks (the fault matrix and the demo): what each does to one load.
FAULTS = {
    "corrupt": "flip one landed byte before verification",
    "stall_before_claim": "wait N s after the handshake, before claiming the lease",
    "stall_mid": "wait N s after posting the first layer's reads, before the others",
    "stall_before_release": "wait N s after the reads (and verification), before confirming",
    "transport_error": "the first batch fails as if the backend reported an error",
    "transport_hang": "the first batch never reports completion",
    "lose_release": "the confirmation is never sent (a lost message); its answer is still awaited",
    "duplicate_release": "the confirmation is sent twice",
}


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
    batches: int = 0
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
        ((LayoutMismatch, ProtocolError), "refused_peer"),
    ]
    return next((code for kind, code in kinds if isinstance(exc, kind)), "internal")


class Phases:
    """Seconds spent in each phase of one load, from the moment the engine submitted it."""

    def __init__(self, into: dict[str, float], since: float) -> None:
        self.into, self.last = into, since

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.into[phase], self.last = now - self.last, now


def stall(job: LoadJob, kind: str) -> None:
    """The ``stall_*`` test hooks: sleep where ``kind`` says, if the job asks for it."""
    name, _, seconds = job.test_fault.partition(":")
    if name == kind:
        logger.warning("glm-pd test hook: %s stalls %s s (%s)", job.request_id, seconds, kind)
        time.sleep(float(seconds))

"""A row of the table, the runs it is the median of, and the rates its ratios are taken against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glm_pd_common.transport.base import Op

# The transfer modes measured on each pool, in order (``bench.Bench.runner`` runs each): mode → the NIXL operation
# it posts. ``staged`` is ``pull`` through both ranks' staging slots, ``staged push`` is ``push`` through them.
MODES: dict[str, Op] = {"pull": "READ", "staged": "READ", "push": "WRITE", "staged push": "WRITE"}
STAGED_MODES: tuple[str, ...] = ("staged", "staged push")
DIGEST_MODES: tuple[str, ...] = ("pull", "staged")  # measured with digests on too (decode checks prefill's)


@dataclass
class Row:
    case: str  # raw | copy | gather | a mode of MODES | streamed | staged streamed
    pool: str = ""  # contiguous | shuffled; "" where no page table is involved
    digests: bool = False
    op: str = ""  # READ | WRITE: the NIXL operation (which raw rate is its own); "" for the memory's copies
    bytes: int = 0
    seconds: float = 0.0  # the median run (streamed, staged streamed: the exposed handoff)
    runs: int = 0  # descriptors posted (copy: 1, gather: rows)
    batches: int = 0  # posted batches; a staged load's slots count one each
    path: str = ""  # UCX's path for this row's operation in one word (datapath.PATHS), or the copy's engine
    path_detail: str = ""
    each_s: list[float] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)  # load_s, read_s, chunk_s, ...
    skipped: str = ""

    @property
    def gbps(self) -> float | None:
        if self.skipped or self.case.endswith("streamed") or self.seconds <= 0:
            return None
        return self.bytes / self.seconds / 1e9


@dataclass
class Sample:
    """One run of a row."""

    seconds: float
    bytes: int
    runs: int
    batches: int = 1
    extra: dict[str, float] = field(default_factory=dict)


def raw_rates(rows: list[Row]) -> dict[str, float]:
    """GB/s of the raw one-descriptor rows, by operation."""
    return {r.op: r.gbps for r in rows if r.case == "raw" and r.gbps}


def ratios(row: Row, raw: dict[str, float]) -> tuple[float | None, float | None]:
    """(of the ceiling: the faster raw rate, of the raw rate of the row's own operation)."""
    if row.gbps is None or not raw:
        return None, None
    own = raw.get(row.op)
    return row.gbps / max(raw.values()), (row.gbps / own if own else None)


def find(rows: list[Row], case: str, pool: str = "", digests: bool = False) -> Row | None:
    """The measured row of that case, pool and digest setting (None if absent or skipped)."""
    return next((r for r in rows if (r.case, r.pool, r.digests) == (case, pool, digests) and not r.skipped), None)

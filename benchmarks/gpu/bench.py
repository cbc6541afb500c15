"""The schedule: warm-ups, then every row in order, each the median of its runs, all in one run so their ratios
stand side by side."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.gpu import runners
from benchmarks.gpu.decode import Decode
from benchmarks.gpu.paths import attribute
from benchmarks.gpu.ranks import CHUNKS, PAGE_TOKENS, POOLS, SEED, spec
from benchmarks.gpu.rows import DIGEST_MODES, MODES, Row, Sample, find

if TYPE_CHECKING:
    from glm_pd_common.transport.base import Op

RAW_OPS: tuple[Op, ...] = ("WRITE", "READ")


class Bench:
    """The rows measured over decode's side ``d``."""

    def __init__(self, d: Decode) -> None:
        self.d = d
        self.args = d.args
        self.rows: list[Row] = []
        self.problems: list[str] = []  # warm-ups that failed (their rows run and fail or pass on their own)

    def warm_up(self) -> None:
        """One small pull (digests on, then off) handshakes the services and maps every region; one small staged
        pull, push, staged push and raw op each way warm their paths. Nothing of this is measured; a warm-up that
        fails is noted, and the rows still run (each says how it fared)."""
        d = self.d
        d.connect()
        steps: dict[str, Callable[[], object]] = {
            "pull with digests": partial(runners.pull, d, "contiguous", True, pages=1),
            "pull": partial(runners.pull, d, "contiguous", False, pages=1),
            "staged pull": partial(runners.pull, d, "contiguous", False, staged=True, pages=1),
            "push": partial(runners.push, d, "contiguous", PAGE_TOKENS),
            "staged push": partial(runners.push, d, "contiguous", PAGE_TOKENS, staged=True),
            "raw WRITE": partial(runners.raw, d, "WRITE", 4096),
            "raw READ": partial(runners.raw, d, "READ", 4096),
        }
        for name, step in steps.items():
            try:
                step()
            except Exception as exc:  # reported in the notes, as a bench reports
                self.problems.append(f"warm-up {name} failed: {type(exc).__name__}: {exc}"[:400])

    def measure(self, row: Row, run: Callable[[], Sample]) -> None:
        """``run`` up to ``--repeats`` times while the row's budget lasts (once at least), unless the run's
        deadline passed; the row gets the median run's figures. A row that fails says why; the others still run."""
        self.rows.append(row)
        if time.monotonic() - self.d.started > self.args.deadline_s:
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

    def references(self) -> None:
        """The memory's own copies of the request's bytes: one copy, and a gather of shuffled main pages; and the
        digest of those pages by each reader (decode checks every byte it read, prefill digests what it sends)."""
        d = self.d
        row_bytes = spec().row.row_bytes * PAGE_TOKENS
        rows = d.nbytes // row_bytes
        order = np.random.default_rng(SEED).permutation(rows)
        scratch = d.kind.scratch(d.nbytes)
        self.measure(Row("copy", path=d.kind.engine), partial(runners.copy, d, scratch))
        gather = Row("gather", pool="shuffled", path=d.kind.engine, path_detail=f"{rows} rows of {row_bytes} B")
        self.measure(gather, partial(runners.gather, d, scratch, row_bytes, order))
        for name, reader in d.kind.digesters().items():
            row = Row("digest", pool="shuffled", path=name, path_detail=f"{rows} rows of {row_bytes} B")
            self.measure(row, partial(runners.digest, d, reader, row_bytes, order))

    def runner(self, mode: str, pool: str, digests: bool) -> Callable[[], Sample]:
        d = self.d
        return {
            "pull": partial(runners.pull, d, pool, digests),
            "staged": partial(runners.pull, d, pool, digests, staged=True),
            "push": partial(runners.push, d, pool, self.args.tokens),
            "staged push": partial(runners.push, d, pool, self.args.tokens, staged=True),
        }[mode]

    def run(self) -> None:
        d = self.d
        self.warm_up()
        for op in RAW_OPS:
            self.measure(Row("raw", op=op), partial(runners.raw, d, op, d.nbytes))
        self.references()
        for mode, op in MODES.items():
            for pool in POOLS:
                for digests in (False, True) if mode in DIGEST_MODES else (False,):
                    self.measure(Row(mode, pool=pool, digests=digests, op=op), self.runner(mode, pool, digests))
        pull = find(self.rows, "pull", "shuffled")
        chunk_s = self.args.chunk_ms / 1e3 if self.args.chunk_ms else (pull.seconds / CHUNKS if pull else 0.05)
        self.measure(Row("streamed", pool="shuffled", op="READ"), partial(runners.streamed, d, chunk_s))
        staged = Row("staged streamed", pool="shuffled", op="READ")
        self.measure(staged, partial(runners.streamed, d, chunk_s, staged=True))
        attribute(self.rows, d)

"""The issue's targets over the measured rows, printed beside them with PASS/FAIL (never asserted)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.gpu.ranks import POOLS
from benchmarks.gpu.rows import DIGEST_MODES, MODES, STAGED_MODES, Row, find, ratios, raw_rates

STAGED_SHUFFLED_MIN = 0.25  # of the raw one-descriptor ceiling
CONTIGUOUS_MIN = 0.90
DIGESTS_MAX = 0.05  # of the transfer's time
STREAMED_MAX = 0.15  # exposed handoff over pull's whole read


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None  # the ratio, or None where its rows were not measured
    limit: str  # e.g. ">= 90 %"
    ok: bool | None
    detail: str = ""


def _at_least(name: str, value: float | None, limit: float) -> Target:
    if value is None:
        return Target(name, None, f">= {limit:.0%}", None, "not measured")
    return Target(name, value, f">= {limit:.0%}", value >= limit)


def _at_most(name: str, value: float | None, limit: float) -> Target:
    if value is None:
        return Target(name, None, f"<= {limit:.0%}", None, "not measured")
    return Target(name, value, f"<= {limit:.0%}", value <= limit)


def targets(rows: list[Row], paths: list[tuple[str, str, str]]) -> list[Target]:
    """The targets; ``paths``: (who and op, glm-pd's reported path, UCX's). Every mode is held to the contiguous
    target (for staged it is informative: two extra copies of every byte are its price)."""
    raw = raw_rates(rows)

    def of_ceiling(row: Row | None) -> float | None:
        return None if row is None else ratios(row, raw)[0]

    out = [
        _at_least(f"{mode} shuffled of raw", of_ceiling(find(rows, mode, "shuffled")), STAGED_SHUFFLED_MIN)
        for mode in STAGED_MODES
    ]
    for mode in MODES:
        out.append(_at_least(f"{mode} contiguous of raw", of_ceiling(find(rows, mode, "contiguous")), CONTIGUOUS_MIN))
    for mode in DIGEST_MODES:
        for pool in POOLS:
            off, on = find(rows, mode, pool), find(rows, mode, pool, True)
            cost = None
            if off is not None and on is not None and off.seconds > 0:
                cost = (on.extra["load_s"] - off.extra["load_s"]) / off.seconds
            out.append(_at_most(f"{mode} {pool}: digests of transfer", cost, DIGESTS_MAX))
    for streamed, pulled in (("streamed", "pull"), ("staged streamed", "staged")):
        stream, pull = find(rows, streamed, "shuffled"), find(rows, pulled, "shuffled")
        exposed = stream.seconds / pull.seconds if stream and pull and pull.seconds > 0 else None
        out.append(_at_most(f"{streamed} exposure of {pulled}", exposed, STREAMED_MAX))
    for who, reported, observed in paths:
        ok = bool(observed) and reported == observed
        detail = f"glm-pd reports {reported!r}, UCX_PROTO_INFO shows {observed or 'no table'!r}"
        out.append(Target(f"{who}: reported path is UCX's", None, "equal", ok, detail))
    return out

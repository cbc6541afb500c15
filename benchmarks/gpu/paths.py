"""Which data path UCX took for each NIXL row: what ``UCX_PROTO_INFO=y`` printed for the agent that posted it (its
process's log, parsed by ``transport.datapath``), and whether glm-pd's own report of its path agrees."""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks.gpu.ranks import DECODE_AGENT, PREFILL_AGENT, RAW_DECODE

if TYPE_CHECKING:
    from benchmarks.gpu.decode import Decode
    from benchmarks.gpu.rows import Row
    from glm_pd_common.transport.datapath import Selection


def chosen_path(log: str, agent: str, op: str, memory: str) -> Selection | None:
    """What UCX printed for ``agent``'s latest ``op`` on ``memory`` to a peer: UCX names each table's endpoint
    after the worker, which NIXL names after the agent."""
    from glm_pd_common.transport.datapath import between_peers, parse

    mine = [s for s in parse(log) if s.endpoint.split(" ")[0] == agent]
    return between_peers(mine, op, memory)


def attribute(rows: list[Row], d: Decode) -> None:
    """Each measured NIXL row's path and protocol: raw rows are decode's raw agent's, push prefill's, the rest
    (pull, staged, streamed: decode's READs) decode's service agent's."""
    mine, theirs = d.log.text(), d.child_log.read_text(errors="replace")
    for row in rows:
        if not row.op or row.skipped:
            continue
        log, agent = {"raw": (mine, RAW_DECODE), "push": (theirs, PREFILL_AGENT)}.get(row.case, (mine, DECODE_AGENT))
        chosen = chosen_path(log, agent, row.op, d.kind.ucx)
        if chosen is None:
            row.path = "no UCX table"
        else:
            row.path, row.path_detail = chosen.path, f"{chosen.protocol} over {', '.join(chosen.transports)}"


def reported_vs_ucx(d: Decode) -> list[tuple[str, str, str]]:
    """(who and op, glm-pd's reported path, UCX's) for decode's READs and prefill's WRITEs."""
    sides = (
        ("decode READ", d.transport.info().path, d.log.text(), DECODE_AGENT, "READ"),
        (
            "prefill WRITE",
            d.child.hello["reported_path"],
            d.child_log.read_text(errors="replace"),
            PREFILL_AGENT,
            "WRITE",
        ),
    )
    out = []
    for who, reported, log, agent, op in sides:
        chosen = chosen_path(log, agent, op, d.kind.ucx)
        out.append((who, reported, chosen.path if chosen else ""))
    return out

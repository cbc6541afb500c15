"""The fault matrix over GlmPdConnector: a prefill and a decode instance (``vllm_pd_serve`` processes: vLLM's own
scheduler and block pool around the connector, real NIXL on loopback), one fault per case, injected at one
handoff state, then the dust settles and a clean request must succeed. Each case records: the faulted requests'
final states and reasons, whether any output came from bad KV, the blocks and requests each side's vLLM still
holds, whether the next request worked, and the time to detect.

Used by ``test_fault_matrix.py`` (asserts every row) and ``benchmarks/fault_matrix.py`` (table + JSON).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glm_pd_common.handoff.wire.protocol import HEARTBEAT_S
from tests.support.ports import free_port

REPO = Path(__file__).parents[2]
BLOCK, POOL_TOKENS = 64, 96 * 64  # requested; the engine may choose another block size
LEASE_S, TIMEOUT_S = 3.0, 3.0  # short, so expiry cases settle in seconds
STALL_S = TIMEOUT_S + 1.5  # longer than the lease and the transfer hold: each stall outlives what it races
SETTLE_S = LEASE_S + TIMEOUT_S + 6  # every hold that could outlive a fault has ended by then
# a decode that died is forgotten by prefill after three missed heartbeats (or lease + timeout), checked each second
PEER_SETTLE_S = max(LEASE_S + TIMEOUT_S, 3 * HEARTBEAT_S) + 2
_seeds = itertools.count(100)
# per-request state the services and the connector keep: all 0 once every request has ended
_SERVICE_STATE = (
    "leases",
    "early_claims",
    "unready",
    "plans",
    "queued",
    "results",
    "inflight",
    "pending",
    "requests_held",
)
# what vLLM finishes a request with, by the connector's report (an aborted one has no output at all)
_FINISH = {"loaded": "length", "failed": "error", "no_load": "length"}


class Peer:
    """One ``vllm_pd_serve`` process; its events are read on a thread and matched by the driver."""

    def __init__(self, role: str, engine_id: str, port: int, log_dir: Path, **job) -> None:
        self.role, self.engine_id = role, engine_id
        spec = {
            "role": role, "engine_id": engine_id, "model": job.pop("model"), "block_size": BLOCK, "tp": 1,
            "pool_tokens": POOL_TOKENS, "port": port, "lease_s": LEASE_S, "wait_s": 0, "tokens": 0,
            "prefix_tokens": 0, "requests": [], "module_path": "glm_pd_vllm.connector",
            "extra": {"timeout_s": TIMEOUT_S, **job.pop("extra", {})}, **job,
        }  # fmt: skip
        self.log = log_dir / f"{engine_id}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.vllm_pd_serve", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            cwd=REPO,
        )
        self.events: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.wait("ready", timeout=180)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("PD "):
                self.events.put(json.loads(line[3:]))

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait(self, event: str, rid: str | None = None, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self._seen):
                if ev["event"] == event and (rid is None or ev.get("rid") == rid):
                    return self._seen.pop(i)
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise TimeoutError(f"{self.engine_id}: no {event} event for {rid} in {timeout} s; log {self.log}")
            with contextlib.suppress(queue.Empty):
                self._seen.append(self.events.get(timeout=min(left, 0.5)))

    def discard(self, event: str) -> None:
        """Forget events of one kind nobody waits for (a long soak would otherwise keep them all)."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._seen.append(self.events.get_nowait())
        self._seen = [ev for ev in self._seen if ev["event"] != event]

    def status(self) -> dict:
        self.send(op="status")
        return self.wait("status")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(op="quit")
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Row:
    case: str
    state: str
    expect: str  # what must happen to the faulted request(s)
    outcomes: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    served_wrong: bool = False
    detect_s: float = 0.0
    bound_s: float = 0.0  # this case's own bound on detect_s, on an idle machine
    # what the next (clean) request took end to end, there and then: the machine's pace while this case ran
    baseline_s: float = 0.0
    prefill_blocks_left: int = -1
    decode_blocks_left: int = -1
    service_state_left: dict = field(default_factory=dict)
    next_ok: bool = False
    tokens: list[int] = field(default_factory=list)
    prefix: int = 0
    error: str = ""


class Matrix:
    def __init__(self, model: str, log_dir: Path, port: int) -> None:
        self.model, self.log_dir, self.port = model, log_dir, port
        self.prefill = Peer("kv_producer", "P", port, log_dir, model=model)
        self.decode = Peer("kv_consumer", "D", port, log_dir, model=model)
        self._rids = itertools.count()

    def close(self) -> None:
        for peer in (self.prefill, self.decode):
            peer.close()

    def rid(self, tag: str) -> str:
        return f"{tag}-{next(self._rids)}"

    # -- one request's legs --------------------------------------------------------------------------
    def prefill_leg(self, rid: str, tokens: int, seed: int, **kw) -> dict | None:
        self.prefill.send(op="prefill", rid=rid, tokens=tokens, seed=seed, **kw)
        return self.prefill.wait("params", rid)["params"]

    def decode_leg(self, rid: str, params: dict, seed: int, prefix: int = 0, fault: str = "", decode=None) -> None:
        (decode or self.decode).send(op="decode", rid=rid, params=params, prefix=prefix, seed=seed, fault=fault)

    def handoff(self, tokens: int, prefix: int = 0) -> dict:
        """A clean request, start to finish."""
        seed, rid = next(_seeds), self.rid("ok")
        params = self.prefill_leg(rid, tokens, seed)
        self.decode_leg(rid, params, seed, prefix)
        return self.decode.wait("result", rid, timeout=TIMEOUT_S * 4)

    # -- settling --------------------------------------------------------------------------------
    def settled(self, row: Row) -> None:
        """Wait until both sides hold nothing (bounded), record what is left, then run the next request."""
        deadline = time.monotonic() + max(SETTLE_S, PEER_SETTLE_S)
        while True:
            p, d = self.prefill.status(), self.decode.status()
            left = {k: v for s in (p, d) for k, v in s.items() if k in _SERVICE_STATE and v}
            # per-peer state: prefill keeps at most the one live decode (restarted ones are forgotten), and each
            # side holds exactly one transport agent per peer it keeps
            if p["decode_peers"] > 1 or p["transport_peers"] != p["decode_peers"]:
                left["prefill peers/agents"] = (p["decode_peers"], p["transport_peers"])
            if d["transport_peers"] != d["prefill_peers"]:
                left["decode peers/agents"] = (d["prefill_peers"], d["transport_peers"])
            if (p["blocks_held"] == 0 and d["blocks_held"] == 0 and not left) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        row.prefill_blocks_left, row.decode_blocks_left = p["blocks_held"], d["blocks_held"]
        row.service_state_left = left
        nxt = self.handoff(tokens=300, prefix=128)
        row.baseline_s = nxt["t"] - nxt["t0"]
        row.next_ok = nxt["outcome"] == "loaded" and not nxt["mismatched"]
        if not row.next_ok:
            row.error = row.error or f"the next request: {nxt}"


Case = Callable[[Matrix, Row], None]


def _faulted(m: Matrix, row: Row, fault: str, *, act: Callable[[Matrix, str], None] | None = None,
             when: str = "") -> None:  # fmt: skip
    """One faulted request: prefill, decode with ``fault``; ``act`` runs when the hook stalls (or at once)."""
    seed, rid = next(_seeds), m.rid(row.case)
    params = m.prefill_leg(rid, row.tokens[0], seed)
    m.decode_leg(rid, params, seed, row.prefix, fault)
    if act is not None:
        if when:
            m.decode.wait("stalled", rid, timeout=TIMEOUT_S * 4)
        act(m, rid)
    _record(row, m.decode.wait("result", rid, timeout=STALL_S + TIMEOUT_S * 4))


def _record(row: Row, res: dict, *, detects: bool = True) -> None:
    """What the connector reported for the request (finished_recving, failed_recving), never a harness flag.
    ``detects``: the request's time counts towards the row's time to detect (not so for a load that shows the
    engine serves again after the fault: its time is a load's, which a loaded machine stretches)."""
    outcome = res["outcome"]
    finish = None if res["aborted"] else _FINISH[outcome]
    if res["finish"] != finish:
        row.error = f"{res['rid']}: vLLM finished it {res['finish']!r} after a {outcome} report (expected {finish!r})"
    if res["aborted"] and res["served"]:
        row.error = f"{res['rid']}: an aborted request produced output"
    row.outcomes.append(outcome)
    row.reasons.append(res.get("reason", ""))
    row.served_wrong |= bool(res.get("served_wrong"))
    if detects:
        row.detect_s = max(row.detect_s, res["t"] - res["t0"])


def _abort(m: Matrix, rid: str) -> None:
    m.decode.send(op="abort", rid=rid)


def _restart_prefill(m: Matrix, rid: str) -> None:
    m.prefill.kill()
    m.prefill = Peer("kv_producer", f"P{next(m._rids)}", m.port, m.log_dir, model=m.model)  # a new identity


def _restart_decode(m: Matrix, row: Row, rid: str) -> None:
    """SIGKILL decode mid-load; prefill must free the blocks when the claimed hold ends (nobody confirms)."""
    killed_at = time.monotonic()
    m.decode.kill()
    freed = m.prefill.wait("freed", rid, timeout=SETTLE_S)  # prefill's connector reported finished_sending
    row.outcomes.append("freed at prefill")
    row.reasons.append(f"prefill freed the blocks {freed['t'] - killed_at:.1f} s after the kill")
    row.detect_s = freed["t"] - killed_at  # CLOCK_MONOTONIC is one clock for every process here
    m.decode = Peer("kv_consumer", f"D{next(m._rids)}", m.port, m.log_dir, model=m.model)  # a new identity


def case_decode_abort(state: str) -> Case:
    fault = {"waiting": f"stall_before_claim:{STALL_S / 2}", "mid-transfer": f"stall_mid:{STALL_S / 2}",
             "before release": f"stall_before_release:{STALL_S / 2}"}[state]  # fmt: skip
    return lambda m, row: _faulted(m, row, fault, act=_abort, when="stalled")


def case_decode_abort_before_handshake(m: Matrix, row: Row) -> None:
    """The client leaves before decode schedules the request: the connector never hears of it; prefill frees
    its blocks when the lease runs out."""
    seed, rid = next(_seeds), m.rid(row.case)
    m.prefill_leg(rid, row.tokens[0], seed)
    t0 = time.monotonic()
    m.prefill.wait("freed", rid, timeout=SETTLE_S)  # prefill's connector reported finished_sending
    row.detect_s = time.monotonic() - t0
    # freed before the lease could have run out would mean something other than expiry released the blocks
    row.outcomes.append("expired at prefill" if row.detect_s >= LEASE_S * 0.9 else f"freed after {row.detect_s:.2f} s")


def case_prefill_abort(m: Matrix, row: Row) -> None:
    """Prefill aborts the request before it finishes: no params reach a router, the blocks are freed at once."""
    params = m.prefill_leg(m.rid(row.case), row.tokens[0], next(_seeds), aborted=True)
    row.outcomes.append("no params" if params is None else "params for an aborted request")


def case_prefill_killed(state: str) -> Case:
    fault = {"waiting": "stall_before_claim", "mid-transfer": "stall_mid",
             "before release": "stall_before_release"}[state]  # fmt: skip
    return lambda m, row: _faulted(m, row, f"{fault}:1", act=_restart_prefill, when="stalled")


def case_decode_killed(state: str) -> Case:
    fault = {"mid-transfer": "stall_mid", "before release": "stall_before_release"}[state]

    def run(m: Matrix, row: Row) -> None:
        seed, rid = next(_seeds), m.rid(row.case)
        params = m.prefill_leg(rid, row.tokens[0], seed)
        m.decode_leg(rid, params, seed, row.prefix, f"{fault}:{STALL_S * 4}")
        m.decode.wait("stalled", rid, timeout=TIMEOUT_S * 4)
        _restart_decode(m, row, rid)

    return run


def case_hook(fault: str) -> Case:
    return lambda m, row: _faulted(m, row, fault)


def case_stale_params_after_restart(m: Matrix, row: Row) -> None:
    """Prefill restarts under a new identity on the same port: params issued by the old one are refused."""
    seed, rid = next(_seeds), m.rid(row.case)
    params = m.prefill_leg(rid, row.tokens[0], seed)
    _restart_prefill(m, rid)
    m.decode_leg(rid, params, seed, row.prefix)
    _record(row, m.decode.wait("result", rid, timeout=TIMEOUT_S * 4))


def case_duplicate_decode(m: Matrix, row: Row) -> None:
    """A router delivers the same params twice (two decode requests): one loads, the other must fail."""
    seed, rid = next(_seeds), m.rid(row.case)
    params = m.prefill_leg(rid, row.tokens[0], seed)
    for dup in (f"{rid}-a", f"{rid}-b"):
        m.decode_leg(dup, params, seed, row.prefix)
    for dup in (f"{rid}-a", f"{rid}-b"):
        _record(row, m.decode.wait("result", dup, timeout=TIMEOUT_S * 4))


def case_retry_after_failure(m: Matrix, row: Row) -> None:
    """A load fails (a flipped byte); the router retries the same params: refused at once, nothing served.
    Then prefill runs again under the same request id: that new lease must be served."""
    seed, rid = next(_seeds), m.rid(row.case)
    params = m.prefill_leg(rid, row.tokens[0], seed)
    m.decode_leg(rid, params, seed, row.prefix, "corrupt")
    _record(row, m.decode.wait("result", rid, timeout=TIMEOUT_S * 4))
    m.decode_leg(f"{rid}-retry", params, seed, row.prefix)
    _record(row, m.decode.wait("result", f"{rid}-retry", timeout=TIMEOUT_S * 4))
    again = next(_seeds)  # the router redoes prefill; the engine reuses the id
    fresh = m.prefill_leg(rid, row.tokens[0], again)
    m.decode_leg(f"{rid}-again", fresh, again, row.prefix)
    _record(row, m.decode.wait("result", f"{rid}-again", timeout=TIMEOUT_S * 4), detects=False)


def case_other_prefill_hangs(m: Matrix, row: Row) -> None:
    """A second prefill engine stops answering (SIGSTOP) before decode's handshake: its load fails at the
    timeout, and a load from the healthy prefill submitted right after it does not wait for it."""
    other = Peer("kv_producer", f"Q{next(m._rids)}", free_port(), m.log_dir, model=m.model)
    try:
        seed, hung = next(_seeds), m.rid(row.case)
        other.send(op="prefill", rid=hung, tokens=row.tokens[0], seed=seed)
        params = other.wait("params", hung)["params"]
        os.kill(other.proc.pid, signal.SIGSTOP)
        m.decode_leg(hung, params, seed, row.prefix)
        seed2, healthy = next(_seeds), m.rid(row.case)
        m.decode_leg(healthy, m.prefill_leg(healthy, row.tokens[0], seed2), seed2, row.prefix)
        ok = m.decode.wait("result", healthy, timeout=TIMEOUT_S * 4)
        _record(row, m.decode.wait("result", hung, timeout=TIMEOUT_S * 4))
        _record(row, ok)
        if ok["t"] - ok["t0"] >= TIMEOUT_S:
            row.error = f"the healthy prefill's load waited {ok['t'] - ok['t0']:.1f} s behind the hung one"
    finally:
        os.kill(other.proc.pid, signal.SIGCONT)
        other.close()


def case_fingerprint(field_name: str, job: dict) -> Case:
    """A decode whose layout differs in one byte-relevant field: refused at handshake, the field named."""

    def run(m: Matrix, row: Row) -> None:
        other = Peer("kv_consumer", f"X{next(m._rids)}", m.port, m.log_dir, **{"model": m.model, **job})
        try:
            seed, rid = next(_seeds), m.rid(row.case)
            params = m.prefill_leg(rid, row.tokens[0], seed)
            m.decode_leg(rid, params, seed, row.prefix, decode=other)
            _record(row, other.wait("result", rid, timeout=TIMEOUT_S * 4))
            if field_name not in row.reasons[-1]:
                row.error = f"reason does not name {field_name}: {row.reasons[-1]}"
            m.prefill.wait("freed", rid, timeout=SETTLE_S)  # refused before a claim: freed by the lease's end
        finally:
            other.close()

    return run


def cases(other_layers_model: str, no_mtp_model: str) -> list[tuple[str, str, str, float, Case]]:
    """(case, state, outcome(s) the connectors must report, bound on the time to detect in seconds, runner)."""
    now, timeout, lease, stall = 2.0, TIMEOUT_S + 1.5, LEASE_S + 1.5, STALL_S + 1.5  # 1.5 s of slack on 2 cores
    out: list[tuple[str, str, str, float, Case]] = [
        ("decode abort", "before handshake", "expired at prefill", lease, case_decode_abort_before_handshake),
    ]
    # An aborted load is let finish (vLLM holds its blocks until the connector reports it) and is reported in
    # finished_recving like any other: "loaded" is the connector's report; vLLM's scheduler then frees the
    # blocks of the finished request and never serves it (checked in _record).
    # Two live prefill requests under one id cannot happen: vLLM's front end makes ids unique and its scheduler
    # asserts on a duplicate; reuse of an id after the first ended is the "retry after failure" case.
    for state in ("waiting", "mid-transfer", "before release"):
        out.append(("decode abort / client disconnect", state, "loaded", STALL_S / 2 + 1.5, case_decode_abort(state)))
    out.append(("prefill abort", "before params", "no params", now, case_prefill_abort))
    for state in ("waiting", "mid-transfer", "before release"):
        out.append(("prefill SIGKILL", state, "failed", 1 + timeout, case_prefill_killed(state)))
    for state in ("mid-transfer", "before release"):
        out.append(("decode SIGKILL", state, "freed at prefill", max(lease, timeout), case_decode_killed(state)))
    out += [
        ("prefill restarts, new identity", "stale params", "failed", now, case_stale_params_after_restart),
        ("another prefill hangs (SIGSTOP)", "handshake", "failed,loaded", timeout, case_other_prefill_hangs),
        ("lease expiry", "before read", "failed", stall, case_hook(f"stall_before_claim:{STALL_S}")),
        ("lease expiry", "during read", "failed", stall, case_hook(f"stall_mid:{STALL_S}")),
        ("lease expiry", "before confirmation", "failed", stall, case_hook(f"stall_before_release:{STALL_S}")),
        ("digest mismatch (byte flipped)", "after transfer", "failed", now, case_hook("corrupt")),
        ("transport error", "mid-transfer", "failed", now, case_hook("transport_error")),
        ("transport never completes", "mid-transfer", "failed", timeout, case_hook("transport_hang")),
        ("confirmation lost", "before release", "failed", timeout, case_hook("lose_release")),
        ("confirmation duplicated", "before release", "loaded", now, case_hook("duplicate_release")),
        ("duplicate request id at decode", "claim", "loaded,failed", now, case_duplicate_decode),
        ("retry after failure", "after failure", "failed,failed,loaded", now, case_retry_after_failure),
        ("fingerprint: main_row_bytes", "handshake", "failed", now,
         case_fingerprint("main_row_bytes", {"cache_dtype": "auto"})),
        ("fingerprint: full_indexer_layers", "handshake", "failed", now,
         case_fingerprint("full_indexer_layers", {"model": other_layers_model})),
        ("fingerprint: mtp_layers", "handshake", "failed", now,
         case_fingerprint("mtp_layers", {"model": no_mtp_model})),
    ]  # fmt: skip
    return out


def run(model: str, other_layers_model: str, no_mtp_model: str, log_dir: Path, port: int,
        only: str = "") -> list[Row]:  # fmt: skip
    matrix = Matrix(model, log_dir, port)
    rows = []
    sizes = itertools.cycle([(1000, 0), (700, 256), (64, 0), (2000, 512), (130, 64)])
    try:
        matrix.handoff(tokens=200)  # the first handshake, outside any case
        for (name, state, expect, bound_s, runner), (tokens, prefix) in zip(
            cases(other_layers_model, no_mtp_model), sizes, strict=False
        ):
            if only and only not in name:
                continue
            row = Row(name, state, expect, bound_s=bound_s, tokens=[tokens], prefix=prefix)
            try:
                runner(matrix, row)
                matrix.settled(row)
            except Exception as exc:  # one broken case must not hide the others
                row.error = f"{type(exc).__name__}: {exc}"
            rows.append(row)
    finally:
        matrix.close()
    return rows


def problems(row: Row) -> list[str]:
    """What is wrong with a row; empty when the fault was handled as glm-pd promises."""
    out = []
    if row.error:
        out.append(row.error)
    if row.served_wrong:
        out.append("output produced from bad KV")
    if ",".join(row.outcomes) != row.expect:
        out.append(f"outcomes {row.outcomes}, expected {row.expect}")
    if row.prefill_blocks_left or row.decode_blocks_left:
        out.append(f"blocks left: prefill {row.prefill_blocks_left}, decode {row.decode_blocks_left}")
    if row.service_state_left:
        out.append(f"service state left: {row.service_state_left}")
    if not row.next_ok:
        out.append("the next request did not succeed")
    # A case's bound holds on an idle machine; on a loaded one the ordinary work inside it (a handshake, a read)
    # stretches too, so twice what a clean request took there and then is added (never a fixed guess at the load).
    allowed = row.bound_s + 2 * row.baseline_s
    if row.detect_s > allowed:
        out.append(
            f"took {row.detect_s:.2f} s to detect, over this case's bound of {row.bound_s:.1f} s "
            f"+ 2 x {row.baseline_s:.2f} s (a clean request's time then)"
        )
    return out

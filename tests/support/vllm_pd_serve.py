"""A long-lived vLLM instance driven by commands: the fault matrix and the soak use it.

The engine is ``tests.support.vllm_engine.Engine``: vLLM's own Scheduler, KVCacheManager and block pool around
GlmPdConnector (scheduler side and worker side), NIXL or Mooncake on loopback. Only the GPU forward is a test
double (see that module). A command becomes what the API server would hand EngineCore (add a request, abort
it); the events are what vLLM itself did: a request's finish and its kv_transfer_params, the step its blocks
went back to the pool, the connector's report of its load.

Commands, one JSON object per stdin line: ``prefill`` {rid, tokens, seed, aborted?}, ``decode`` {rid,
params, prefix, seed, fault?}, ``abort`` {rid}, ``status``, ``quit``. Events, ``PD {...}`` lines on stdout:
``params``, ``freed``, ``result``, ``stalled`` (a test hook paused a load), ``status``, ``ready``.
A decode ``prefix`` is made a real prefix-cache hit: decode first computes those tokens itself (a plain request,
its own bytes, not prefill's), when vLLM has prefix caching on; otherwise the request has no hit.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time

from tests.support import faults
from tests.support.vllm_engine import Engine

_out = threading.Lock()
PREFIX_SALT = 1000  # decode's own prefix bytes differ from prefill's: a read that strays into them shows


def emit(obj: dict) -> None:
    with _out:
        sys.stdout.write("PD " + json.dumps(obj) + "\n")
        sys.stdout.flush()


class _HookEvents(logging.Handler):
    """Turns the fault injector's stall lines into ``stalled`` events, so a driver can act mid-load."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("fault injector:"):
            rid, _seconds, where = record.args
            emit({"event": "stalled", "rid": rid, "where": where, "t": time.monotonic()})


def rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def prompt_of(seed: int, n: int) -> list[int]:
    """Token ids of one request: distinct per seed, so no request hits another's cached blocks by accident."""
    return list(range(seed * 1_000_000, seed * 1_000_000 + n))


class Serving:
    def __init__(self, job: dict) -> None:
        self.engine = Engine(job)
        self.bs = self.engine.block_size
        self.prefilling: set[str] = set()  # running at prefill, params not out yet
        self.held: set[str] = set()  # finished at prefill, blocks held for decode
        self.warming: dict[str, dict] = {}  # decode's own prefix request -> the decode command waiting on it
        self.loading: dict[str, dict] = {}  # decode requests vLLM holds
        self.reports: dict[str, tuple[bool, float]] = {}  # what the connector reported: ok, when
        self.reasons: dict[str, str] = {}
        for worker in self.engine.workers:
            service = worker._worker.decode
            if service is not None:
                service.results = self._recording(service.results)

    def _recording(self, results):
        def wrapped(wait_s: float = 0.0):
            out = results(wait_s)
            for r in out:
                self.reasons[r.request_id] = r.reason
            return out

        return wrapped

    # -- commands ----------------------------------------------------------------------------------
    def prefill(self, cmd: dict) -> None:
        rid, n, seed = cmd["rid"], cmd["tokens"], cmd["seed"]
        if rid in self.engine.scheduler.requests:  # vLLM's front end makes ids unique; its scheduler asserts
            emit({"event": "params", "rid": rid, "params": None, "error": "request id in use"})
            return
        self.engine.add(rid, prompt_of(seed, n), [(n, seed)], {"do_remote_decode": True})
        if cmd.get("aborted"):  # the client went away before prefill finished: no output, no params
            self.engine.abort(rid)
            emit({"event": "params", "rid": rid, "params": None, "t": time.monotonic()})
            return
        self.prefilling.add(rid)

    def decode(self, cmd: dict) -> None:
        rid, params, prefix, seed = cmd["rid"], cmd["params"], cmd.get("prefix", 0), cmd["seed"]
        n = cmd.get("tokens") or params["remote_num_tokens"]
        cmd = {**cmd, "n": n, "t0": time.monotonic()}
        if prefix and self.engine.prefix_caching:
            warm = f"{rid}/own-prefix"
            self.engine.add(warm, prompt_of(seed, prefix), [(prefix, seed + PREFIX_SALT)], None)
            self.warming[warm] = cmd
        else:
            self._start_decode({**cmd, "prefix": 0})

    def _start_decode(self, cmd: dict) -> None:
        rid, n, prefix, seed = cmd["rid"], cmd["n"], cmd["prefix"], cmd["seed"]
        segments = [(prefix, seed + PREFIX_SALT), (n, seed)] if prefix else [(n, seed)]
        if cmd.get("fault"):
            self.engine.faults[rid] = cmd["fault"]
        self.engine.add(rid, prompt_of(seed, n), segments, cmd["params"])
        self.loading[rid] = {"t0": cmd["t0"], "aborted": False}

    def abort(self, cmd: dict) -> None:
        """A client disconnect: vLLM finishes the request; its blocks wait for the load to end."""
        state = self.loading.get(cmd["rid"])
        if state is not None:
            state["aborted"] = True
            self.engine.abort(cmd["rid"])

    def status(self) -> dict:
        """vLLM's own state (requests it holds, blocks out of its pool) and every per-request and per-peer map
        the services keep (their ``leftovers``)."""
        workers = [w._worker for w in self.engine.workers]
        services = [s for w in workers for s in (w.prefill, w.decode) if s is not None]
        held: dict[str, int] = {}
        for service in services:
            for key, count in service.leftovers().items():
                held[key] = held.get(key, 0) + count
        return {
            "event": "status",
            "blocks_held": self.engine.num_blocks - 1 - self.engine.free_blocks(),  # block 0 is vLLM's null block
            "requests_held": len(self.engine.scheduler.requests),
            **held,
            "inflight": sum(len(w._inflight) for w in workers),
            "pending": len(self.engine.connector._scheduler._pending),
            "rss_kb": rss_kb(),
        }

    # -- EngineCore's loop ---------------------------------------------------------------------------
    def step(self) -> None:
        before = len(self.engine.reported_recving)
        self.engine.step()
        now = time.monotonic()
        for rid in self.engine.reported_recving[before:]:
            self.reports[rid] = (rid not in self.engine.reported_failed, now)
        live = self.engine.scheduler.requests
        for rid in [r for r in self.prefilling if self.engine.tracked[r].finish is not None]:
            self.prefilling.discard(rid)
            params = self.engine.tracked[rid].kv_transfer_params
            if params:
                self.held.add(rid)
            emit({"event": "params", "rid": rid, "params": params, "t": now})
        for rid in [r for r in self.held if r not in live]:
            self.held.discard(rid)
            emit({"event": "freed", "rid": rid, "t": now})
        for warm in [w for w in self.warming if w not in live]:
            self._start_decode(self.warming.pop(warm))
        for rid in [r for r in self.loading if r not in live]:
            self._result(rid, self.loading.pop(rid), now)
        for rid in [r for r in self.engine.tracked if r not in live]:  # ended: nothing more to read about it
            del self.engine.tracked[rid]

    def _result(self, rid: str, state: dict, now: float) -> None:
        track = self.engine.tracked[rid]
        ok, t = self.reports.pop(rid, (None, now))
        served = bool(track.tokens)
        emit({
            "event": "result", "rid": rid, "outcome": {True: "loaded", False: "failed", None: "no_load"}[ok],
            "aborted": state["aborted"], "finish": track.finish, "served": served,
            "served_wrong": served and bool(track.mismatched), "mismatched": len(track.mismatched),
            "mismatched_at": track.mismatched[:3],
            "reason": self.reasons.pop(rid, ""), "t0": state["t0"], "t": t,
        })  # fmt: skip


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    logging.getLogger(faults.__name__).addHandler(_HookEvents())  # where the fault injector says it stalls
    serving = Serving(json.loads(sys.argv[1]))
    commands: queue.SimpleQueue[dict | None] = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            commands.put(json.loads(line))
        commands.put(None)

    threading.Thread(target=read, daemon=True).start()
    emit({"event": "ready", "pid": os.getpid(), "block_size": serving.bs})
    while True:
        try:
            while True:
                cmd = commands.get_nowait()
                if cmd is None or cmd["op"] == "quit":
                    serving.engine.shutdown()
                    return
                if cmd["op"] == "status":
                    emit(serving.status())
                else:
                    getattr(serving, cmd["op"])(cmd)
        except queue.Empty:
            pass
        serving.step()
        time.sleep(0.005)


if __name__ == "__main__":
    main()

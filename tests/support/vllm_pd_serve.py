"""A long-lived vLLM instance's connector side, driven by commands: the fault matrix and the soak use it.

The same real parts as ``vllm_pd_proc`` (a real ``VllmConfig``, ``GlmPdConnector`` scheduler and workers, real
``Request`` objects, CPU tensors shaped as vLLM allocates them, NIXL or Mooncake on loopback), but serving
requests one command at a time, with a block pool kept the way vLLM's allocator keeps it: a prefill
request's blocks stay allocated until the connector reports it finished sending; a decode request's until it
reports the load finished (failed or not, aborted or not: vLLM frees an aborted request's blocks only after
its load ends). Freed prefill blocks are overwritten at once, as a busy engine reuses them, so a decode that
read them after the free would hold wrong bytes, and the content check would see it.
Test double: the model forward (no GPU): prefill writes layout-valid token bytes, decode checks them.

Commands, one JSON object per stdin line: ``prefill`` {rid, tokens, seed, aborted?}, ``decode`` {rid,
params, prefix, seed, fault?}, ``abort`` {rid}, ``status``, ``quit``. Events, ``PD {...}`` lines on stdout:
``params``, ``freed``, ``result``, ``stalled`` (a test hook paused a load), ``status``, ``ready``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import sys
import threading
import time

import numpy as np
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import RequestStatus

from glm_pd_common.layout.pages import num_pages_for
from tests.support.vllm_pd_proc import Instance, request

_out = threading.Lock()
PREFIX_SALT = 1000  # decode's prefix-hit bytes differ from prefill's


def emit(obj: dict) -> None:
    with _out:
        sys.stdout.write("PD " + json.dumps(obj) + "\n")
        sys.stdout.flush()


class _HookEvents(logging.Handler):
    """Turns the decode service's test-hook log lines into ``stalled`` events, so a driver can act mid-load."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("glm-pd test hook:"):
            rid, _seconds, where = record.args
            emit({"event": "stalled", "rid": rid, "where": where, "t": time.monotonic()})


def rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


class Serving:
    def __init__(self, job: dict) -> None:
        self.job = job
        self.inst = Instance(job)
        self.bs = job["block_size"]
        self.rng = np.random.default_rng(job.get("seed", 0))
        self.free: set[int] = set(range(job["num_blocks"]))
        self.held: dict[str, list[np.ndarray]] = {}
        self.loading: dict[str, dict] = {}
        self.faults: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        for worker in self.inst.workers:
            service = worker._worker.decode
            if service is not None:
                service.submit = self._with_fault(service.submit)
                service.results = self._recording(service.results)

    # -- hooks around the decode service (test doubles for a router that injects faults) ---------
    def _with_fault(self, submit):
        def wrapped(job):
            submit(dataclasses.replace(job, test_fault=self.faults.get(job.request_id, "")))

        return wrapped

    def _recording(self, results):
        def wrapped():
            out = results()
            for r in out:
                self.reasons[r.request_id] = r.reason
            return out

        return wrapped

    # -- the block pool --------------------------------------------------------------------------
    def take(self, n: int) -> np.ndarray | None:
        if len(self.free) < n:
            return None
        blocks = self.rng.choice(sorted(self.free), size=n, replace=False)
        self.free.difference_update(int(b) for b in blocks)
        return blocks

    def give_back(self, blocks: np.ndarray, *, poison: bool) -> None:
        if poison:  # another request's forward would overwrite them now
            for caches in self.inst.caches:
                for buf in caches.buffers.values():
                    buf[blocks] = 0xA5
        self.free.update(int(b) for b in blocks)

    # -- commands ----------------------------------------------------------------------------------
    def prefill(self, cmd: dict) -> None:
        rid, n = cmd["rid"], cmd["tokens"]
        blocks = self.take(num_pages_for(n, self.bs))
        if blocks is None:
            emit({"event": "params", "rid": rid, "params": None, "error": "block pool exhausted"})
            return
        for caches in self.inst.caches:
            caches.write_tokens(blocks, 0, n, seed=cmd["seed"])
        req = request(rid, n, {"do_remote_decode": True})
        req.num_computed_tokens = n
        req.status = RequestStatus.FINISHED_ABORTED if cmd.get("aborted") else RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = self.inst.scheduler.request_finished_all_groups(req, (blocks.tolist(),))
        if delay:
            self.held.setdefault(rid, []).append(blocks)
        else:
            self.give_back(blocks, poison=True)
        emit({"event": "params", "rid": rid, "params": params, "t": time.monotonic()})

    def decode(self, cmd: dict) -> None:
        rid, params, prefix = cmd["rid"], cmd["params"], cmd.get("prefix", 0)
        n = cmd.get("tokens") or params["remote_num_tokens"]
        blocks = self.take(num_pages_for(n, self.bs))
        if blocks is None:
            emit({"event": "result", "rid": rid, "outcome": "refused", "reason": "block pool exhausted"})
            return
        for caches in self.inst.caches:
            # the local prefix-cache hit, other bytes than prefill's: a read into the prefix would show
            caches.write_tokens(blocks, 0, prefix, seed=cmd["seed"] + PREFIX_SALT)
        self.faults[rid] = cmd.get("fault", "")
        req = request(rid, n, params)
        t0 = time.monotonic()
        count, _ = self.inst.scheduler.get_num_new_matched_tokens(req, prefix)
        if not count:
            self.give_back(blocks, poison=False)
            emit({"event": "result", "rid": rid, "outcome": "no_load", "t0": t0, "t": time.monotonic()})
            return
        table = KVCacheBlocks(([KVCacheBlock(int(b)) for b in blocks],))
        self.inst.scheduler.update_state_after_alloc(req, table, count)
        self.loading[rid] = {
            "req": req, "blocks": blocks, "n": n, "prefix": prefix, "seed": cmd["seed"], "t0": t0, "aborted": False
        }  # fmt: skip

    def abort(self, cmd: dict) -> None:
        """A client disconnect or an abort: vLLM finishes the request; its blocks wait for the load to end."""
        state = self.loading.get(cmd["rid"])
        if state is not None:
            state["aborted"] = True
            state["req"].status = RequestStatus.FINISHED_ABORTED
            self.inst.scheduler.request_finished_all_groups(state["req"], (state["blocks"].tolist(),))

    def status(self) -> dict:
        """Blocks held, and every per-request and per-peer map the services keep (their ``leftovers``)."""
        workers = [w._worker for w in self.inst.workers]
        services = [s for w in workers for s in (w.prefill, w.decode) if s is not None]
        held: dict[str, int] = {}
        for service in services:
            for key, count in service.leftovers().items():
                held[key] = held.get(key, 0) + count
        return {
            "event": "status",
            "blocks_held": self.job["num_blocks"] - len(self.free),
            "requests_held": len(self.held) + len(self.loading),
            **held,
            "inflight": sum(len(w._inflight) for w in workers),
            "pending": len(self.inst.scheduler._scheduler._pending),
            "rss_kb": rss_kb(),
        }

    # -- the engine loop ---------------------------------------------------------------------------
    def step(self) -> None:
        sent, received, failed, _ = self.inst.step()
        now = time.monotonic()
        for rid in sent:
            del self.inst.sent[rid]
            for blocks in self.held.pop(rid, []):
                self.give_back(blocks, poison=True)
            emit({"event": "freed", "rid": rid, "t": now})
        for rid in received:
            del self.inst.received[rid]
            state = self.loading.pop(rid, None)
            if state is None:
                continue
            ok = rid not in failed
            blocks, n, seed = state["blocks"], state["n"], state["seed"]
            p = state["prefix"]
            bad = [
                m
                for c in self.inst.caches
                for m in c.mismatched_tokens(blocks, 0, p, seed=seed + PREFIX_SALT)
                + c.mismatched_tokens(blocks, p, n, seed=seed)
            ]
            self.give_back(blocks, poison=False)
            emit({
                "event": "result", "rid": rid, "outcome": "loaded" if ok else "failed", "aborted": state["aborted"],
                "served_wrong": ok and not state["aborted"] and bool(bad), "mismatched": len(bad),
                "reason": self.reasons.pop(rid, ""), "t0": state["t0"], "t": now,
            })  # fmt: skip


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("glm_pd_common.handoff.decode_service").addHandler(_HookEvents())
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
                    serving.inst.shutdown()
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

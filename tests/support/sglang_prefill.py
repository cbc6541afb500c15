"""Prefill's scheduler steps over SGLang's own queue and send code (used by tests/support/sglang_proc.py).

Each step runs, per rank, what ``event_loop_overlap_disagg_prefill`` runs, in its order:
``PrefillBootstrapQueue.add`` for new requests (SGLang's ``Req``; the queue creates the glm-pd sender),
``pop_bootstrapped`` (SGLang's poll, ``finalize_bootstrap``: decode's prefix, sender ``init``, metadata
slot), then for every running request the next batch: ``maybe_send_cached_prefix_chunk`` before the
launch (SGLang's early send of the cached prefix: pages of the previous chunk whose forward may still run,
with a ``wait_event`` recorded on the forward stream), the launch of the next chunk (pages from SGLang's
``PagedTokenToKVPoolAllocator``, written to SGLang's ``ReqToTokenPool`` row), then the result of the
previous batch: SGLang's ``send_kv_chunk`` (page ids from the row via ``kv_to_page_indices``, DSA state
via ``suffix_page_indices``, ``MetadataBuffers.set_buf`` on the last chunk), then polling the in-flight
senders. Chunked prefill, overlap scheduling and the early send are SGLang's defaults.

Test doubles (the GPU is absent): ``StreamDouble`` stands in for the forward CUDA stream and
``EventDouble`` for ``torch.cuda.Event`` (patched in for SGLang's code): a launched forward's bytes land
only when an event recorded behind it is synchronized, or when the scheduler takes that batch's result,
and the scheduler takes it only once the backend has had the early-sent chunk (at most ``_RESULT_WAIT_S``):
the worst timing a GPU may show, so a backend that reads before synchronizing reads stale bytes every time.
Imitated, not SGLang's: the batch formation (one chunk of each running request per step, every request's
own ``chunk_pages``), and the in-flight queue's release (pages, row and metadata slot freed here the way
``process_disagg_prefill_inflight_queue`` frees them, without a radix tree).

Observation hook: for a request marked ``observe_chunks``, once the backend has written every chunk handed to
it so far, the loop records prefill's bytes of the pages sent and calls ``between_chunks`` (room, tokens
sent) before going on, so a test can look at decode's caches while the rest of the request is unsent.
"""

from __future__ import annotations

import math
import os
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

from tests.support.device_double import DeviceDouble
from tests.support.sglang_rank import Rank, rss_kb

_RESULT_WAIT_S = 1.0


class Write:
    """One forward's bytes (its chunk ends at token ``end``), landing once."""

    def __init__(self, fn: Callable[[], None], end: int) -> None:
        self.fn, self.end, self.done = fn, end, False

    def land(self) -> None:
        if not self.done:
            self.done = True
            self.fn()


DEVICES = DeviceDouble()  # torch's per-thread CUDA device, as the event doubles see it


class StreamDouble:
    """Test double for the forward stream: the writes of launched forwards that have not landed yet."""

    def __init__(self) -> None:
        self.pending: list[Write] = []

    def launch(self, write: Write) -> None:
        self.pending = [w for w in self.pending if not w.done] + [write]


class EventDouble:
    """Test double for ``torch.cuda.Event``: ``record`` captures what the stream still has to write,
    ``synchronize`` waits for it (here: makes it land). ``made`` lists every one, in order."""

    made: ClassVar[list[EventDouble]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.writes: list[Write] = []
        self.synced_off_main = False  # synchronized by a backend thread, not the scheduler's
        self.kind = "wait"  # or "indices" (page ids copied to the host)
        self.synced_on: int | None = None  # the CUDA device the synchronizing thread had selected
        EventDouble.made.append(self)

    def record(self, stream: StreamDouble | None = None) -> None:
        self.writes = list(stream.pending) if stream is not None else []

    def synchronize(self) -> None:
        self.synced_off_main |= threading.current_thread() is not threading.main_thread()
        self.synced_on = DEVICES.current_device()
        for w in self.writes:
            w.land()

    def query(self) -> bool:
        return all(w.done for w in self.writes)


@dataclass
class Running:
    """One request on one rank, from arrival to release."""

    spec: dict[str, Any]
    req: Req
    arrived: float
    table: list[int] = field(default_factory=list)  # pages allocated so far, in token order
    done_tokens: int = 0  # tokens whose forward was launched
    last_write: Write | None = None  # the launched forward whose result is not taken yet
    first_token: int = 0
    bootstrapped: bool = False
    sent_last: bool = False
    early_sent: bool = False  # this step's early send handed the backend a chunk behind an event
    observed: dict[int, dict[str, list[str]]] = field(default_factory=dict)  # tokens sent -> prefill's page digests
    events: list[EventDouble] = field(default_factory=list)  # SGLang recorded these for its early sends


class PrefillLoop:
    """All ranks of one prefill engine, stepped together; each rank's queue and senders are its own."""

    def __init__(
        self,
        ranks: list[Rank],
        cfg: dict[str, Any],
        model: Any,
        bootstrap_port: int,
        between_chunks: Callable[[int, int], None] | None = None,
    ) -> None:
        torch.cuda.Event = EventDouble  # what SGLang's prefill code records for the early send
        self.ranks, self.cfg, self.model, self.port = ranks, cfg, model, bootstrap_port
        self.page = cfg["page_size"]
        self.streams = [StreamDouble() for _ in ranks]
        for r, s in zip(ranks, self.streams, strict=True):
            r.scheduler.forward_stream = s
        self.waiting: list[dict[str, Any]] = list(cfg["requests"])
        self.active: list[list[Running]] = [[] for _ in ranks]
        self.results: list[dict[str, Any]] = []
        self.between_chunks = between_chunks

    def run(self) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 60 + 30 * len(self.waiting)
        while self.waiting or any(self.active):
            self._arrivals()
            for i in range(len(self.ranks)):
                self._step(i)
            self._collect()
            if time.monotonic() > deadline:
                raise SystemExit("prefill loop did not finish its requests")
            time.sleep(0.001)  # a scheduler step; the transfer lanes and decode share these cores
        return self.results

    # -- arrivals: a request arrives with the one before it when marked so, else after all before it ended
    def _arrivals(self) -> None:
        if not self.waiting or (any(self.active) and not self.waiting[0].get("with_previous")):
            return
        batch = [self.waiting.pop(0)]
        while self.waiting and self.waiting[0].get("with_previous"):
            batch.append(self.waiting.pop(0))
        for spec in batch:
            if spec.get("release_resume"):
                for r in self.ranks:
                    r.release_and_resume()
            for i, r in enumerate(self.ranks):
                if spec.get("prefill_fault") in ("error", "hang"):
                    r.faults.kinds[str(spec["room"])] = f"transport_{spec['prefill_fault']}"
                if spec.get("prefill_fault") == "drop_indexer" and i in spec["fault_ranks"]:
                    r.faults.kinds[str(spec["room"])] = "drop_indexer"
                req = self._req(spec)
                r.queue.add(req, num_kv_heads=1)
                self.active[i].append(Running(spec, req, time.perf_counter()))
                if spec.get("host_indices"):
                    _send_host_indices(self.active[i][-1])

    def _req(self, spec: dict[str, Any]) -> Req:
        ids = spec.get("prompt") or prompt_ids(spec["room"], spec["tokens"])
        req = Req(
            rid=f"room-{spec['room']}",
            origin_input_text="",
            origin_input_ids=array("i", ids),
            sampling_params=SamplingParams(max_new_tokens=1),
            bootstrap_host="127.0.0.1",
            bootstrap_port=self.port,
            bootstrap_room=spec["room"],
            disagg_mode=DisaggregationMode.PREFILL,
        )
        return req

    # -- one scheduler step of one rank ---------------------------------------------------------------
    def _step(self, i: int) -> None:
        r, stream = self.ranks[i], self.streams[i]
        bootstrapped = {id(req) for req in r.queue.pop_bootstrapped()}  # optimistic prefill is off (default)
        for run in self.active[i]:
            if id(run.req) in bootstrapped:
                run.bootstrapped = True
                if run.spec.get("prefill_exit") == "after_bootstrap":
                    print("GLMPD_TEST exiting mid-handoff", flush=True)
                    os._exit(0)
                if run.spec.get("prefill_fault") == "abort":
                    run.req.disagg_kv_sender.abort()  # prefill's scheduler aborts it before it computes
                    run.sent_last = True
        for run in self.active[i]:
            if run.sent_last or not run.bootstrapped:
                continue
            previous, run.last_write = run.last_write, None
            if run.done_tokens < len(run.req.origin_input_ids):
                run.req.prefix_len = run.done_tokens  # a chunked request's computed chunks are its cached prefix
                sent_before, made_before = run.req.start_send_idx, len(EventDouble.made)
                r.scheduler.maybe_send_cached_prefix_chunk(run.req)
                run.early_sent = run.req.start_send_idx > sent_before
                run.events += [e for e in EventDouble.made[made_before:] if e.kind == "wait"]
                self._launch(r, stream, run)
            if previous is not None:
                self._take_result(r, run, previous)

    def _launch(self, r: Rank, stream: StreamDouble, run: Running) -> None:
        n_total = len(run.req.origin_input_ids)
        step = (run.spec.get("chunk_pages") or math.ceil(n_total / self.page)) * self.page
        start, stop = run.done_tokens, min(run.done_tokens + step, n_total)
        pages = math.ceil(stop / self.page) - len(run.table)
        indices = r.allocator.alloc(pages * self.page)
        if indices is None:
            raise SystemExit(f"prefill pool exhausted at room {run.spec['room']}")
        if not run.table:
            r.req_to_token_pool.alloc([run.req])
        row = run.req.kv.req_pool_idx
        base = len(run.table) * self.page
        r.req_to_token_pool.req_to_token[row, base : base + indices.numel()] = indices.to(torch.int32)
        run.table += (indices[:: self.page] // self.page).tolist()
        run.req.extend_end = stop
        new_pages = np.array(run.table[start // self.page :], dtype=np.int64)
        if self.model is not None:
            table = np.array(run.table, dtype=np.int64)

            def write() -> None:
                run.first_token = self.model.prefill(run.spec["prompt"], r.paged(table))
        else:

            def write() -> None:
                r.write_pages(new_pages, seed=run.spec["room"] * 1000 + start)
                run.first_token = run.spec["room"] % 1000

        run.last_write = Write(write, stop)
        stream.launch(run.last_write)
        run.done_tokens = stop

    def _take_result(self, r: Rank, run: Running, write: Write) -> None:
        """SGLang's result processing waits for the forward; the worst case: it finishes only now."""
        room = run.spec["room"]
        deadline = time.monotonic() + _RESULT_WAIT_S
        while run.early_sent and r.mgr._staging_outstanding.get(room, 0) and time.monotonic() < deadline:
            time.sleep(0.001)
        write.land()
        run.early_sent = False
        if run.spec.get("observe_chunks") and self.between_chunks is not None:
            self._observe(r, run, self.between_chunks)
        if write.end == len(run.req.origin_input_ids):
            run.req.output_ids.append(run.first_token)
            self._set_seeds(run)
            r.scheduler.send_kv_chunk(run.req, last_chunk=True)
            run.sent_last = True
        else:  # overlap: a middle chunk is sent when its result is taken (SGLang page-aligns it down)
            r.scheduler.send_kv_chunk(run.req, last_chunk=False, end_idx=write.end)

    def _observe(self, r: Rank, run: Running, between_chunks: Callable[[int, int], None]) -> None:
        """Once the backend wrote every chunk it was handed, and something new was sent: prefill's bytes of the
        pages sent so far, then the hook (the last chunk is not sent before it returns)."""
        room, deadline = run.spec["room"], time.monotonic() + 30
        while r.mgr._staging_outstanding.get(room, 0):
            if time.monotonic() > deadline:
                raise SystemExit(f"room {room}: the backend never finished its chunks")
            time.sleep(0.001)
        sent = run.req.start_send_idx
        if sent <= max(run.observed, default=run.req.disagg_decode_prefix_len):
            return
        first = run.req.disagg_decode_prefix_len // self.page
        run.observed[sent] = r.page_digests(np.array(run.table[first : sent // self.page], dtype=np.int64))
        between_chunks(room, sent)

    def _set_seeds(self, run: Running) -> None:
        """An MTP batch result: hidden states, EAGLE top-k and (GLM-5.2+) the DSA top-k seeds of the request."""
        seeds = run.spec.get("seeds")
        if seeds is None:
            return
        gen = torch.Generator().manual_seed(run.spec["room"])
        req = run.req
        req.hidden_states_tensor = torch.randn(16, generator=gen)
        req.output_topk_p = torch.rand(4, generator=gen)
        req.output_topk_index = torch.randint(0, 500, (4,), generator=gen)
        req.output_dsa_topk_indices = None
        if seeds != "none":  # "none": a seedless prefill; SGLang writes the invalid sentinel row
            row = torch.randint(0, run.done_tokens, (64,), dtype=torch.int32, generator=gen)
            if seeds == "partial":
                row[len(row) // 2 :] = -1  # fewer candidates than the width: the tail is the sentinel
            req.output_dsa_topk_indices = row

    # -- the in-flight queue ----------------------------------------------------------------------------
    def _collect(self) -> None:
        rooms = {run.spec["room"] for runs in self.active for run in runs}
        for room in rooms:
            runs = [next(run for run in runs if run.spec["room"] == room) for runs in self.active]
            states = []
            for r, run in zip(self.ranks, runs, strict=True):
                failed = any(req is run.req for req in r.scheduler.failed)
                states.append(KVPoll.Failed if failed else int(run.req.disagg_kv_sender.poll()))
            done = [
                s == KVPoll.Failed or (run.sent_last and s == KVPoll.Success)
                for s, run in zip(states, runs, strict=True)
            ]
            if all(done):
                self._finish(room, runs, states)

    def _finish(self, room: int, runs: list[Running], states: list[int]) -> None:
        out: dict[str, Any] = {"room": room, "states": states}
        out["seconds"] = time.perf_counter() - min(run.arrived for run in runs)
        out["rss_kb"] = rss_kb()
        out["reasons"] = [
            reason_of(run.req.disagg_kv_sender) if s == KVPoll.Failed else ""
            for run, s in zip(runs, states, strict=True)
        ]
        out["chunk_digests"] = [run.observed for run in runs]
        for kind in ("wait", "indices"):  # per rank: events SGLang handed over, and those the backend waited on
            out[f"{kind}_events"] = [sum(e.kind == kind for e in run.events) for run in runs]
            out[f"{kind}_events_synced"] = [
                sum(e.kind == kind and e.synced_off_main for e in run.events) for run in runs
            ]
        out["synced_on"] = sorted({e.synced_on for run in runs for e in run.events if e.synced_on is not None})
        for i, (r, run) in enumerate(zip(self.ranks, runs, strict=True)):
            if run.last_write is not None:
                run.last_write.land()  # the GPU finishes every forward eventually
            prefix = run.req.disagg_decode_prefix_len
            if states[i] == KVPoll.Success:
                out.setdefault("src_digests", []).append(r.page_digests(np.array(run.table[prefix // self.page :])))
                out.setdefault("prefix", []).append(prefix)
                out.setdefault("meta_rows", []).append(meta_row(r, run.req.metadata_buffer_index))
                run.req.disagg_kv_sender.clear()
            self._release(r, run)
            self.active[i].remove(run)
            r.faults.kinds.pop(str(room), None)
        self.results.append(out)

    def _release(self, r: Rank, run: Running) -> None:
        if run.table:
            row = run.req.kv.req_pool_idx
            r.allocator.free(r.req_to_token_pool.req_to_token[row, : len(run.table) * self.page].to(torch.int64))
            r.req_to_token_pool.free(run.req)
        if run.req.metadata_buffer_index >= 0:
            r.meta.clear_slot(run.req.metadata_buffer_index)
            r.meta_slots.free(run.req.metadata_buffer_index)
            run.req.metadata_buffer_index = -1


def prompt_ids(room: int, num_tokens: int) -> list[int]:
    """A request's token ids when the test gives none (both roles derive the same)."""
    return [(room * 7 + t) % 500 for t in range(num_tokens)]


def _send_host_indices(run: Running) -> None:
    """Hand the backend page ids the way SGLang does for a sender taking host tensors: a host buffer that a
    device-to-host copy fills later (here: when ``indices_event`` is synchronized); until then it reads as
    page 0, SGLang's padding page."""
    sender = run.req.disagg_kv_sender
    send = sender.send

    def send_host(kv_indices: np.ndarray, state_indices: list | None = None, **kwargs: Any) -> None:
        host = torch.zeros(len(kv_indices), dtype=torch.int32)
        event = EventDouble()
        event.kind, event.writes = "indices", [Write(lambda: host.copy_(torch.as_tensor(kv_indices)), 0)]
        run.events.append(event)
        send(host, state_indices, indices_event=event, **kwargs)

    sender.send = send_host


def meta_row(r: Rank, slot: int) -> dict[str, str]:
    """Every metadata buffer's row for a slot, as hex (what must arrive byte for byte)."""
    names = ["output_ids", "output_topk_p", "output_topk_index", "output_hidden_states", "output_dsa_topk_indices"]
    out = {}
    for name in names:
        buf = getattr(r.meta, name)
        if buf is not None:
            out[name] = buf[slot].contiguous().view(torch.uint8).numpy().tobytes().hex()
    return out


def reason_of(obj: Any) -> str:
    """Why a sender or receiver failed, as SGLang recorded it (its ``failure_exception``)."""
    try:
        obj.failure_exception()
    except Exception as exc:  # SGLang raises KVTransferError with the recorded reason
        return str(getattr(exc, "failure_reason", exc))
    return ""

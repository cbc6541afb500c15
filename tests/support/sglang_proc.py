"""One SGLang role (prefill or decode, one or more attention-TP ranks) driving the real backend classes.

It does what SGLang's prefill and decode schedulers do with a transfer backend, step by step:
- caches shaped as SGLang's DSA pool allocates them on this CPU: per layer a main MLA buffer
  ``(pool_tokens + page, 1, row)`` uint8, an indexer buffer ``(pages, page * 132)`` uint8 on full layers and
  a 0-row one on shared layers, the draft (MTP) layer after the target's; SGLang's real ``MetadataBuffers``;
  SGLang's real ``KVArgs``, runtime context and bootstrap server;
- prefill: sender per rank, poll to WaitingForInput, ``pop_decode_prefix_len``, ``init``, the metadata row,
  ``send`` in chunks with the DSA state on the last one, poll to Success/Failed, ``clear``;
- decode: ``try_ensure_parallel_info``, receiver per rank, ``init``, ``send_metadata`` with the suffix pages
  and ``decode_prefix_len``, poll to Success/Failed, check the metadata row, ``clear``.
The GPU is the only thing replaced (caches live in host memory, SGLang's ``device="cpu"``). Results (poll
walks, reasons, per-page digests of the suffix, timings) go to a JSON file for the test to compare.

Usage: python -m tests.support.sglang_proc CONFIG.json
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

cfg: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
os.environ.update(cfg.get("env", {}))
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, StateType  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVReceiver  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    KVClassType,
    MetadataBuffers,
    TransferBackend,
    get_kv_class,
)
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

load_plugins()
from tests.support.tiny_dsa import PagedCache, TinyDsa  # noqa: E402

ROLE = cfg["role"]
PAGE = cfg["page_size"]
POOL_PAGES = cfg.get("pool_pages", 48)
POOL_TOKENS = POOL_PAGES * PAGE
ROW = cfg.get("row_bytes", 656)
DEADLINE_S = cfg.get("timeout_s", 30.0)
BOOT = f"127.0.0.1:{cfg['bootstrap_port']}"
GEOM = json.loads((Path(cfg["model"]) / "config.json").read_text())
NUM_LAYERS = GEOM["num_hidden_layers"]
NUM_MTP = GEOM.get("num_nextn_predict_layers", 0)
FULL = set(cfg["full_layers"])
E2E = cfg.get("e2e")  # run the tiny DSA model (tests/support/tiny_dsa.py) on these caches
MODEL = TinyDsa(NUM_LAYERS, sorted(FULL), seed=E2E["seed"]) if E2E else None

server_args = prepare_server_args(
    [
        "--model-path", cfg["model"], "--device", "cpu", "--host", "127.0.0.1",
        "--disaggregation-mode", ROLE, "--disaggregation-transfer-backend", "glm-pd",
        "--disaggregation-bootstrap-port", str(cfg["bootstrap_port"]),
        "--page-size", str(PAGE), "--tp-size", str(cfg["tp"]), "--kv-cache-dtype", cfg.get("kv_dtype", "fp8_e4m3"),
    ]
)  # fmt: skip
get_context().set_server_args(server_args)
backend = TransferBackend(server_args.disaggregation_transfer_backend)
Manager = get_kv_class(backend, KVClassType.MANAGER)
Sender = get_kv_class(backend, KVClassType.SENDER)
Receiver = get_kv_class(backend, KVClassType.RECEIVER)


class Rank:
    """One attention-TP rank: its caches (as SGLang's DSA pool shapes them), metadata buffers and manager."""

    def __init__(self, rank: int) -> None:
        gen = torch.Generator().manual_seed(cfg.get("seed", 0) * 1000 + rank * 10 + (ROLE == "decode"))
        layers = NUM_LAYERS + NUM_MTP
        self.main = [
            torch.randint(0, 256, (POOL_TOKENS + PAGE, 1, ROW), dtype=torch.uint8, generator=gen) for _ in range(layers)
        ]
        index_rows = (POOL_TOKENS + PAGE + 1) // PAGE
        rows = [index_rows if (i in FULL or i >= NUM_LAYERS) else 0 for i in range(layers)]  # 0 rows: shared
        self.index = [torch.randint(0, 256, (n, PAGE * 132), dtype=torch.uint8, generator=gen) for n in rows]
        self.meta = MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=1)
        self.free_pages = list(range(1, POOL_PAGES + 1))  # page 0 is SGLang's padding page
        rng = np.random.default_rng(cfg.get("seed", 0) + 7 * rank + (ROLE == "decode"))
        rng.shuffle(self.free_pages)
        args = KVArgs()
        args.engine_rank = rank
        args.kv_data_ptrs = [t.data_ptr() for t in self.main]
        args.kv_data_lens = [t.nbytes for t in self.main]
        args.kv_item_lens = [t[0].nbytes * PAGE for t in self.main]
        args.kv_layer_ids = []
        args.num_draft_entries = NUM_MTP
        args.kv_cache_dtype_str = server_args.kv_cache_dtype
        args.kv_layout = None
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_types = [StateType.DSA]
        args.state_data_ptrs = [[t.data_ptr() for t in self.index]]
        args.state_data_lens = [[t.nbytes for t in self.index]]
        args.state_item_lens = [[t[0].nbytes if t.shape[0] else 0 for t in self.index]]
        args.state_layer_ids = [[]]
        args.state_dim_per_tensor = [[]]
        args.state_slice_outer_counts = [[]]
        args.state_conv_shard_groups = [[]]
        args.swa_kv_cache_layout = None
        args.is_hybrid_mla_backend = False
        args.ib_device = ""
        args.gpu_id = 0
        args.page_size = PAGE
        args.system_dp_rank = 0
        args.rust_http_port = None
        args.pp_rank = 0
        args.prefill_start_layer = 0
        args.prefill_end_layer = None
        args.mla_compression_ratios = None
        get_parallel().override_permanently(
            attn_tp_rank=rank, attn_cp_rank=0, attn_dp_rank=0, attn_dcp_rank=0, tp_rank=rank, pp_group=None
        )
        mode = DisaggregationMode.PREFILL if ROLE == "prefill" else DisaggregationMode.DECODE
        self.mgr = Manager(args, mode, server_args, is_mla_backend=True)
        self.transitions: list[tuple[int, int]] = []
        original = self.mgr.update_status

        def spy(room: int, status: int) -> None:  # observe the real status updates, in order
            original(room, status)
            self.transitions.append((room, int(self.mgr.request_status.get(room, -1))))

        self.mgr.update_status = spy

    def paged(self, table: np.ndarray) -> PagedCache:
        """The tiny model's view of this rank's pool: page p of a layer is rows [p * PAGE, (p + 1) * PAGE)."""
        main = {i: t.view(-1, PAGE * ROW) for i, t in enumerate(self.main)}
        index = {i: t for i, t in enumerate(self.index) if t.shape[0]}
        return PagedCache(main, index, table, PAGE)

    def take(self, n: int) -> np.ndarray:
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return np.array(pages, dtype=np.int64)

    def give(self, pages: np.ndarray) -> None:
        self.free_pages.extend(int(p) for p in pages)

    def page_digests(self, pages: np.ndarray) -> list[str]:
        """Per page: one digest over its bytes in every main and indexer buffer (what must match across)."""
        out = []
        for p in pages.tolist():
            h = xxhash.xxh3_64()
            for t in self.main:
                h.update(t[p * PAGE : (p + 1) * PAGE].numpy().tobytes())
            for t in self.index:
                if t.shape[0]:
                    h.update(t[p].numpy().tobytes())
            out.append(h.hexdigest())
        return out


def rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def walk(objs: list[Any], until: tuple[int, ...], deadline: float) -> list[int]:
    """Poll every rank's object to a status in ``until`` (all ranks, as SGLang's MIN all-reduce would)."""
    while True:
        states = [int(o.poll()) for o in objs]
        if min(states) in until or KVPoll.Failed in states:
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(0.0005)


def reason_of(obj: Any) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:  # SGLang raises KVTransferError with the recorded reason
        return str(getattr(exc, "failure_reason", exc))
    return ""


def run_prefill(ranks: list[Rank], requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for req in requests:
        room, n_tokens = req["room"], req["tokens"]
        deadline = time.monotonic() + DEADLINE_S
        started = time.perf_counter()
        senders = [Sender(r.mgr, BOOT, room) for r in ranks]
        tables = [r.take(math.ceil(n_tokens / PAGE)) for r in ranks]
        states = walk(senders, (KVPoll.WaitingForInput,), deadline)
        out: dict[str, Any] = {"room": room}
        if req.get("prefill_exit") == "after_bootstrap" and min(states) == KVPoll.WaitingForInput:
            print("GLMPD_TEST exiting mid-handoff", flush=True)
            os._exit(0)
        fault = req.get("prefill_fault")
        if fault in ("error", "hang"):
            for r in ranks:
                r.mgr.test_transfer_faults[room] = fault
        if fault == "abort" and min(states) == KVPoll.WaitingForInput:
            for s in senders:
                s.abort()  # prefill's scheduler aborts the request before it computes
            states = [int(s.poll()) for s in senders]
        elif min(states) == KVPoll.WaitingForInput:
            for r, s, table in zip(ranks, senders, tables, strict=True):
                prefix = s.pop_decode_prefix_len()
                suffix = table[prefix // PAGE :]
                slot = room % 8
                r.meta.bootstrap_room[slot, 0] = room
                # prefill's first output token travels in the metadata row, as SGLang sends it
                first = MODEL.prefill(req["prompt"], r.paged(table)) if MODEL else room % 1000
                r.meta.output_ids[slot, 0] = first
                s.init(len(suffix), slot)
                step = req.get("chunk_pages") or max(len(suffix), 1)
                starts = list(range(0, len(suffix), step)) or [0]
                for i, a in enumerate(starts):
                    last = i == len(starts) - 1
                    s.send(suffix[a : a + step], [suffix] if last else None, num_kv_tokens=None)
                out.setdefault("src_digests", []).append(r.page_digests(suffix))
                out.setdefault("prefix", []).append(prefix)
            states = walk(senders, (KVPoll.Success,), deadline)
        out["states"] = states
        out["seconds"] = time.perf_counter() - started
        out["rss_kb"] = rss_kb()
        out["reasons"] = [reason_of(s) if st == KVPoll.Failed else "" for s, st in zip(senders, states, strict=True)]
        for r, s, table in zip(ranks, senders, tables, strict=True):
            if int(s.poll()) != KVPoll.Failed:
                s.clear()
            r.give(table)  # the scheduler frees the request's pages either way
            r.mgr.test_transfer_faults.pop(room, None)
        results.append(out)
    return results


def run_decode(ranks: list[Rank], requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 60
    while not all(r.mgr.try_ensure_parallel_info(BOOT) for r in ranks):
        if time.monotonic() > deadline:
            raise SystemExit("prefill's bootstrap server never answered")
        time.sleep(0.2)
    results = []
    for req in requests:
        room, n_tokens, prefix = req["room"], req["tokens"], req.get("prefix", 0)
        deadline = time.monotonic() + DEADLINE_S
        started = time.perf_counter()
        receivers = [Receiver(r.mgr, BOOT, room) for r in ranks]
        for rc in receivers:
            rc.init(0)
        states = walk(receivers, (KVPoll.WaitingForInput,), deadline)
        out: dict[str, Any] = {"room": room}
        steps = E2E["steps"] if E2E else 0
        tables = [r.take(math.ceil((n_tokens + steps) / PAGE)) for r in ranks]  # room for decoded tokens
        end = math.ceil(n_tokens / PAGE)
        fault = req.get("fault")
        if min(states) == KVPoll.WaitingForInput:
            for r, rc, table in zip(ranks, receivers, tables, strict=True):
                suffix = table[prefix // PAGE : end].copy()
                if MODEL and prefix:
                    MODEL.prefill(req["prompt"], r.paged(table), 0, prefix)  # decode's own prefix-cache hit
                claimed = prefix
                send = rc.send_metadata
                if fault == "misaligned":
                    claimed = prefix + 1
                elif fault == "misaligned_unchecked":
                    claimed, send = prefix + 1, lambda *a, _rc=rc, **k: CommonKVReceiver.send_metadata(_rc, *a, **k)
                elif fault == "out_of_range_unchecked":
                    suffix[-1] = 10**6
                    send = lambda *a, _rc=rc, **k: CommonKVReceiver.send_metadata(_rc, *a, **k)  # noqa: E731
                elif fault == "suffix_shift":
                    claimed = prefix + PAGE
                out.setdefault("prefix_before", []).append(r.page_digests(table[: prefix // PAGE]))
                send(suffix.astype(np.int32), room % 8, [suffix], decode_prefix_len=claimed)
                if fault == "abort":
                    rc.abort()
                if fault == "corrupt":
                    r.mgr.corrupt_next_room = room
            states = walk(receivers, (KVPoll.Success,), deadline)
            for r, table in zip(ranks, tables, strict=True):
                out.setdefault("dst_digests", []).append(r.page_digests(table[prefix // PAGE : end]))
                out.setdefault("prefix_after", []).append(r.page_digests(table[: prefix // PAGE]))
                out.setdefault("aux_room", []).append(int(r.meta.bootstrap_room[room % 8, 0]))
                if MODEL and min(states) == KVPoll.Success:
                    cache = r.paged(table)
                    if fault == "drop_indexer":  # the negative control: the indexer pages never arrived
                        for buf in cache.index.values():
                            buf[table[prefix // PAGE : end]] = 0
                    first = int(r.meta.output_ids[room % 8, 0])
                    out.setdefault("tokens", []).append(MODEL.decode(first, n_tokens, cache, steps))
        out["states"] = states
        out["seconds"] = time.perf_counter() - started
        out["rss_kb"] = rss_kb()
        out["reasons"] = [
            reason_of(rc) if st == KVPoll.Failed else "" for rc, st in zip(receivers, states, strict=True)
        ]
        for r, rc, table in zip(ranks, receivers, tables, strict=True):
            rc.clear()
            r.give(table)
            r.meta.bootstrap_room[room % 8, 0] = 0
        results.append(out)
    return results


def main() -> None:
    if ROLE == "prefill":
        from glm_pd_sglang.endpoints import GlmPdKVBootstrapServer

        server = GlmPdKVBootstrapServer(host="127.0.0.1", port=cfg["bootstrap_port"])
    ranks = [Rank(i) for i in range(cfg["tp"])]
    print("GLMPD_TEST ready", flush=True)
    run = run_prefill if ROLE == "prefill" else run_decode
    results = run(ranks, cfg["requests"])
    report = {
        "results": results,
        "transitions": [r.transitions for r in ranks],
        "free_pages": [len(r.free_pages) for r in ranks],
        "pool_pages": POOL_PAGES,
        "stats": [r.mgr.stats for r in ranks],
        "refusals": [r.mgr.refusals for r in ranks],
        "leftovers": [r.mgr.leftovers() for r in ranks],
        "data_path": ranks[0].mgr.transport.info().data_path,
    }
    Path(cfg["out"]).write_text(json.dumps(report))
    if ROLE == "prefill" and cfg.get("linger_s"):
        time.sleep(cfg["linger_s"])  # decode may still be polling its last room's status
    for r in ranks:
        r.mgr.close()
    if ROLE == "prefill":
        server.close()
    print("GLMPD_TEST done", flush=True)
    os._exit(0)  # SGLang leaves non-daemon threads (aiohttp, zmq) behind; the report is written


if __name__ == "__main__":
    main()

"""One SGLang role (prefill or decode, one or more attention-TP ranks) on SGLang's own classes, on CPU.

Each rank is built from SGLang's pools, allocators, metadata buffers and the role's queue, which builds
``KVArgs`` and the glm-pd manager itself (tests/support/sglang_rank.py). Prefill runs SGLang's bootstrap
queue and send path in the order of its overlap event loop (tests/support/sglang_prefill.py). Decode, per
request, in the order ``DecodePreallocQueue`` / ``DecodeTransferQueue`` act: a request row from SGLang's
``ReqToTokenPool``, pages from SGLang's allocator (its prefix hit first, then the suffix), the receiver
(``init``, ``send_metadata`` with ``suffix_page_indices`` of the row and ``decode_prefix_len``), polling to
Success/Failed, the metadata row read with ``MetadataBuffers.get_buf``, then release.

Imitated on decode, with why: ``pop_preallocated`` and the transfer queue need the scheduler's batches,
retraction and hicache state; their steps are taken here one request at a time. A request marked
``radix`` takes its prefix from SGLang's ``RadixCache`` of the rank (earlier requests cached there); the
others state a ``prefix`` whose pages decode allocates and fills itself, as a hit leaves them. Caches live
in host memory (``device cpu``).
Results (poll walks, reasons, per-page digests of the suffix, metadata rows, timings) go to a JSON file.
A room marked ``observe_chunks`` is paused on prefill after each finished chunk (``PrefillLoop``'s
``between_chunks``) until decode, while it polls, has read the pages of the tokens sent so far: two files
beside the report, ``.sent`` from prefill, ``.seen`` from decode.

Usage: python -m tests.support.sglang_proc CONFIG.json
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

cfg: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
os.environ.update(cfg.get("env", {}))
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

import torch.distributed as dist  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVReceiver  # noqa: E402
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.common import kv_to_page_indices, suffix_page_indices  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

load_plugins()
from tests.support.sglang_impostor import Impostor  # noqa: E402
from tests.support.sglang_prefill import DEVICES, PrefillLoop, meta_row, prompt_ids, reason_of  # noqa: E402
from tests.support.sglang_rank import Rank, rss_kb  # noqa: E402
from tests.support.strangers import handshake  # noqa: E402
from tests.support.tiny_dsa import TinyDsa  # noqa: E402

ROLE = cfg["role"]
PAGE = cfg["page_size"]
DEADLINE_S = cfg.get("timeout_s", 30.0)
BOOT = f"127.0.0.1:{cfg['bootstrap_port']}"
GATE = Path(cfg["out"]).parent / f"gate-{cfg['bootstrap_port']}"  # + -ROOM-TOKENS.sent / .seen
E2E = cfg.get("e2e")  # run the tiny DSA model (tests/support/tiny_dsa.py) on these caches

server_args = prepare_server_args(
    [
        "--model-path", cfg["model"], "--device", "cpu", "--host", "127.0.0.1",
        "--disaggregation-mode", ROLE, "--disaggregation-transfer-backend", "glm-pd",
        "--disaggregation-bootstrap-port", str(cfg["bootstrap_port"]),
        "--page-size", str(PAGE), "--tp-size", str(cfg["tp"] * cfg.get("cp", 1)),
        "--kv-cache-dtype", cfg.get("kv_dtype", "fp8_e4m3"),
        # under layer split glm-pd reads the drafter's flag (only the last shard's KVArgs list the MTP caches)
        *(["--speculative-algorithm", "EAGLE"] if cfg.get("layer_split") and cfg.get("draft", True) else []),
    ]
)  # fmt: skip
get_context().set_server_args(server_args)
if cfg.get("device") is not None:  # DeviceDouble notes which device each of glm-pd's threads selected
    import glm_pd_sglang.conn

    glm_pd_sglang.conn.thread_device = lambda regions, _torch: DEVICES.setup_for(list(regions), cfg["device"])
# which threads hashed decode's landed pages to verify them (never SGLang's scheduler thread, which polls)
DIGEST_THREADS: set[str] = set()
if ROLE == "decode":
    import glm_pd_sglang.conn

    _region_digests = glm_pd_sglang.conn.GlmPdKVManager._region_digests

    def _recording(mgr: Any, pages: np.ndarray) -> list[tuple[str, int]]:
        DIGEST_THREADS.add(threading.current_thread().name)
        return _region_digests(mgr, pages)

    glm_pd_sglang.conn.GlmPdKVManager._region_digests = _recording  # type: ignore[method-assign]
MODEL_CONFIG = ModelConfig.from_server_args(server_args)
MODEL = TinyDsa(MODEL_CONFIG.hf_config.num_hidden_layers, sorted(cfg["full_layers"]), seed=E2E["seed"]) if E2E else None
Receiver = get_kv_class(TransferBackend(server_args.disaggregation_transfer_backend), KVClassType.RECEIVER)


def walk(
    objs: list[Any], until: tuple[int, ...], deadline: float, between: Callable[[list[int]], None] | None = None
) -> list[int]:
    """Poll every rank's receiver to a status in ``until`` (all ranks, as SGLang's MIN all-reduce would);
    ``between`` runs after each poll with the states seen."""
    while True:
        states = [int(o.poll()) for o in objs]
        if between is not None:
            between(states)
        if min(states) in until or KVPoll.Failed in states or time.monotonic() > deadline:
            return states
        time.sleep(0.0005)


def wait_for_decode(room: int, sent_tokens: int) -> None:
    """Prefill's ``between_chunks``: tell decode what was sent, and wait until decode has looked."""
    gate = Path(f"{GATE}-{room}-{sent_tokens}")
    Path(f"{gate}.sent").write_text("")
    deadline = time.monotonic() + DEADLINE_S
    while not Path(f"{gate}.seen").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"decode never looked at room {room} after {sent_tokens} tokens")
        time.sleep(0.001)


def look_between_chunks(
    ranks: list[Rank], slots: list[DecodeSlot], room: int, out: dict[str, Any]
) -> Callable[[list[int]], None]:
    """Decode's side of ``wait_for_decode``: per chunk prefill paused after, this side's digests of the pages
    of the tokens sent so far, read from its own caches, with the receivers' states at that moment."""
    seen = out.setdefault("chunk_digests", [{} for _ in ranks])
    states_then = out.setdefault("chunk_states", {})

    def between(states: list[int]) -> None:
        for sent_file in sorted(GATE.parent.glob(f"{GATE.name}-{room}-*.sent")):
            tokens = int(sent_file.stem.rsplit("-", 1)[1])
            if tokens in states_then:
                continue
            for r, s, digests in zip(ranks, slots, seen, strict=True):
                digests[tokens] = r.page_digests(s.table[s.prefix // PAGE : tokens // PAGE])
            states_then[tokens] = states
            sent_file.with_suffix(".seen").write_text("")

    return between


class DecodeSlot:
    """One request's row, pages and metadata slot on one decode rank. With ``radix``, its prefix is what SGLang's
    ``RadixCache`` of this rank matches (those pages are the tree's, locked while the request runs), and at
    the end its page-aligned tokens go into the tree, as ``cache_finished_req`` leaves them."""

    def __init__(self, r: Rank, ids: list[int], prefix: int, extra_tokens: int, radix: bool) -> None:
        self.r, self.ids, self.radix, self.node = r, ids, radix, None
        n_tokens = len(ids)
        self.row = r.req_to_token_pool.alloc_rows(1)[0]
        self.tokens = math.ceil((n_tokens + extra_tokens) / PAGE) * PAGE  # room for decoded tokens
        row = r.req_to_token_pool.req_to_token[self.row]
        if radix:  # as DecodePreallocQueue's match_kv_cache: the prompt against the tree, locked
            match = r.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("i", ids))))
            prefix, self.node = match.device_prefix_len, match.last_device_node
            r.tree.inc_lock_ref(self.node)
            row[:prefix] = r.tree.path_device_indices(self.node)[:prefix].to(torch.int32)
        self.prefix = prefix
        self.owned_from = prefix if radix else 0  # the tree's pages are not this request's to free
        indices = r.allocator.alloc(self.tokens - self.owned_from)
        if indices is None:
            raise SystemExit("decode pool exhausted")
        row[self.owned_from : self.tokens] = indices.to(torch.int32)
        self.table = kv_to_page_indices(row[: self.tokens], PAGE)
        self.suffix = suffix_page_indices(r.req_to_token_pool.req_to_token, self.row, prefix, n_tokens, PAGE)
        self.slot = r.meta_slots.alloc()

    def release(self, cache: bool) -> None:
        r, row = self.r, self.r.req_to_token_pool.req_to_token[self.row].to(torch.int64)
        free_from = self.owned_from
        if self.radix and cache:
            aligned = len(self.ids) // PAGE * PAGE
            done = r.tree.insert(InsertParams(key=RadixKey(array("i", self.ids[:aligned])), value=row[:aligned]))
            if done.prefix_len > self.prefix:  # pages another request put in the tree meanwhile: ours are spare
                r.allocator.free(row[self.prefix : done.prefix_len])
            free_from = max(aligned, self.prefix)
        if self.node is not None:
            r.tree.dec_lock_ref(self.node)
        r.allocator.free(row[free_from : self.tokens])
        r.req_to_token_pool.free_rows([self.row])
        r.meta.clear_slot(self.slot)
        r.meta_slots.free(self.slot)


def run_decode(ranks: list[Rank], requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 60
    while not all(r.mgr.try_ensure_parallel_info(BOOT) for r in ranks):
        if time.monotonic() > deadline:
            raise SystemExit("prefill's bootstrap server never answered")
        time.sleep(0.2)
    results = []
    for req in requests:
        time.sleep(req.get("delay_s", 0))
        if req.get("release_resume"):
            for r in ranks:
                r.release_and_resume()
        room, n_tokens, prefix = req["room"], req["tokens"], req.get("prefix", 0)
        deadline = time.monotonic() + DEADLINE_S
        started = time.perf_counter()
        receivers = [Receiver(r.mgr, BOOT, room) for r in ranks]
        for rc in receivers:
            rc.init(0)
        states = walk(receivers, (KVPoll.WaitingForInput,), deadline)
        out: dict[str, Any] = {"room": room}
        ids = req.get("prompt") or prompt_ids(room, n_tokens)
        slots = [DecodeSlot(r, ids, prefix, E2E["steps"] if E2E else 0, bool(req.get("radix"))) for r in ranks]
        prefix = slots[0].prefix
        out["prefix"] = [s.prefix for s in slots]
        end = math.ceil(n_tokens / PAGE)
        fault = req.get("fault")
        if min(states) == KVPoll.WaitingForInput:
            for r, rc, s in zip(ranks, receivers, slots, strict=True):
                suffix = s.suffix.copy()
                if prefix and MODEL:  # decode's own prefix-cache hit: its pages hold what a hit leaves there
                    MODEL.prefill(req["prompt"], r.paged(s.table), 0, prefix)
                elif prefix and not s.radix:
                    r.write_pages(s.table[: prefix // PAGE], seed=7 * room)
                claimed, send = prefix, rc.send_metadata
                if fault == "misaligned":
                    claimed = prefix + 1
                elif fault == "misaligned_unchecked":
                    claimed, send = prefix + 1, lambda *a, _rc=rc, **k: CommonKVReceiver.send_metadata(_rc, *a, **k)
                elif fault == "out_of_range_unchecked":
                    suffix[-1] = 10**6
                    send = lambda *a, _rc=rc, **k: CommonKVReceiver.send_metadata(_rc, *a, **k)  # noqa: E731
                elif fault == "suffix_shift":
                    claimed = prefix + PAGE
                out.setdefault("prefix_before", []).append(r.page_digests(s.table[: prefix // PAGE]))
                if fault == "impostor":  # a deployment member without the room's grant (sglang_impostor.py)
                    impostor = Impostor(r.mgr, rc)
                    impostor.borrowed()
                    impostor.register_as_itself()
                send(suffix.astype(np.int32), s.slot, [suffix], decode_prefix_len=claimed)
                if fault == "impostor":
                    impostor.describe(room, suffix.astype(np.int32), s.slot, [suffix], claimed)
                if fault == "abort":
                    rc.abort()
                if fault == "corrupt" or str(fault).startswith("stall_verify"):
                    r.faults.kinds[str(room)] = fault
            between = look_between_chunks(ranks, slots, room, out) if req.get("observe_chunks") else None
            states = walk(receivers, (KVPoll.Success,), deadline, between)
            for r, s in zip(ranks, slots, strict=True):
                out.setdefault("dst_digests", []).append(r.page_digests(s.table[prefix // PAGE : end]))
                out.setdefault("prefix_after", []).append(r.page_digests(s.table[: prefix // PAGE]))
                out.setdefault("aux_room", []).append(int(r.meta.bootstrap_room[s.slot, 0]))
                out.setdefault("meta_rows", []).append(meta_row(r, s.slot))
                if MODEL and min(states) == KVPoll.Success:
                    cache = r.paged(s.table)
                    if fault == "drop_indexer":  # the negative control: the indexer pages never arrived
                        for buf in cache.index.values():
                            buf[s.table[prefix // PAGE : end]] = 0
                    first = int(r.meta.output_ids[s.slot, 0])
                    out.setdefault("tokens", []).append(MODEL.decode(first, n_tokens, cache, E2E["steps"]))
        out["states"] = states
        out["seconds"] = time.perf_counter() - started
        out["rss_kb"] = rss_kb()
        out["reasons"] = [
            reason_of(rc) if st == KVPoll.Failed else "" for rc, st in zip(receivers, states, strict=True)
        ]
        if fault == "impostor":
            impostor.close()
        for rc, s in zip(receivers, slots, strict=True):
            rc.clear()
            s.release(cache=min(states) == KVPoll.Success)
        results.append(out)
    for r in ranks:  # what the tree still holds goes back to the pool, so the page count can be checked
        r.tree.evict(EvictParams(num_tokens=r.pool_tokens))
    return results


def main() -> None:
    # the pair waits 240 s for this process: a hang leaves every thread's stack in this process's log first
    faulthandler.dump_traceback_later(200, exit=False)
    dist.init_process_group("gloo", init_method=f"file://{cfg['out']}.dist", world_size=1, rank=0)
    if ROLE == "prefill":
        from glm_pd_sglang.endpoints import GlmPdKVBootstrapServer

        server = GlmPdKVBootstrapServer(host="127.0.0.1", port=cfg["bootstrap_port"])
    ranks = []
    for i in range(cfg["tp"] * cfg.get("cp", 1)):
        if cfg.get("rank_hosts"):  # each rank as if on its own node: SGLang's local_ip comes from SGLANG_HOST_IP
            os.environ["SGLANG_HOST_IP"] = cfg["rank_hosts"][i]
        ranks.append(Rank(i, cfg, server_args, MODEL_CONFIG))
    print("GLMPD_TEST ready", flush=True)
    if ROLE == "prefill":
        results = PrefillLoop(ranks, cfg, MODEL, cfg["bootstrap_port"], wait_for_decode).run()
    else:
        results = run_decode(ranks, cfg["requests"])
    report = {
        "results": results,
        "transitions": [r.transitions for r in ranks],
        "free_pages": [r.free_pages() for r in ranks],
        "pool_pages": cfg.get("pool_pages", 48),
        "stats": [r.mgr.stats for r in ranks],
        "refusals": [r.mgr.refusals for r in ranks],
        "leftovers": [r.mgr.leftovers() for r in ranks],
        "data_path": ranks[0].mgr.transport.info().data_path,
        "hosts": [r.mgr.local_ip for r in ranks],
        "digest_threads": sorted(DIGEST_THREADS),
        "poll_thread": threading.current_thread().name,
        "device_ids": [sorted({reg.device_id for reg in r.mgr.caches.regions}) for r in ranks],
        # a stranger without keys knocking on each rank's socket (SGLang's PULL): how its handshake ended
        "stranger": [handshake(r.mgr.local_ip, r.mgr.rank_port, {}, zmq.PUSH, 2.0) for r in ranks],
        # requests prefill's bootstrap server refused for want of the deployment's token
        "bootstrap_refused": server.refused.total if ROLE == "prefill" else None,
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

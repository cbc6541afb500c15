"""Decode context parallelism (vLLM DCP): every decode rank ends up holding exactly its tokens of every main
and indexer layer, whatever DCP size, interleave and block size prefill and decode run with.

The caches are vLLM's (``tests/support/vllm_caches``: vLLM's specs, planning and allocation with
``decode_context_parallel_size`` set), registered through the adapter. Where each rank holds each token is
vLLM's own slot mapping (``tests/support/vllm_slots``: vLLM's ``BlockTable`` and its Triton kernel, run on this
CPU by Triton's interpreter), never glm-pd's shard arithmetic. Every prefill rank holds its tokens of distinct
per-(layer, token) bytes; every decode rank holds poison, plus its own different bytes for its prefix hit. After
the load a decode rank must hold exactly that plus its tokens past the hit; only the slots of its last block
past the prompt's end may hold anything (whole pages travel; vLLM writes those slots when it decodes).

The bytes move through the adapter itself over real NIXL, for the whole matrix (decode TP 8 with DCP
1/2/4/8 x blocks of 64/128 x prefix hit 0/1024, against a TP-8 prefill with DCP 1 in blocks of 128 and one
with DCP 2, interleave 4, blocks of 64): vLLM ``Request`` objects through ``GlmPdScheduler`` (prefill's
``request_finished`` params, decode's matched tokens and allocation), then one ``GlmPdWorker`` per rank on each
side, sixteen NIXL agents in this process.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.config import KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.layout.shards import Sharding
from glm_pd_vllm.config import GlmPdVllmConfig
from glm_pd_vllm.model import context_parallel
from glm_pd_vllm.scheduler import GlmPdMetadata, GlmPdScheduler, LoadSpec
from glm_pd_vllm.worker import GlmPdWorker
from tests.support.ports import free_port_range
from tests.support.services import wait_for
from tests.support.vllm_caches import FP8_DS_MLA, Built, Choice, build, on_device, place
from tests.support.vllm_harness import make_tiny_model
from tests.support.vllm_slots import SlotCase, SlotsUnavailable, slot_mappings

TP, TOKENS, HIT, POISON = 8, 1500, 1024, 0xA5  # HIT: a multiple of every decode block span here (B x DCP)
SM90 = (9, 0)


def _layout(block: int, dcp: int, interleave: int) -> Choice:
    return Choice(SM90, "FLASHMLA_SPARSE", "fp8", FP8_DS_MLA, block, None, TP, dcp, interleave)


PREFILLS = [_layout(128, 1, 1), _layout(64, 2, 4)]
DECODE_INTERLEAVE = {1: 1, 2: 16, 4: 1, 8: 64}  # each differs from the DCP-2 prefill's 4
DECODES = [_layout(block, dcp, DECODE_INTERLEAVE[dcp]) for dcp in (1, 2, 4, 8) for block in (64, 128)]
CELLS = [(p, d, hit) for p in PREFILLS for d in DECODES for hit in (0, HIT)]


def _blocks_needed(c: Choice) -> int:
    return -(-TOKENS // (c.block_size * c.dcp))  # one scheduler block spans block_size x DCP tokens


def _span(c: Choice) -> int:
    """Tokens the request's blocks span: the prompt and the rest of its last block."""
    return _blocks_needed(c) * c.block_size * c.dcp


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    """The tiny GLM-5.x with 16 heads, so TP 8 divides them (the caches have one latent head either way)."""
    path = make_tiny_model(tmp_path_factory.mktemp("glm5-dcp"), num_attention_heads=16)
    return ModelConfig(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16")


@pytest.fixture(scope="module")
def sm90():
    with pytest.MonkeyPatch.context() as mp:
        on_device(mp, SM90)
        yield


def _build(c: Choice, model_config: ModelConfig, copies: int = 1) -> list[Built]:
    return build(c, model_config, num_blocks=_blocks_needed(c) + 4, copies=copies)


@pytest.fixture(scope="module")
def layouts(model_config, sm90) -> dict[Choice, Built]:
    """One vLLM allocation per layout: the plan path gives each rank its own copy of its bytes."""
    return {c: _build(c, model_config)[0] for c in {*PREFILLS, *DECODES}}


def _table(c: Choice, seed: int) -> np.ndarray:
    """The request's scheduler blocks on one side (one table for all its ranks), scattered over the pool."""
    return np.random.default_rng(seed).permutation(_blocks_needed(c) + 4)[: _blocks_needed(c)]


TABLES = {c: _table(c, seed) for seed, c in enumerate([*PREFILLS, *DECODES])}


@pytest.fixture(scope="module")
def slots(layouts) -> dict[tuple[Choice, int], np.ndarray]:
    """vLLM's slot of every token its blocks span, on every rank of every layout (-1: another rank's token)."""
    keys = [(c, rank) for c in [*PREFILLS, *DECODES] for rank in range(TP)]
    cases = [
        SlotCase(c.block_size, c.dcp, rank % c.dcp, c.interleave, tuple(TABLES[c].tolist()), _span(c))
        for c, rank in keys
    ]
    try:
        return dict(zip(keys, slot_mappings(cases), strict=True))
    except SlotsUnavailable as exc:
        pytest.skip(f"vLLM's own slot mapping: {exc}")


def _rows(b: Built, seed: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Distinct bytes per (cache layer, global token) for one side's content ``seed``."""
    out = {}
    for name, t in b.caches.items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        out[name] = rng.integers(0, 256, (TOKENS, t.shape[-1] * t.element_size()), dtype=np.uint8)[tokens]
    return out


def _fill(b: Built, backing: np.ndarray, slots: np.ndarray, start: int, end: int, seed: int) -> None:
    """This rank's tokens of ``[start, end)`` with content ``seed``, where vLLM's slot mapping put them."""
    tokens = np.arange(start, end)
    tokens = tokens[slots[tokens] >= 0]
    place(b, backing, slots[tokens], _rows(b, seed, tokens))


def _prefill_memory(b: Built, rank_slots: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for s in rank_slots:
        mem = np.zeros_like(b.backing)
        _fill(b, mem, s, 0, TOKENS, seed=1)
        out.append(mem)
    return out


@dataclass
class Expected:
    """What one decode rank must hold after the load, and the bytes that may hold anything (its last block's
    slots past the prompt)."""

    memory: np.ndarray
    free: np.ndarray  # bool per byte


def _decode_memory(b: Built, rank_slots: list[np.ndarray], hit: int) -> tuple[list[np.ndarray], list[Expected]]:
    """Each decode rank before the load (poison and its own prefix-hit bytes) and what it must hold after."""
    before, expected = [], []
    for s in rank_slots:
        mem = np.full_like(b.backing, POISON)
        _fill(b, mem, s, 0, hit, seed=2)
        want = mem.copy()
        _fill(b, want, s, hit, TOKENS, seed=1)
        tail = s[TOKENS:][s[TOKENS:] >= 0]
        free = np.zeros_like(b.backing)
        ones = {name: np.ones((tail.size, t.shape[-1] * t.element_size()), np.uint8) for name, t in b.caches.items()}
        place(b, free, tail, ones)
        before.append(mem)
        expected.append(Expected(want, free.astype(bool)))
    return before, expected


def _check(decoded: list[np.ndarray], expected: list[Expected]) -> None:
    wrong = [
        rank
        for rank, (got, want) in enumerate(zip(decoded, expected, strict=True))
        if not np.array_equal(got[~want.free], want.memory[~want.free])
    ]
    assert not wrong, f"decode ranks {wrong} do not hold exactly their tokens (and their own prefix)"


def test_vllm_shards_tokens_as_the_matrix_assumes(layouts, slots) -> None:
    """The premise, from vLLM: under DCP N every token lives on exactly one of N consecutive ranks, each
    rank's slots are distinct, and the DCP-sharded spec keeps vLLM's per-rank block size."""
    for c in [*PREFILLS, *DECODES]:
        held = np.stack([slots[c, rank] >= 0 for rank in range(c.dcp)])
        assert np.array_equal(held.sum(axis=0), np.ones(_span(c))), c.name
        for rank in range(TP):
            s = slots[c, rank][slots[c, rank] >= 0]
            assert np.unique(s).size == s.size and np.array_equal(slots[c, rank], slots[c, rank % c.dcp])
        assert layouts[c].config.cache_config.block_size == c.block_size


def _rank_config(b: Built, rank: int, role: str) -> VllmConfig:
    """vLLM's config of one rank: the layout's, with its TP rank and the connector's role."""
    cfg = copy.copy(b.config)
    cfg.parallel_config = copy.copy(b.config.parallel_config)
    cfg.parallel_config.rank = rank
    cfg.kv_transfer_config = KVTransferConfig(kv_connector="GlmPdConnector", kv_role=role)
    return cfg


def _request(params: dict) -> Request:
    return Request(
        "req-1", list(range(TOKENS)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None
    )


@pytest.mark.parametrize(("p", "d", "hit"), CELLS, ids=lambda x: x.name if isinstance(x, Choice) else f"hit{x}")
def test_the_adapter_moves_each_rank_its_tokens_over_nixl(model_config, sm90, slots, p, d, hit) -> None:
    prefill, decode = _build(p, model_config, copies=TP), _build(d, model_config, copies=TP)
    p_mem = _prefill_memory(prefill[0], [slots[p, r] for r in range(TP)])
    for b, mem in zip(prefill, p_mem, strict=True):
        b.backing[:] = mem
    d_mem, expected = _decode_memory(decode[0], [slots[d, r] for r in range(TP)], hit)
    for b, mem in zip(decode, d_mem, strict=True):
        b.backing[:] = mem
    config = GlmPdVllmConfig(allow_tcp=True, side_channel_port=free_port_range(TP), timeout_s=60.0)

    # the schedulers: prefill publishes its params (and grants its blocks), decode turns them into a load
    p_sched = GlmPdScheduler(_rank_config(prefill[0], 0, "kv_producer"), config, "P")
    finished = _request({"do_remote_decode": True})
    finished.status, finished.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, TOKENS
    delay, params = p_sched.request_finished(finished, (TABLES[p].tolist(),))
    assert delay and params is not None
    assert (params["remote_token_shards"], params["remote_interleave"]) == (p.dcp, p.interleave)
    p_meta = p_sched.build_connector_meta(SchedulerOutput.make_empty())
    d_sched = GlmPdScheduler(_rank_config(decode[0], 0, "kv_consumer"), config, "D")
    request = _request(params)
    assert d_sched.get_num_new_matched_tokens(request, hit) == (TOKENS - hit, True)
    d_sched.update_state_after_alloc(
        request, KVCacheBlocks(([KVCacheBlock(b) for b in TABLES[d].tolist()],)), TOKENS - hit
    )
    d_meta = d_sched.build_connector_meta(SchedulerOutput.make_empty())

    workers: list[GlmPdWorker] = []
    try:
        for role, side, engine in (("kv_producer", prefill, "P"), ("kv_consumer", decode, "D")):
            for rank, b in enumerate(side):
                worker = GlmPdWorker(_rank_config(b, rank, role), config, b.spec, engine)
                worker.register_kv_caches(b.caches)
                workers.append(worker)
        for worker, meta in [(w, p_meta) for w in workers[:TP]] + [(w, d_meta) for w in workers[TP:]]:
            worker.bind(meta)  # vLLM's order: the step's metadata is bound, then the loads start
            worker.start_load_kv(meta)
        loaded = [_outcome(w, "recv") for w in workers[TP:]]
        assert all(r == ({"req-1"}, set()) for r in loaded), loaded
        freed = [_outcome(w, "send") for w in workers[:TP]]
        assert all(f == {"req-1"} for f in freed), freed  # every prefill rank frees, read from or not
    finally:
        for worker in workers:
            worker.shutdown()
    _check([b.backing for b in decode], expected)


def _outcome(worker: GlmPdWorker, kind: str) -> object:
    """What the worker reports for the request within 60 s: (finished, failed) receives, or freed sends."""
    seen: dict[str, set[str]] = {"finished": set(), "failed": set(), "sent": set()}

    def poll() -> dict[str, set[str]]:
        out = worker.transfer_results()
        seen["finished"] |= out.finished_recving
        seen["failed"] |= out.failed_recving
        seen["sent"] |= out.finished_sending
        return seen

    wait_for(poll, lambda s: bool(s["finished"] if kind == "recv" else s["sent"]), 60.0)
    return (seen["finished"], seen["failed"]) if kind == "recv" else seen["sent"]


# -- start-up refusals --------------------------------------------------------------------------------
def test_prefill_context_parallelism_is_refused_at_start_up_naming_it(layouts) -> None:
    cfg = copy.copy(layouts[PREFILLS[0]].config)
    cfg.parallel_config = ParallelConfig(tensor_parallel_size=4, prefill_context_parallel_size=2)
    with pytest.raises(ConfigError, match="prefill_context_parallel_size 2"):
        GlmPdScheduler(cfg, GlmPdVllmConfig(), "P")


def test_an_interleave_splitting_a_kernel_block_is_refused_at_registration(model_config, sm90) -> None:
    """vLLM accepts an interleave of 128 over --block-size 128 (it divides the block), but holds each block as
    two 64-token kernel blocks, which glm-pd addresses as pages: the worker refuses at start-up, saying so."""
    (b,) = _build(replace(DECODES[1], dcp=2, interleave=128), model_config)
    assert context_parallel(b.config) == Sharding(token_shards=2, interleave=128)
    worker = GlmPdWorker(_rank_config(b, 0, "kv_consumer"), GlmPdVllmConfig(allow_tcp=True), b.spec, "D")
    with pytest.raises(ConfigError) as err:
        worker.register_kv_caches(b.caches)
    assert "interleave 128 must divide its page of 64 tokens" in str(err.value)
    assert "cp_kv_cache_interleave_size 128, --block-size 128 registered as kernel blocks of 64" in str(err.value)
    assert worker.transport is None  # nothing registered, nothing listening


def test_a_decode_prefix_hit_is_aligned_to_the_dcp_block_span(layouts) -> None:
    """vLLM's DCP prefix hits are whole blocks of block_size x DCP tokens; anything else is refused by name."""
    d = DECODES[2]  # DCP 2, blocks of 64: a scheduler block spans 128 tokens
    sched = GlmPdScheduler(_rank_config(layouts[d], 0, "kv_consumer"), GlmPdVllmConfig(), "D")
    params = {
        "glm_pd_protocol": PROTOCOL_VERSION,
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 5710,
        "tp_size": TP,
        "remote_block_ids": list(range(_blocks_needed(PREFILLS[1]))),
        "remote_num_tokens": TOKENS,
        "remote_page_tokens": 64,
        "remote_token_shards": 2,
        "remote_interleave": 4,
    }
    request = _request(params)
    sched.get_num_new_matched_tokens(request, 64)
    sched.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(0)],)), TOKENS - 64)
    (load,) = sched.build_connector_meta(SchedulerOutput.make_empty()).loads
    assert "local prefix hit 64 is not block-aligned (128)" in load.error


def test_a_failed_dcp_load_reports_only_the_blocks_past_the_hit(layouts) -> None:
    """vLLM recomputes (or fails) the blocks a connector reports; a DCP block id spans block_size x DCP tokens,
    so a hit of 256 tokens in 128-token DCP blocks keeps the first two blocks out of the report."""
    d = DECODES[2]  # DCP 2, blocks of 64
    worker = GlmPdWorker(_rank_config(layouts[d], 0, "kv_consumer"), GlmPdVllmConfig(), layouts[d].spec, "D")
    load = LoadSpec("r", None, [5, 6, 7, 8], TOKENS, 256, error="invalid kv_transfer_params: test")
    worker.start_load_kv(GlmPdMetadata(loads=[load]))
    out = worker.transfer_results()
    assert out.failed_recving == {"r"} and worker.block_ids_with_load_errors() == {7, 8}


def test_a_request_id_used_again_is_a_new_lease(layouts) -> None:
    """A router that redoes prefill after a failed load reuses the request id. Each grant is its own lease:
    a decode claim for the new one waits for it like any early claim, while a late claim naming the ended
    one is refused at once (before, both named the id, and a claim that beat the new grant was refused)."""
    p = PREFILLS[0]
    sched = GlmPdScheduler(_rank_config(layouts[p], 0, "kv_producer"), GlmPdVllmConfig(), "P")
    leases = []
    for _ in range(2):
        finished = _request({"do_remote_decode": True})
        finished.status, finished.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, TOKENS
        _, params = sched.request_finished(finished, (TABLES[p].tolist(),))
        assert params is not None
        leases.append(params["remote_request_id"])
    grants = sched.build_connector_meta(SchedulerOutput.make_empty()).grants
    assert leases[0] != leases[1] and sorted(grants) == sorted(leases)
    assert {grant.request_id for grant in grants.values()} == {"req-1"}

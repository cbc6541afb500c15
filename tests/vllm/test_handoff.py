"""Prefill and decode instances (separate processes) through GlmPdConnector's hooks, real NIXL on loopback."""

import json

import pytest


def handoff(pd, prefill_kw=None, decode_kw=None, tamper=None):
    prefill = pd("kv_producer", **(prefill_kw or {}))
    first = prefill.read()
    assert first["delay_free"] is True
    params = first["params"]
    if tamper:
        tamper(params)
    decode = pd("kv_consumer", json.dumps(params), **(decode_kw or {}))
    matched = decode.read()
    result = decode.read()
    result["logs"] = f"decode:\n{decode.log_tail()}\nprefill:\n{prefill.log_tail()}"
    return prefill, decode, params, matched, result


@pytest.mark.parametrize("prefix", [0, 384])
def test_suffix_moves_byte_exact_and_prefill_frees(pd, prefix):
    prefill, _, params, matched, result = handoff(pd, decode_kw={"prefix_tokens": prefix})
    assert params["remote_num_tokens"] == 1000 and params["remote_page_tokens"] == 64
    assert matched == {"matched": 1000 - prefix, "async": True}
    assert result["outcome"] == "loaded", result
    assert result["mismatched"] == []
    assert result["bad_blocks"] == []
    assert result["do_remote_prefill"] is False  # a preempted request would not load twice
    (stats,) = result["stats"]
    suffix_tokens = 1000 - prefix  # blocks are whole: the last block is copied whole
    moved_tokens = -(-1000 // 64) * 64 - prefix
    assert stats["bytes_main"] == 7 * 656 * moved_tokens and stats["bytes_indexer"] == 4 * 132 * moved_tokens
    assert suffix_tokens <= moved_tokens
    assert prefill.read()["outcome"] == "freed"


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_tp_mismatch_each_decode_rank_reads_one_whole_copy(pd, p_tp, d_tp):
    prefill, _, params, _, result = handoff(pd, prefill_kw={"tp": p_tp}, decode_kw={"tp": d_tp, "prefix_tokens": 128})
    assert params["tp_size"] == p_tp
    assert result["outcome"] == "loaded", result
    assert result["mismatched"] == []
    moved = (-(-1000 // 64) * 64 - 128) * (7 * 656 + 4 * 132)
    assert [s["bytes_main"] + s["bytes_indexer"] for s in result["stats"]] == [moved] * d_tp
    assert prefill.read()["outcome"] == "freed"  # every prefill rank, dummies too, released


def test_scale_format_mismatch_fails_cleanly_naming_the_field(pd):
    prefill, _, _, _, result = handoff(
        pd, prefill_kw={"lease_s": 3.0, "linger_s": 60}, decode_kw={"extra": {"indexer_scale_format": "ue8m0x4"}}
    )
    assert result["outcome"] == "failed"
    assert "indexer_scale_format: prefill='fp32' decode D='ue8m0x4'" in result["logs"]
    assert result["bad_blocks"] == result["suffix_blocks"]
    assert prefill.read()["outcome"] == "freed"  # by lease expiry: decode never claimed


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ([10**9], "page id 1000000000 is outside region"),
        ([-1], "page id -1 is outside region"),
        (["x"], "non-integer block id"),
        ([], "remote_block_ids for 1000 tokens"),
    ],
)
def test_bad_remote_block_ids_fail_before_anything_moves(pd, bad, reason):
    def tamper(params):
        params["remote_block_ids"] = params["remote_block_ids"][:-1] + bad

    prefill, _, _, _, result = handoff(pd, prefill_kw={"lease_s": 3.0, "linger_s": 60}, tamper=tamper)
    assert result["outcome"] == "failed"
    assert reason in result["logs"]
    assert prefill.read()["outcome"] == "freed"


def test_expired_lease_fails_the_request(pd):
    prefill = pd("kv_producer", lease_s=1.0, wait_s=30.0, linger_s=60)
    params = prefill.read()["params"]
    assert prefill.read()["outcome"] == "freed"  # the lease ran out with nobody claiming
    decode = pd("kv_consumer", json.dumps(params))
    decode.read()
    result = decode.read()
    assert result["outcome"] == "failed"
    assert "lease on this request already ended: expired" in decode.log_tail()


def test_prefill_gone_fails_bounded(pd):
    prefill = pd("kv_producer")
    params = prefill.read()["params"]
    prefill.close()
    decode = pd("kv_consumer", json.dumps(params), extra={"timeout_s": 3.0})
    decode.read()
    result = decode.read(timeout=60)
    assert result["outcome"] == "failed"

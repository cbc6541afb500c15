"""Prefill context parallelism on SGLang's own classes: CP ranks with ``LayerSplitDSATokenToKVPool`` (each holds
its layer shard) or replicated CP ranks, KVArgs from ``PrefillBootstrapQueue._init_kv_manager``, SGLang's rank
mapping on decode, real transports over loopback; every decode rank must hold every layer's main and indexer
suffix pages byte for byte, each from the prefill rank glm-pd's pairing picks (tests/support/sglang_checks.py).
"""

from dataclasses import replace

import pytest

from glm_pd_sglang.parallel import AttentionRanks
from tests.support.sglang_checks import (
    FAILED,
    GEOMETRY,
    STAGED,
    SUCCESS,
    assert_clean,
    assert_exact,
    expected_sources,
)

PAGE = 64
VERIFY = {"SGLANG_GLM_PD_VERIFY_CHECKSUMS": "1"}  # decode merges the digests of every prefill rank it reads
REQUESTS = [
    {"room": 71, "tokens": 700, "prefix": 128},  # decode's prefix hit: only the suffix travels
    {"room": 72, "tokens": 1500, "prefix": 64, "chunk_pages": 7},  # chunked: each chunk with its indexer
]


def suffix_pages(req: dict) -> int:
    return -(-(req["tokens"] - req.get("prefix", 0)) // PAGE)


@pytest.mark.parametrize(
    ("prefill_tp", "prefill_cp", "layer_split", "decode_tp"),
    [
        (1, 2, True, 2),  # two layer shards, decode TP wider than each shard
        (2, 2, True, 1),  # decode TP narrower: one rank of each shard sends, the other is SGLang's dummy
        (1, 4, True, 2),  # shard 2 holds no full layer (no indexer), shard 3 the MTP layer
        (2, 2, False, 1),  # replicated CP: CP rank 0 serves, CP rank 1 is SGLang's dummy
        (1, 4, False, 2),
        (1, 1, False, 2),  # no CP
    ],
)
def test_every_decode_rank_gets_every_layer(
    pair, prefill_tp: int, prefill_cp: int, layer_split: bool, decode_tp: int
) -> None:
    every_layer_lands(pair, prefill_tp, prefill_cp, layer_split, decode_tp, VERIFY)


@pytest.mark.parametrize(("prefill_cp", "decode_tp"), [(2, 2), (4, 2)])
def test_layer_shards_staged_each_land_through_a_pair_of_their_own(pair, prefill_cp: int, decode_tp: int) -> None:
    """Several prefill ranks push to one decode rank at once: each is lent its own pair of slots."""
    staged = {**VERIFY, **STAGED}
    prefill = every_layer_lands(pair, 1, prefill_cp, True, decode_tp, staged)
    for stats in prefill["stats"]:
        assert stats.get("staged_bytes", 0) == stats.get("main_bytes", 0) + stats.get("indexer_bytes", 0)
    assert sum(s.get("staged_bytes", 0) for s in prefill["stats"]) > 0


def every_layer_lands(pair, prefill_tp: int, prefill_cp: int, layer_split: bool, decode_tp: int, env: dict) -> dict:
    """Run the requests; every decode rank must hold every layer, each byte from the rank the pairing picks.
    Returns prefill's report."""
    prefill, decode = pair.run(
        REQUESTS, prefill_tp=prefill_tp, prefill_cp=prefill_cp, layer_split=layer_split, decode_tp=decode_tp, env=env
    )
    assert_exact(prefill, decode, prefill_tp, decode_tp, prefill_cp=prefill_cp, layer_split=layer_split)
    assert_clean(prefill, decode)
    # Each layer reaches each decode rank once, from the rank the pairing picks: nothing twice, no layer a rank
    # lacks, nothing from SGLang's dummy CP ranks (replicated CP).
    ranks = AttentionRanks(prefill_tp, prefill_cp, layer_split)
    pages = sum(suffix_pages(r) for r in REQUESTS)
    for kind, row, layers in (("main", 656, GEOMETRY.all_layers), ("indexer", 132, GEOMETRY.indexer_layers)):
        want = [0] * ranks.num_ranks
        for rank in range(decode_tp):
            for name, src in expected_sources(rank, ranks, decode_tp).items():
                want[src] += pages * PAGE * row if name.startswith(kind) else 0
        moved = [s.get(f"{kind}_bytes", 0) for s in prefill["stats"]]
        assert moved == want, kind
        assert sum(moved) == pages * len(layers) * PAGE * row * decode_tp, kind
    return prefill


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_prefill_ranks_on_two_hosts_are_each_read_where_they_are(pair, transport: str) -> None:
    """An instance spanning nodes: each prefill rank binds and registers its own node's address (SGLang's
    ``local_ip``, here 127.0.0.1 and 127.0.0.2; Mooncake's engine binds it too), and every decode rank reads both
    layer shards, each at its rank's host, over SGLang's own bootstrap."""
    hosts = ["127.0.0.1", "127.0.0.2"]
    env = {**VERIFY, "SGLANG_GLM_PD_TRANSPORT": transport}
    prefill, decode = pair.run(REQUESTS, prefill_cp=2, layer_split=True, decode_tp=2, env=env, prefill_hosts=hosts)
    assert prefill["hosts"] == hosts
    assert_exact(prefill, decode, 1, 2, prefill_cp=2, layer_split=True)
    assert_clean(prefill, decode)


def test_layer_split_without_a_drafter(pair) -> None:
    """No MTP cache on either side: the last shard lists no draft caches, and no shard's fingerprint names one."""
    prefill, decode = pair.run(REQUESTS, prefill_cp=2, layer_split=True, decode_tp=2, env=VERIFY, draft=False)
    no_mtp = replace(GEOMETRY, num_mtp_layers=0)
    assert_exact(prefill, decode, 1, 2, prefill_cp=2, layer_split=True, geometry=no_mtp)
    assert_clean(prefill, decode)
    pages = sum(suffix_pages(r) for r in REQUESTS)
    assert [s["main_bytes"] for s in prefill["stats"]] == [pages * 3 * PAGE * 656 * 2] * 2


def test_a_shard_whose_indexer_never_lands_fails_the_room(pair) -> None:
    """Negative control: prefill CP rank 0 (layers 0-2, the three full layers) skips its indexer runs; decode's
    merged digests name the region, and the next room, with every shard writing, succeeds."""
    requests = [
        {"room": 81, "tokens": 700, "prefix": 64, "prefill_fault": "drop_indexer", "fault_ranks": [0]},
        {"room": 82, "tokens": 700, "prefix": 64},
    ]
    prefill, decode = pair.run(requests, prefill_cp=2, layer_split=True, decode_tp=2, env=VERIFY)
    first = decode["results"][0]
    # The harness stops polling a room at its first Failed rank (SGLang's MIN all-reduce fails them all).
    assert FAILED in first["states"]
    for state, reason in zip(first["states"], first["reasons"], strict=True):
        assert state != FAILED or "checksum mismatch in indexer[layer 0] region" in reason, reason
    assert prefill["results"][0]["states"] == [SUCCESS, SUCCESS]  # prefill believes it wrote everything
    assert [s["indexer_bytes"] for s in prefill["stats"]] == [
        suffix_pages(requests[1]) * 3 * PAGE * 132 * 2,  # rank 0: layers 0-2, second room only
        sum(suffix_pages(r) for r in requests) * PAGE * 132 * 2,  # rank 1: the MTP layer, both rooms
    ]
    assert_exact(
        {"results": prefill["results"][1:]}, {"results": decode["results"][1:]}, 1, 2, prefill_cp=2, layer_split=True
    )
    assert_clean(prefill, decode)

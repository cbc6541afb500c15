"""What SGLang's own prefill path hands a backend, and what must come out of it (issue 15).

Every run drives SGLang's ``PrefillBootstrapQueue``, its ``send_kv_chunk`` / ``maybe_send_cached_prefix_chunk``
and its pools and allocators (tests/support/sglang_prefill.py). The GPU's timing is the one test double:
a forward's bytes land when an event recorded behind it is synchronized, or when the scheduler takes that
batch's result after the backend has had the early-sent chunk (the worst case a GPU may show).
"""

import json
from pathlib import Path

import pytest

from tests.support.sglang_checks import FAILED, SUCCESS, assert_clean, assert_exact
from tests.support.sglang_pair import Pair
from tests.support.tiny_glm import TINY_GLM

DEVICE = 1  # not the device a new thread starts on


def test_chunks_wait_for_their_events(pair) -> None:
    """Chunked prefill under overlap: SGLang early-sends each computed chunk with a ``wait_event``; with a
    decode prefix hit, and with host page ids behind an ``indices_event``. Reading before either completes
    sends stale bytes or page 0: decode's pages would differ from prefill's. The ranks' caches are set up as if
    on CUDA device 1 (tests/support/device_double.py notes which device each synchronizing thread selected)."""
    requests = [
        {"room": 71, "tokens": 2100, "prefix": 64, "chunk_pages": 7},
        {"room": 72, "tokens": 1500, "chunk_pages": 4, "host_indices": True},
    ]
    prefill, decode = pair.run(requests, device=DEVICE)
    assert_exact(prefill, decode)
    p71, p72 = prefill["results"]
    # the lanes are glm-pd's threads: each synchronized under the rank's device (never GPU 0's context)
    assert p71["synced_on"] == [DEVICE] == p72["synced_on"]
    assert p71["wait_events"] == [4] and p72["wait_events"] == [5]  # one per chunk but the last
    assert p71["wait_events_synced"] == [4] and p72["wait_events_synced"] == [5]  # on the transfer lane
    assert p72["indices_events"] == [6] == p72["indices_events_synced"]  # every send of room 72
    assert_clean(prefill, decode)


def test_a_finished_chunk_is_on_decode_before_the_last_is_sent(pair) -> None:
    """Chunked prefill (issue 17): after each chunk's transfer, prefill pauses before it sends more while decode
    reads the pages of the tokens sent so far from its own caches. Every region of those pages, each indexer
    included, must already hold prefill's bytes (read from prefill's caches at the pause): an indexer held
    back to the last chunk leaves decode's old bytes there."""
    requests = [{"room": 131, "tokens": 1500, "prefix": 64, "chunk_pages": 5, "observe_chunks": True}]
    prefill, decode = pair.run(requests, env={"SGLANG_GLM_PD_VERIFY_CHECKSUMS": "1"})  # digests cover every chunk
    assert_exact(prefill, decode)
    (p,), (d,) = prefill["results"], decode["results"]
    src, landed = p["chunk_digests"][0], d["chunk_digests"][0]
    # chunks of 320 tokens from token 0; decode's prefix hit holds the first 64: a pause after every chunk but
    # the last (which is sent only after the pause at 1280 tokens)
    assert sorted(src, key=int) == ["320", "640", "960", "1280"] and sorted(landed) == sorted(src)
    assert all(SUCCESS not in states for states in d["chunk_states"].values()), d["chunk_states"]
    for tokens, want in src.items():
        assert sum(name.startswith("indexer") for name in want) == 4  # layers 0-2 and the MTP layer
        assert len(want["indexer 0"]) == (int(tokens) - 64) // 64
        for name, digests in want.items():
            assert landed[tokens][name] == digests, f"decode's {name} of tokens 64..{tokens} before the last chunk"
    assert_clean(prefill, decode)


def test_a_hung_decode_peer_does_not_delay_another(pair) -> None:
    """Decode A's room hangs in its transfer (until the 8 s timeout); decode B's room, queued after it on the
    same prefill rank, lands at once on its own lane."""
    requests = [
        {"room": 81, "tokens": 500, "prefill_fault": "hang"},
        {"room": 82, "tokens": 700, "prefix": 64, "with_previous": True},
    ]
    env = {"SGLANG_GLM_PD_TIMEOUT_S": "8"}
    prefill, decode_a = pair.run(requests, env=env, more_decodes=([{**requests[1], "delay_s": 1.5}],))
    (decode_b,) = pair.more
    a, b = decode_a["results"][0], decode_b["results"][0]
    assert a["states"] == [FAILED] and "did not complete in 8.0 s" in a["reasons"][0], a
    assert b["states"] == [SUCCESS], b
    assert b["seconds"] < 3, b["seconds"]  # behind the hung room it would wait for its timeout (~6.5 s)
    assert [p["room"] for p in prefill["results"]] == [82, 81]  # prefill concluded room 82 first
    assert_exact({"results": prefill["results"][:1]}, {"results": [b]})
    assert_clean(prefill, decode_a)
    assert_clean(None, decode_b)


@pytest.fixture
def seeds_pair(tmp_path: Path) -> Pair:
    """GLM-5.2-style IndexShare: SGLang sizes a DSA top-k seed buffer (index_topk wide) in MetadataBuffers."""
    model = tmp_path / "tiny-glm-indexshare"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY_GLM, "index_share_for_mtp_iteration": True}))
    return Pair(tmp_path, str(model))


def test_mtp_seeds_arrive_byte_for_byte(seeds_pair) -> None:
    """MTP on: SGLang's ``set_buf`` writes hidden states, EAGLE top-k and ``output_dsa_topk_indices`` into the
    request's metadata row; decode's row must equal prefill's, invalid-sentinel (-1) entries included."""
    requests = [
        {"room": 91, "tokens": 900, "seeds": "valid"},
        {"room": 92, "tokens": 700, "prefix": 128, "chunk_pages": 3, "seeds": "partial"},
        {"room": 93, "tokens": 300, "seeds": "none"},  # a seedless prefill: SGLang writes a row of -1
    ]
    prefill, decode = seeds_pair.run(requests)
    assert_exact(prefill, decode)
    rows = {}
    for p, d in zip(prefill["results"], decode["results"], strict=True):
        assert d["meta_rows"] == p["meta_rows"], d["room"]
        rows[d["room"]] = bytes.fromhex(d["meta_rows"][0]["output_dsa_topk_indices"])
    sentinel = (-1).to_bytes(4, "little", signed=True)
    assert len(rows[91]) == 64 * 4 and sentinel not in [rows[91][i : i + 4] for i in range(0, 256, 4)]
    assert rows[92][128:] == sentinel * 32 and sentinel not in [rows[92][i : i + 4] for i in range(0, 128, 4)]
    assert rows[93] == sentinel * 64
    assert_clean(prefill, decode)


def test_memory_release_and_resume_registers_the_new_addresses(pair) -> None:
    """SGLang's ``release_memory_occupation`` / ``resume_memory_occupation`` on both queues between rooms, the
    caches back at new addresses: later rooms move their bytes from and into the new buffers. Decode waits 3 s
    before its own release, as an operator resumes prefill before sending it work again: a room that reaches a
    prefill whose memory is still released is refused by design (seen under load without the wait)."""
    requests = [
        {"room": 111, "tokens": 900, "prefix": 64},
        {"room": 112, "tokens": 1300, "prefix": 128, "chunk_pages": 5, "release_resume": True, "delay_s": 3},
        {"room": 113, "tokens": 700},
    ]
    prefill, decode = pair.run(requests)
    assert_exact(prefill, decode)
    assert_clean(prefill, decode)


def test_decode_radix_hit_sends_only_the_suffix(pair) -> None:
    """Decode's prefix comes from SGLang's RadixCache: room 122 shares 600 tokens with room 121, which decode
    cached; the hit is page-aligned (576), prefill learns it and sends only the pages past it."""
    shared = [(3 * t) % 500 for t in range(600)]
    requests = [
        {"room": 121, "tokens": 700, "prompt": [*shared, *[7] * 100], "radix": True},
        {"room": 122, "tokens": 1000, "prompt": [*shared, *[9] * 400], "radix": True, "chunk_pages": 4},
    ]
    prefill, decode = pair.run(requests)
    assert [d["prefix"] for d in decode["results"]] == [[0], [576]]
    assert [p["prefix"] for p in prefill["results"]] == [[0], [576]]
    assert_exact(prefill, decode)
    pages = 11 + (1000 - 576 + 63) // 64
    assert prefill["stats"][0]["main_bytes"] == pages * 7 * 64 * 656  # 7 main layers: 6 target + MTP
    assert_clean(prefill, decode)

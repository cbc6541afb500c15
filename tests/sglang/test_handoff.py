"""Two processes, real SGLang backend classes, real bootstrap server, real transports over loopback.

The caches are SGLang's own ``DSATokenToKVPool`` on the CPU, pages come from SGLang's allocator, and prefill
runs SGLang's bootstrap queue and send path; what remains a test double is listed in tests/support/sglang_proc.py
and tests/support/sglang_prefill.py (the GPU's timing, decode's radix tree and batch formation).
"""

import pytest

from tests.support.sglang_checks import FAILED, STAGED, SUCCESS, assert_clean, assert_exact

PAGE = 64
INDEXER_LAYERS = 4  # tiny model: full layers 0-2 plus the MTP layer
MAIN_LAYERS = 7


def suffix_pages(req: dict) -> int:
    return -(-(req["tokens"] - req.get("prefix", 0)) // PAGE)


REQUESTS = [
    {"room": 11, "tokens": 40},  # shorter than a page
    {"room": 12, "tokens": 700},
    {"room": 13, "tokens": 1000, "prefix": 384},  # decode holds 6 pages: only the suffix travels
    {"room": 14, "tokens": 2100, "prefix": 64, "chunk_pages": 7},  # chunked prefill: each chunk with its indexer
]


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_handoff_is_byte_exact(pair, transport: str, staged: bool) -> None:
    prefill, decode = pair.run(REQUESTS, env={"SGLANG_GLM_PD_TRANSPORT": transport, **(STAGED if staged else {})})
    assert_exact(prefill, decode)
    assert_clean(prefill, decode)
    pages = sum(suffix_pages(r) for r in REQUESTS)
    stats = prefill["stats"][0]
    assert stats["main_bytes"] == pages * MAIN_LAYERS * PAGE * 656
    assert stats["indexer_bytes"] == pages * INDEXER_LAYERS * PAGE * 132
    assert stats.get("staged_bytes", 0) == (stats["main_bytes"] + stats["indexer_bytes"] if staged else 0)
    walks = {}
    for room, status in prefill["transitions"][0]:
        walks.setdefault(room, []).append(status)
    for r in REQUESTS:  # the sender's KVPoll walk: monotonic, through WaitingForInput and Transferring
        walk = walks[r["room"]]
        # Bootstrapping (1) is seen only when the sender exists before decode's room message arrives;
        # either order happens, as in SGLang, and the room then starts at WaitingForInput.
        assert walk == sorted(walk) and {2, 3, 4} <= set(walk) <= {1, 2, 3, 4} and walk[-1] == SUCCESS, walk
    assert ("mooncake" if transport == "mooncake" else "UCX").lower() in prefill["data_path"].lower() or (
        transport == "mooncake" and "tcp" in prefill["data_path"]
    )


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_replicated_tp_path(pair, prefill_tp: int, decode_tp: int, staged: bool) -> None:
    """Each decode rank gets one whole copy from its one source rank; other prefill ranks are dummies."""
    requests = [{"room": 21, "tokens": 500, "prefix": 64}, {"room": 22, "tokens": 900}]
    prefill, decode = pair.run(requests, prefill_tp=prefill_tp, decode_tp=decode_tp, env=STAGED if staged else None)
    assert_exact(prefill, decode, prefill_tp, decode_tp)
    assert_clean(prefill, decode)
    moved = [s.get("main_bytes", 0) for s in prefill["stats"]]
    expected = sum(suffix_pages(r) for r in requests) * MAIN_LAYERS * PAGE * 656
    assert moved == ([expected * decode_tp] if prefill_tp == 1 else [expected, 0])
    staged_bytes = [s.get("staged_bytes", 0) for s in prefill["stats"]]
    indexer = [s.get("indexer_bytes", 0) for s in prefill["stats"]]
    assert staged_bytes == ([m + i for m, i in zip(moved, indexer, strict=True)] if staged else [0] * prefill_tp)
    # every rank's regions are registered on a device other than 0, its own (issue 15 item 2: descriptors built
    # with device 0 fail on such ranks)
    assert prefill["device_ids"] == [[1 + r] for r in range(prefill_tp)]
    assert decode["device_ids"] == [[5 + r] for r in range(decode_tp)]


def test_bad_requests_fail_cleanly_and_the_next_one_works(pair) -> None:
    requests = [
        {"room": 31, "tokens": 700, "prefix": 128, "fault": "misaligned"},
        {"room": 32, "tokens": 700, "prefix": 128, "fault": "misaligned_unchecked"},
        {"room": 33, "tokens": 700, "fault": "out_of_range_unchecked"},
        {"room": 34, "tokens": 700, "prefix": 128, "fault": "suffix_shift"},
        {"room": 35, "tokens": 2500, "fault": "abort"},
        {"room": 36, "tokens": 1500, "prefix": 64, "chunk_pages": 5},
    ]
    prefill, decode = pair.run(requests)
    pairs = zip(prefill["results"], decode["results"], strict=True)
    reasons = {d["room"]: (p["reasons"][0], d["reasons"][0]) for p, d in pairs}
    for p, d in zip(prefill["results"][:-1], decode["results"][:-1], strict=True):
        assert p["states"] == [FAILED] and d["states"] == [FAILED], (p, d)
    assert "not page-aligned" in reasons[31][1]  # decode refuses its own misaligned prefix...
    assert "Aborted by decode" in reasons[31][0]  # ...and tells prefill, which frees the request
    assert all("not page-aligned" in r for r in reasons[32])  # prefill applies the same rule to the wire
    assert all("page id 1000000 is outside region main[layer 0]" in r for r in reasons[33])
    assert all("suffix mismatch" in r for r in reasons[34])
    assert "Aborted" in reasons[35][0] and "Aborted" in reasons[35][1]
    assert_exact({"results": prefill["results"][-1:]}, {"results": decode["results"][-1:]})
    assert_clean(prefill, decode)
    # decode's abort notices were handled whole (before: taking SGLang's deferred-ACK method for its target raised)
    (log,) = pair.tmp.glob("prefill-*.log")
    assert "failed to handle a message" not in log.read_text()


@pytest.mark.parametrize(
    ("prefill_env", "decode_env", "row", "fields"),
    [
        (
            {"SGLANG_GLM_PD_MODEL_REVISION": "r1"},
            {"SGLANG_GLM_PD_MODEL_REVISION": "r2"},
            656,
            ["model_revision: prefill='r1'", "'r2'"],
        ),
        ({}, {}, 576, ["main_row_bytes: prefill=656", "=576", "main_row_format"]),
    ],
)
def test_layout_mismatch_is_refused_at_registration(
    pair, prefill_env: dict, decode_env: dict, row: int, fields: list[str]
) -> None:
    """SGLang compares neither item lengths nor checkpoint revisions; glm-pd refuses both, naming field and
    values. (Indexer scale formats cannot differ here: SGLang writes fp32 on every device, and a configured
    value the device contradicts stops the rank at start, ``test_devices``.)"""
    prefill, decode = pair.run(
        [{"room": 41, "tokens": 300}], prefill_env=prefill_env, decode_env=decode_env, decode_row_bytes=row
    )
    assert decode["results"][0]["states"] == [FAILED] and prefill["results"][0]["states"] == [FAILED]
    for reason in (decode["results"][0]["reasons"][0], prefill["results"][0]["reasons"][0], decode["refusals"][0]["0"]):
        assert "at registration" in reason
        for field in fields:
            assert field in reason
    assert prefill["stats"][0].get("main_bytes", 0) == 0  # nothing moved
    assert_clean(prefill, decode)


def test_digest_verification_catches_a_flipped_byte(pair) -> None:
    requests = [{"room": 51, "tokens": 900}, {"room": 52, "tokens": 900, "fault": "corrupt"}]
    requests.append({"room": 53, "tokens": 900})
    prefill, decode = pair.run(requests, env={"SGLANG_GLM_PD_VERIFY_CHECKSUMS": "1"})
    states = [d["states"][0] for d in decode["results"]]
    assert states == [SUCCESS, FAILED, SUCCESS]
    assert "checksum mismatch in indexer[layer 6 mtp] region" in decode["results"][1]["reasons"][0]
    # hashed on glm-pd's verifier thread, reported through poll: never on the thread that polls (SGLang's scheduler)
    assert decode["digest_threads"] and all(t.startswith("glm-pd-verify") for t in decode["digest_threads"]), decode[
        "digest_threads"
    ]
    assert decode["poll_thread"] not in decode["digest_threads"]
    assert_exact({"results": prefill["results"][::2]}, {"results": decode["results"][::2]})
    assert_clean(prefill, decode)


def test_a_verification_that_does_not_end_fails_its_room_within_the_timeout(pair) -> None:
    """The verifier stalls on room 55 past decode's 3 s ``timeout_s`` (an injected stall standing in for a stuck
    device copy): the room fails naming it instead of staying Transferring, and the next room verifies and lands
    once the stall ends."""
    requests = [{"room": 55, "tokens": 500, "fault": "stall_verify:4"}, {"room": 56, "tokens": 500}]
    env = {"SGLANG_GLM_PD_VERIFY_CHECKSUMS": "1"}
    prefill, decode = pair.run(requests, env=env, decode_env={"SGLANG_GLM_PD_TIMEOUT_S": "3"})
    stalled, after = decode["results"]
    assert stalled["states"] == [FAILED] and "not verified within 3 s" in stalled["reasons"][0], stalled
    assert after["states"] == [SUCCESS], after
    assert_exact({"results": prefill["results"][1:]}, {"results": [after]})


def test_prefill_gone_fails_the_room_without_a_hang(pair) -> None:
    env = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
    requests = [{"room": 61, "tokens": 900, "prefill_exit": "after_bootstrap"}]
    _, decode = pair.run(requests, env=env, prefill_exits=True)
    result = decode["results"][0]
    assert result["states"] == [FAILED]
    assert "Lost connection with prefill" in result["reasons"][0]
    assert result["seconds"] < 15  # two missed 2 s heartbeats, not the 300 s waiting timeout
    assert_clean(None, decode)

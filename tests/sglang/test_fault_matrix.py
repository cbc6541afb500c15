"""The SGLang side of the fault matrix: one prefill/decode pair (real SGLang backend classes, NIXL on
loopback) serves a run of requests in which every faulted request is followed by a clean one. Each fault
must end its room Failed on decode with a reason that names it (never Success from bad KV), within a
bounded time, and the next room must land byte-exact; once all rooms end, neither side holds a page or any
per-room state. Layout mismatches and a prefill that dies are in test_handoff.py.

The caches are SGLang's own DSA pools on the CPU; the test doubles are listed in tests/support/sglang_proc.py."""

import pytest

from tests.support.sglang_checks import FAILED, STAGED, SUCCESS, assert_clean, assert_exact

TIMEOUT_S = 3  # glm-pd's transfer timeout here, so a write that never completes fails in seconds
FAULTS = [  # (request, the reason decode must see)
    ({"tokens": 1000, "prefix": 384, "fault": "abort"}, "Aborted"),
    ({"tokens": 700, "fault": "corrupt"}, "checksum mismatch"),
    ({"tokens": 900, "prefix": 64, "prefill_fault": "error"}, "(injected)"),
    ({"tokens": 500, "prefill_fault": "hang"}, "did not complete in"),
    ({"tokens": 800, "prefill_fault": "abort"}, "prefill aborted the request"),
    ({"tokens": 700, "prefix": 128, "fault": "suffix_shift"}, "suffix mismatch"),
    ({"tokens": 700, "fault": "out_of_range_unchecked"}, "page id 1000000 is outside region"),
    ({"tokens": 700, "prefix": 128, "fault": "misaligned_unchecked"}, "not page-aligned"),
    ({"tokens": 600, "fault": "corrupt"}, "checksum mismatch"),
]
CLEAN = [{"tokens": 1200, "prefix": 256}, {"tokens": 300}, {"tokens": 2000, "chunk_pages": 9}]


@pytest.fixture(scope="module", params=[False, True], ids=["direct", "staged"])
def run(module_pair, request):
    """The whole run once pushed directly, once through staging slots (a transport fault then hits a slot's
    write, a hang its wait, and a failed room's lent pair must come back)."""
    requests, room = [], 700
    for i, (faulted, _) in enumerate(FAULTS):
        requests += [{"room": room, **faulted}, {"room": room + 1, **CLEAN[i % len(CLEAN)]}]
        room += 2
    requests.append({"room": 700 + 2 * len(FAULTS) - 2, "tokens": 600})  # the last failed room id, retried
    env = {"SGLANG_GLM_PD_VERIFY_CHECKSUMS": "1", "SGLANG_GLM_PD_TIMEOUT_S": str(TIMEOUT_S)}
    if request.param:
        env.update(STAGED)
    prefill, decode = module_pair.run(requests, env=env, pool_pages=96)
    return request.param, prefill, decode


@pytest.mark.parametrize("index", range(len(FAULTS)), ids=[f"{f.get('fault') or 'prefill_' + f['prefill_fault']}"
                                                           for f, _ in FAULTS])  # fmt: skip
def test_fault_fails_its_room_and_the_next_room_works(run, index: int) -> None:
    _, prefill, decode = run
    p, d = prefill["results"][2 * index], decode["results"][2 * index]
    assert d["states"] == [FAILED], d
    assert FAULTS[index][1] in d["reasons"][0], d["reasons"]
    # prefill ends the room too (its pages are freed), except when only decode's verification could tell
    assert p["states"] == [SUCCESS if FAULTS[index][0].get("fault") == "corrupt" else FAILED], p
    assert d["seconds"] < TIMEOUT_S + 12, d["seconds"]  # bounded: no waiting for SGLang's 300 s timeout
    nxt = {"results": [prefill["results"][2 * index + 1]]}, {"results": [decode["results"][2 * index + 1]]}
    assert_exact(*nxt)


def test_a_failed_room_id_used_again_works_and_nothing_is_left(run) -> None:
    staged, prefill, decode = run
    assert decode["results"][-1]["states"] == [SUCCESS]
    assert (sum(s.get("staged_bytes", 0) for s in prefill["stats"]) > 0) == staged
    assert_exact({"results": prefill["results"][-1:]}, {"results": decode["results"][-1:]})
    assert_clean(prefill, decode)

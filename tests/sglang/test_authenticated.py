"""SGLang's rank sockets admit only holders of the deployment's key: the pair hands off authenticated (as every
SGLang suite here runs) and a stranger without keys knocking on any rank's socket is stopped at ZeroMQ's
handshake. (A key other than the server's: tests/common/test_authenticated_peers.py, the same socket options.)"""

from tests.support.sglang_checks import assert_exact

REQUESTS = [{"room": 31, "tokens": 700, "prefix": 64}]


def test_ranks_authenticate_and_a_stranger_is_stopped_at_the_handshake(pair) -> None:
    prefill, decode = pair.run(REQUESTS, prefill_tp=2, decode_tp=1)
    assert_exact(prefill, decode, 2, 1)
    # a client without keys meets a CURVE server: told of the mismatch, or cut off (never "succeeded")
    assert set(prefill["stranger"] + decode["stranger"]) <= {"protocol", "cut short"}, (prefill, decode)
    assert len(prefill["stranger"]) == 2 and len(decode["stranger"]) == 1


def test_a_member_without_the_rooms_grant_cannot_take_its_decodes_place_or_join_its_room(pair) -> None:
    """A deployment member (it holds the key) that is not the room's decode, on the genuine receiver's socket so
    that prefill reads it in order (tests/support/sglang_impostor.py): a registration under the genuine rank's
    agent name with its own NIXL agent and proof, its own registration, then the genuine room described again as
    its own. Prefill replaces nothing and adds nobody: both rooms land exactly (before: the borrowed name evicted
    the genuine agent and the room failed writing to the impostor)."""
    requests = [{"room": 51, "tokens": 700, "prefix": 64, "fault": "impostor"}, {"room": 52, "tokens": 500}]
    prefill, decode = pair.run(requests, prefill_tp=1, decode_tp=1)
    assert_exact(prefill, decode, 1, 1)
    assert all(not held for held in prefill["leftovers"][0].values()), prefill["leftovers"]

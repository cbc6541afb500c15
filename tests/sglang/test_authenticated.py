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

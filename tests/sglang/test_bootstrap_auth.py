"""SGLang's bootstrap server under glm-pd: with the deployment's credential, the routes that register or reveal
prefill ranks answer its holders only, and a stranger's registration or query is refused (401) and changes
nothing; without one, SGLang's server is unchanged. Each server here is SGLang's real one, in this process; the
clients are glm-pd's overrides of SGLang's own calls, on instances holding only what those calls read (whole
ranks: the pair at the end, and every pair of this suite, which all run with a credential)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.trust import OPEN, Trust, make_credential
from glm_pd_sglang.conn import GlmPdKVManager
from glm_pd_sglang.endpoints import GlmPdKVBootstrapServer, GlmPdKVReceiver, GlmPdKVSender
from tests.support.credential import suite_credential
from tests.support.ports import free_port
from tests.support.sglang_checks import assert_exact

RANK = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
        "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0, "page_size": 64,
        "kv_cache_dtype": "fp8_e4m3"}  # fmt: skip
GENUINE = {**RANK, "rank_ip": "127.0.0.1", "rank_port": 41001}
FORGED = {**RANK, "rank_ip": "203.0.113.9", "rank_port": 41999}  # the same rank, somewhere else
ONE_RANK = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
SHAPE = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


@pytest.fixture
def start(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """Start SGLang's bootstrap server as glm-pd's backend builds it, with ``SGLANG_GLM_PD_CREDENTIAL`` set to the
    given key (unset for None); returns the server and its address."""
    servers: list[GlmPdKVBootstrapServer] = []

    def run(credential: str | None) -> tuple[GlmPdKVBootstrapServer, str]:
        if credential is None:
            monkeypatch.delenv("SGLANG_GLM_PD_CREDENTIAL", raising=False)
        else:
            monkeypatch.setenv("SGLANG_GLM_PD_CREDENTIAL", credential)
        port = free_port()
        servers.append(GlmPdKVBootstrapServer(host="127.0.0.1", port=port))
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                if requests.get(f"http://{addr}/health", timeout=1).status_code == 200:
                    return servers[-1], addr
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    yield run
    for server in servers:
        server.close()


def prefill_rank(trust: Trust) -> GlmPdKVManager:
    """A prefill manager holding only what its registration reads."""
    mgr = object.__new__(GlmPdKVManager)
    mgr.trust = trust
    mgr.attn_tp_rank = mgr.attn_cp_rank = mgr.pp_rank = 0
    mgr.attn_cp_size = mgr.pp_size = 1
    return mgr


def decode_receiver(trust: Trust, addr: str) -> GlmPdKVReceiver:
    """A decode receiver holding only what its query of one prefill rank reads."""
    receiver = object.__new__(GlmPdKVReceiver)
    receiver.kv_mgr = SimpleNamespace(trust=trust)
    receiver.bootstrap_addr = addr
    return receiver


def prefill_sender(trust: Trust, addr: str, room: int, dp_rank: int) -> GlmPdKVSender:
    """A prefill sender holding only what its note of a room's DP rank reads."""
    sender = object.__new__(GlmPdKVSender)
    sender.kv_mgr = SimpleNamespace(trust=trust, attn_dp_rank=dp_rank)
    sender.bootstrap_server_url, sender.bootstrap_room = addr, room
    return sender


def other_key(tmp_path: Path) -> Trust:
    return Trust.from_settings(str(make_credential(tmp_path, "other")), insecure=False)


def test_a_stranger_can_neither_register_nor_read_a_rank(start, tmp_path: Path) -> None:
    server, addr = start(suite_credential())
    holder = Trust.from_settings(suite_credential(), insecure=False)
    prefill_rank(holder)._register_topology_row(f"http://{addr}/route", GENUINE)
    token = holder.bearer_token()
    assert token is not None
    one_off = token[:-1] + ("1" if token.endswith("0") else "0")
    strangers = [
        {},
        {"Authorization": f"Bearer {other_key(tmp_path).bearer_token()}"},
        {"Authorization": f"Bearer {one_off}"},
        {"Authorization": f"Basic {token}"},
        {"Authorization": token},
    ]
    for headers in strangers:
        put = requests.put(f"http://{addr}/route", json=FORGED, headers=headers, timeout=5)
        get = requests.get(f"http://{addr}/route?{ONE_RANK}", headers=headers, timeout=5)
        for reply in (put, get):
            assert reply.status_code == 401, (headers, reply.text)
            assert reply.headers["WWW-Authenticate"] == "Bearer"
            assert "needs the deployment's bearer token" in reply.text
            for secret in ("203.0.113.9", "41999", "41001", token[:16]):  # nothing of the request, nor a rank
                assert secret not in reply.text
    assert server.refused.total == 2 * len(strangers)
    # the genuine registration stands, and a holder reads it
    assert decode_receiver(holder, addr)._get_bootstrap_info_from_server(0, 0, 0, 0) == {
        "rank_ip": "127.0.0.1",
        "rank_port": 41001,
        "pp_rank": 0,
    }
    assert server._registered_count == 1
    # what SGLang's decode reads without a backend's say stays open: its heartbeat and the instance's shape
    assert requests.get(f"http://{addr}/health", timeout=5).status_code == 200
    shape = requests.get(f"http://{addr}/route?{SHAPE}", timeout=5)
    assert shape.status_code == 200 and shape.json()["attn_tp_size"] == 1
    assert "41001" not in shape.text
    assert server.refused.total == 2 * len(strangers)


def test_a_rank_with_another_key_is_refused_naming_the_setting(start, tmp_path: Path) -> None:
    server, addr = start(suite_credential())
    with pytest.raises(ConfigError, match=r"refused prefill rank 0's registration .* same SGLANG_GLM_PD_CREDENTIAL"):
        prefill_rank(other_key(tmp_path))._register_topology_row(f"http://{addr}/route", GENUINE)
    assert server._registered_count == 0 and server.prefill_port_table == {}
    assert server.refused.total == 1  # refused once, not retried


def test_a_rooms_dp_rank_is_taken_from_holders_only(start, tmp_path: Path) -> None:
    server, addr = start(suite_credential())
    holder = Trust.from_settings(suite_credential(), insecure=False)

    def dp_ranks() -> dict:
        return requests.post(f"http://{addr}/query_dp_ranks", json={"bootstrap_rooms": [7]}, timeout=5).json()

    stranger = requests.post(f"http://{addr}/register_dp_rank", json={"bootstrap_room": 7, "dp_rank": 1}, timeout=5)
    assert stranger.status_code == 401
    prefill_sender(other_key(tmp_path), addr, room=7, dp_rank=3)._register_prefill_dp_rank()
    assert dp_ranks() == {}
    prefill_sender(holder, addr, room=7, dp_rank=2)._register_prefill_dp_rank()
    assert dp_ranks() == {"7": 2}
    assert server.refused.total == 2


def test_without_a_credential_the_server_is_sglangs(start) -> None:
    server, addr = start(None)
    assert not server.trust.authenticated
    prefill_rank(OPEN)._register_topology_row(f"http://{addr}/route", GENUINE)
    info = decode_receiver(OPEN, addr)._get_bootstrap_info_from_server(0, 0, 0, 0)
    assert info == {"rank_ip": "127.0.0.1", "rank_port": 41001, "pp_rank": 0}
    # open to anyone, as SGLang serves it
    assert requests.put(f"http://{addr}/route", json=FORGED, timeout=5).status_code == 200
    assert requests.get(f"http://{addr}/route?{ONE_RANK}", timeout=5).json()["rank_ip"] == "203.0.113.9"
    prefill_sender(OPEN, addr, room=8, dp_rank=1)._register_prefill_dp_rank()
    assert requests.post(f"http://{addr}/query_dp_ranks", json={"bootstrap_rooms": [8]}, timeout=5).json() == {"8": 1}
    assert server.refused.total == 0


def test_the_pair_hands_off_through_the_authenticated_server(pair) -> None:
    prefill, decode = pair.run([{"room": 41, "tokens": 700, "prefix": 64}], prefill_tp=2)
    assert_exact(prefill, decode, 2, 1)
    assert prefill["bootstrap_refused"] == 0  # both ranks registered, and decode read them, with the token

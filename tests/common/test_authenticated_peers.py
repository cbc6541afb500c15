"""Only holders of the deployment's credential speak to a glm-pd side channel; everyone else learns nothing.

Real PrefillService and DecodeService over NIXL on loopback, authenticated with CURVE keys ``glm-pd keygen``
makes; strangers are plain side-channel clients, raw ZeroMQ sockets or raw TCP sockets.
"""

from __future__ import annotations

import socket
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth

from glm_pd_common.errors import AuthenticationFailed, ConfigError
from glm_pd_common.handoff.wire import protocol, trust
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient, SideChannelServer, SideChannelTimeout
from glm_pd_common.handoff.wire.trust import Trust, load_credential, make_credential
from tests.support.services import PAGE_TOKENS, SEED, Decode, Prefill
from tests.support.strangers import curve, handshake

V = PROTOCOL_VERSION


@pytest.fixture
def deployment(tmp_path: Path) -> Trust:
    return Trust(load_credential(str(make_credential(tmp_path / "keys", "deployment"))))


def other_deployment(tmp_path: Path) -> Trust:
    return Trust(load_credential(str(make_credential(tmp_path / "other", "deployment"))))


def test_keygen_writes_a_secret_file_only_its_owner_reads(tmp_path: Path) -> None:
    path = make_credential(tmp_path, "site")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    credential = load_credential(str(path))
    assert credential.public == zmq.curve_public(credential.secret)
    assert credential.secret.decode() not in repr(credential)
    with pytest.raises(ConfigError, match="exists"):
        make_credential(tmp_path, "site")
    with pytest.raises(ConfigError, match="public key only"):
        load_credential(str(tmp_path / "site.key"))
    with pytest.raises(ConfigError, match="no such file"):
        load_credential(str(tmp_path / "absent.key_secret"))


def test_a_credential_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_file = load_credential(str(make_credential(tmp_path, "site")))
    monkeypatch.setenv("SITE_KEY", from_file.secret.decode())
    assert load_credential("env:SITE_KEY") == from_file
    monkeypatch.setenv("SITE_KEY", "not a key")
    with pytest.raises(ConfigError, match="not a CURVE secret key"):
        load_credential("env:SITE_KEY")
    with pytest.raises(ConfigError, match="NO_SUCH_KEY is not set"):
        load_credential("env:NO_SUCH_KEY")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "prefill-node-3"])
def test_an_open_side_channel_off_loopback_is_refused_unless_the_operator_says_insecure(host: str) -> None:
    with pytest.raises(ConfigError, match=f"{host} is not a loopback address and no credential"):
        SideChannelServer(host)
    with pytest.raises(ConfigError, match="set `insecure`"):
        SideChannelClient(host, 5710)
    server = SideChannelServer("0.0.0.0", trust=Trust(insecure=True))
    server.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_credential(host: str) -> None:
    Trust().check_host(host, "side channel host")


def test_the_bearer_token_is_the_deployments_alone(deployment: Trust, tmp_path: Path) -> None:
    """What an HTTP service of the deployment asks (SGLang's bootstrap server: tests/sglang/test_bootstrap_auth.py)."""
    token = deployment.bearer_token()
    assert token is not None and len(token) == 128  # BLAKE2b-512, hex
    assert token == Trust(deployment.credential).bearer_token()  # every holder makes the same
    assert deployment.credential is not None and deployment.credential.secret.decode() not in token
    other = other_deployment(tmp_path).bearer_token()
    assert other is not None and other != token
    assert deployment.admits_bearer(token)
    for presented in (other, token[:-1], token + "0", "", token.upper(), "\udcff" + token[1:]):
        assert not deployment.admits_bearer(presented), presented
    assert Trust().bearer_token() is None and Trust().admits_bearer("")  # no credential: nothing is asked


def test_a_decode_holding_the_credential_loads_as_before(small_spec, deployment: Trust) -> None:
    prefill, decode = Prefill(small_spec, trust=deployment), Decode(small_spec, trust=deployment)
    try:
        result = decode.load(prefill, "r1", 3 * PAGE_TOKENS)
        assert result.ok, result.reason
        assert not decode.caches.mismatched_tokens(np.arange(3), 0, 3 * PAGE_TOKENS, seed=SEED)
    finally:
        decode.close()
        prefill.close()


def test_a_stranger_without_the_credential_learns_nothing(small_spec, deployment: Trust, tmp_path: Path) -> None:
    """A query (which answers with the fingerprint, region addresses and agent name) gets no answer at all: a
    client without keys is told the server speaks another mechanism, one with another deployment's keys is
    refused, a raw socket's frames are dropped unread. The service saw none of it."""
    prefill = Prefill(small_spec, trust=deployment)
    query = protocol.Query(v=V, engine_id="stranger")
    try:
        plain = SideChannelClient("127.0.0.1", prefill.service.port)
        plain.send(query)
        with pytest.raises(AuthenticationFailed, match="security mechanism"):
            plain.recv(10.0)
        plain.close()
        other = SideChannelClient("127.0.0.1", prefill.service.port, other_deployment(tmp_path))
        other.send(query)
        with pytest.raises(SideChannelTimeout, match="handshakes were cut short"):
            other.recv(2.0)
        other.close()
        # the public key is no secret: a stranger who has it is refused with its own key pair, and cannot present
        # the deployment's public key without its secret
        assert deployment.credential is not None
        public, secret = zmq.curve_keypair()
        key, port = deployment.credential.public, prefill.service.port
        assert handshake("127.0.0.1", port, curve(key, public, secret)) == "refused"
        assert handshake("127.0.0.1", port, curve(key, key, secret)) in ("refused", "cut short")
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{prefill.service.port}")
        raw.send(protocol.encode(query))
        assert not raw.poll(2000), "a raw socket got an answer"
        raw.close()
        ctx.term()
        assert prefill.service.leftovers()["decode_peers"] == 0
    finally:
        prefill.close()


def test_a_decode_never_loads_the_metadata_of_a_prefill_that_did_not_authenticate(
    small_spec, deployment: Trust, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unauthenticated prefill (no credential) is refused as soon as its handshake fails; one holding another
    deployment's key cannot complete a handshake at all. Either way decode loads nothing of it into its
    transport, and the request fails as a refused peer."""
    decode = Decode(small_spec, trust=deployment, timeout_s=3.0)
    loaded: list[bytes] = []
    add_peer = decode.local.transport.add_peer
    monkeypatch.setattr(
        decode.local.transport, "add_peer", lambda meta, spans: loaded.append(meta) or add_peer(meta, spans)
    )
    try:
        for name, prefill in [
            ("open", Prefill(small_spec)),
            ("foreign", Prefill(small_spec, trust=other_deployment(tmp_path))),
        ]:
            try:
                started = time.monotonic()
                result = decode.load(prefill, name, 2 * PAGE_TOKENS)
                assert not result.ok
                assert result.code == ("refused_peer" if name == "open" else "timeout"), (result.code, result.reason)
                assert "credential" in result.reason or "security mechanism" in result.reason, result.reason
                assert time.monotonic() - started < 30
            finally:
                prefill.close()
        assert loaded == []
    finally:
        decode.close()


def test_a_connection_that_never_completes_its_handshake_is_closed(small_spec, deployment: Trust) -> None:
    """An idle stranger cannot hold a connection (and a file descriptor) of prefill's: ZeroMQ closes it once the
    handshake interval passes. Waits up to four intervals."""
    prefill = Prefill(small_spec, trust=deployment)
    try:
        with socket.create_connection(("127.0.0.1", prefill.service.port), timeout=10) as conn:
            conn.settimeout(4 * trust.HANDSHAKE_S)
            started = time.monotonic()
            received = b""
            try:
                while chunk := conn.recv(4096):
                    received += chunk
            except TimeoutError:
                pytest.fail(f"the idle connection was still open after {4 * trust.HANDSHAKE_S:.0f} s")
            closed_after = time.monotonic() - started
        assert closed_after >= trust.HANDSHAKE_S * 0.5, closed_after
        assert received.startswith(b"\xff") and len(received) < 64, received  # a ZMTP greeting's start, no more
    finally:
        prefill.close()


def test_glm_pd_keygen_writes_the_key_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from glm_pd_common.tools.cli import main

    assert main(["keygen", str(tmp_path / "keys"), "--name", "site"]) == 0
    path = tmp_path / "keys" / "site.key_secret"
    assert str(path) in capsys.readouterr().out and stat.S_IMODE(path.stat().st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(tmp_path / "keys" / "site.key")
    assert load_credential(str(path)).public == public and secret is None  # the .key file holds no secret
    assert main(["keygen", str(tmp_path / "keys"), "--name", "site"]) == 2  # never replaced by accident
    assert "exists" in capsys.readouterr().err

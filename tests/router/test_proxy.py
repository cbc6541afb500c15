"""The PD proxy over real HTTP against two small local stubs that answer like vLLM's OpenAI server.

The stubs stand in for GPU engines: prefill returns a one-token completion with ``kv_transfer_params``
and ``prompt_token_ids`` (vLLM's fields), decode checks it received exactly those and streams SSE chunks.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

sys.path.insert(0, str(Path(__file__).parents[2] / "recipes" / "router"))
import pd_proxy

from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A uvicorn server on a thread, on 127.0.0.1."""

    def __init__(self, app: FastAPI) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def tokens(prompt: str) -> list[int]:
    return list(prompt.encode())


class Prefill:
    def __init__(self, name: str) -> None:
        self.name, self.mode, self.seen = name, "ok", []
        self.answered: list[float] = []
        self.app = FastAPI()

        @self.app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.seen.append(body)
            if self.mode == "hang_1s":
                await asyncio.sleep(1)
                self.answered.append(time.monotonic())
            if self.mode == "500":
                return JSONResponse({"error": {"message": "CUDA out of memory"}}, 500)
            if self.mode == "400":
                return JSONResponse({"error": {"message": "prompt too long"}}, 400)
            if self.mode == "hang":
                await asyncio.sleep(30)
            params = {"do_remote_prefill": True, "remote_engine_id": self.name, "remote_block_ids": [1, 2]}
            out = {
                "id": "cmpl-p",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "prompt_token_ids": tokens(body["prompt"]), "token_ids": [9]}],
            }
            if self.mode != "no_params":
                out["kv_transfer_params"] = params
            return JSONResponse(out)


class Decode:
    def __init__(self, name: str) -> None:
        self.name, self.mode, self.seen = name, "ok", []
        self.arrived: list[float] = []
        self.app = FastAPI()

        @self.app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.seen.append(body)
            self.arrived.append(time.monotonic())
            if self.mode == "500":
                return JSONResponse({"error": {"message": "KV load failed"}}, 500)
            if self.mode == "busy":  # vLLM's admission control (--max-num-queued-reqs) refusing a request
                return JSONResponse({"error": {"message": "The engine is currently busy"}}, 503)
            text = f"{self.name}:{len(body['prompt'])}"
            if not body.get("stream"):
                return JSONResponse({"id": "cmpl-d", "choices": [{"index": 0, "text": text}]})

            async def events() -> Iterator[bytes]:
                for i, piece in enumerate([text[:3], text[3:], "!"]):
                    if self.mode == "break" and i == 2:
                        raise RuntimeError("engine died mid-stream")
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': piece}]})}\n\n".encode()
                    await asyncio.sleep(0.5 if self.mode == "slow" else 0.01)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def cluster() -> Iterator[dict[str, Any]]:
    prefills = [Prefill(f"p{i}") for i in range(2)]
    decodes = [Decode(f"d{i}") for i in range(2)]
    servers = {id(s): Server(s.app) for s in [*prefills, *decodes]}
    proxy_app = pd_proxy.create_app(
        [servers[id(p)].url for p in prefills], [servers[id(d)].url for d in decodes], timeout_s=2.0
    )
    proxy = Server(proxy_app)
    yield {"prefills": prefills, "decodes": decodes, "proxy": proxy.url, "servers": servers}
    proxy.stop()
    for s in servers.values():
        s.stop()


def post(cluster: dict[str, Any], body: dict[str, Any]) -> httpx.Response:
    return httpx.post(cluster["proxy"] + "/v1/completions", json=body, timeout=20)


def test_prefill_then_decode_with_params_and_token_ids(cluster: dict[str, Any]) -> None:
    resp = post(cluster, {"model": "glm-5.3", "prompt": "hello glm", "max_tokens": 16, "temperature": 0})
    assert resp.status_code == 200, resp.text
    p_req = next(p.seen[0] for p in cluster["prefills"] if p.seen)
    assert p_req["max_tokens"] == 1 and p_req["stream"] is False and p_req["return_token_ids"] is True
    assert p_req["kv_transfer_params"] == {"do_remote_decode": True}
    d = next(d for d in cluster["decodes"] if d.seen)
    d_req = d.seen[0]
    assert d_req["prompt"] == tokens("hello glm")  # decode never re-tokenizes
    assert d_req["kv_transfer_params"]["remote_block_ids"] == [1, 2] and d_req["max_tokens"] == 16
    assert resp.json()["choices"][0]["text"] == f"{d.name}:{len('hello glm')}"


def test_streams_decode_chunks_in_order(cluster: dict[str, Any]) -> None:
    with httpx.stream("POST", cluster["proxy"] + "/v1/completions", json={"prompt": "abc", "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text.endswith(":3!")


def test_load_spreads_over_instances(cluster: dict[str, Any]) -> None:
    for i in range(8):
        assert post(cluster, {"prompt": f"req {i}"}).status_code == 200
    assert [len(p.seen) for p in cluster["prefills"]] == [4, 4]
    assert [len(d.seen) for d in cluster["decodes"]] == [4, 4]


def test_busy_instance_gets_fewer_requests(cluster: dict[str, Any]) -> None:
    """While one decode holds a long stream, new requests go to the other one."""
    for d in cluster["decodes"]:
        d.mode = "slow"  # streams take about 1.5 s; non-streamed answers stay immediate
    with httpx.stream("POST", cluster["proxy"] + "/v1/completions", json={"prompt": "long", "stream": True}) as r:
        busy = next(d for d in cluster["decodes"] if d.seen)
        for _ in range(3):
            assert post(cluster, {"prompt": "short"}).status_code == 200
        r.read()
    other = next(d for d in cluster["decodes"] if d is not busy)
    assert len(other.seen) == 3 and len(busy.seen) == 1


@pytest.mark.parametrize(
    ("mode", "status", "words"),
    [
        ("500", 502, ["prefill", "answered 500", "CUDA out of memory"]),
        ("400", 400, ["prompt too long"]),
        ("no_params", 502, ["no kv_transfer_params", "GlmPdConnector"]),
        ("hang", 504, ["did not answer within 2 s"]),
    ],
)
def test_bad_prefill_answers_become_clear_errors(
    cluster: dict[str, Any], mode: str, status: int, words: list[str]
) -> None:
    for p in cluster["prefills"]:
        p.mode = mode
    started = time.monotonic()
    resp = post(cluster, {"prompt": "x"})
    assert resp.status_code == status
    message = resp.json()["error"]["message"]
    assert all(w in message for w in words), message
    assert time.monotonic() - started < 10
    assert not any(d.seen for d in cluster["decodes"])  # decode is never asked without prefill's params


def test_bad_decode_answers_become_clear_errors(cluster: dict[str, Any]) -> None:
    for d in cluster["decodes"]:
        d.mode = "500"
    resp = post(cluster, {"prompt": "x"})
    assert resp.status_code == 502 and "answered 500: KV load failed" in resp.json()["error"]["message"]
    assert sum(len(d.seen) for d in cluster["decodes"]) == 1, "a failing decode is not a full one: no second try"
    for d in cluster["decodes"]:
        cluster["servers"][id(d)].stop()
    resp = post(cluster, {"prompt": "x"})
    assert resp.status_code == 502 and "unreachable" in resp.json()["error"]["message"]


def test_decode_breaking_off_a_stream_ends_it_with_an_error(cluster: dict[str, Any]) -> None:
    for d in cluster["decodes"]:
        d.mode = "break"
    with httpx.stream("POST", cluster["proxy"] + "/v1/completions", json={"prompt": "abc", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert "broke off the stream" in lines[-1]
    health = httpx.get(cluster["proxy"] + "/health").json()
    assert all(i["in_flight"] == 0 for i in health["decode"] + health["prefill"])


def test_a_refusing_decode_in_pull_mode_is_the_clients_503(cluster: dict[str, Any]) -> None:
    """vLLM frees prefill's blocks of a request a decode refused: no other decode could read them, so the 503 (retry
    later) goes to the client, and the instance is not counted as failing."""
    for d in cluster["decodes"]:
        d.mode = "busy"
    resp = post(cluster, {"prompt": "ab"})
    assert resp.status_code == 503 and "currently busy" in resp.json()["error"]["message"], resp.text
    assert sum(len(d.seen) for d in cluster["decodes"]) == 1
    health = httpx.get(cluster["proxy"] + "/health").json()
    assert all(i["in_flight"] == 0 and i["failures"] == 0 for i in health["decode"])


def test_bad_client_requests(cluster: dict[str, Any]) -> None:
    r = httpx.post(cluster["proxy"] + "/v1/completions", content=b"{not json", timeout=5)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    assert post(cluster, {"prompt": "x", "n": 2}).status_code == 400


@pytest.fixture
def streamed_cluster() -> Iterator[dict[str, Any]]:
    """One prefill (answering after 1 s, as a long prompt's prefill) and one decode behind the proxy in streamed
    mode (``prefill_kv``: the prefill's side channel)."""
    prefill, decode = Prefill("p0"), Decode("d0")
    prefill.mode = "hang_1s"
    servers = {id(s): Server(s.app) for s in (prefill, decode)}
    app = pd_proxy.create_app(
        [servers[id(prefill)].url], [servers[id(decode)].url], timeout_s=5.0, prefill_kv=[("10.0.0.7", 5710)]
    )
    proxy = Server(app)
    yield {"prefills": [prefill], "decodes": [decode], "proxy": proxy.url, "servers": servers}
    proxy.stop()
    for s in servers.values():
        s.stop()


def test_streamed_mode_sends_both_legs_at_once_under_one_transfer_id(streamed_cluster: dict[str, Any]) -> None:
    (prefill,), (decode,) = streamed_cluster["prefills"], streamed_cluster["decodes"]
    url = streamed_cluster["proxy"] + "/v1/completions"
    with httpx.stream("POST", url, json={"prompt": "abc", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]  # decode's leg ran while prefill's was still running
    assert lines[-1] == "data: [DONE]"
    deadline = time.monotonic() + 5
    while not prefill.answered and time.monotonic() < deadline:  # its leg outlives decode's answer, uncancelled
        time.sleep(0.05)
    assert len(decode.seen) == 1 and len(prefill.seen) == 1
    p, d = prefill.seen[0]["kv_transfer_params"], decode.seen[0]["kv_transfer_params"]
    assert p["do_remote_decode"] and d["do_remote_prefill"] and p["glm_pd_transfer_id"] == d["glm_pd_transfer_id"]
    assert (d["remote_host"], d["remote_port"], d["glm_pd_protocol"]) == ("10.0.0.7", 5710, PROTOCOL_VERSION)
    assert "remote_block_ids" not in d and decode.seen[0]["prompt"] == "abc"  # no prefill answer was awaited
    assert decode.arrived[0] < prefill.answered[0], "decode's leg waited for prefill's answer"


def test_streamed_mode_reports_a_failed_prefill_leg(streamed_cluster: dict[str, Any]) -> None:
    (prefill,) = streamed_cluster["prefills"]
    prefill.mode = "500"
    resp = httpx.post(streamed_cluster["proxy"] + "/v1/completions", json={"prompt": "x"}, timeout=20)
    assert resp.status_code == 502 and "answered 500: CUDA out of memory" in resp.json()["error"]["message"]


def test_streamed_mode_passes_a_refusing_decode_over_under_the_same_transfer(streamed_cluster: dict[str, Any]) -> None:
    """The second decode reads the transfer the first refused: one prefill leg, one transfer id, never cancelled."""
    (prefill,), (decode,) = streamed_cluster["prefills"], streamed_cluster["decodes"]
    spare = Decode("d1")
    server = Server(spare.app)
    decode.mode = "busy"
    kv = [("10.0.0.7", 5710)]
    servers = streamed_cluster["servers"]
    app = pd_proxy.create_app(
        [servers[id(prefill)].url], [servers[id(decode)].url, server.url], timeout_s=5.0, prefill_kv=kv
    )
    proxy = Server(app)
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", json={"prompt": "abc", "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "d1:" in "".join(lines)
        deadline = time.monotonic() + 5
        while not prefill.answered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(prefill.seen) == 1 and prefill.answered, "prefill's leg was cancelled or sent twice"
        ids = {d.seen[0]["kv_transfer_params"]["glm_pd_transfer_id"] for d in (decode, spare)}
        assert ids == {prefill.seen[0]["kv_transfer_params"]["glm_pd_transfer_id"]}
    finally:
        proxy.stop()
        server.stop()


def test_streamed_mode_answers_503_when_every_decode_refuses(streamed_cluster: dict[str, Any]) -> None:
    (decode,) = streamed_cluster["decodes"]
    decode.mode = "busy"
    resp = httpx.post(streamed_cluster["proxy"] + "/v1/completions", json={"prompt": "x"}, timeout=20)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"].startswith("every decode instance refused the request: decode http")


def test_prefill_kv_must_name_one_address_per_prefill() -> None:
    with pytest.raises(SystemExit):
        pd_proxy.parse_args(["--prefill", "http://a", "http://b", "--decode", "http://d", "--prefill-kv", "h:1"])
    args = pd_proxy.parse_args(["--prefill", "http://a", "--decode", "http://d", "--prefill-kv", "h:5710"])
    assert args.prefill_kv == [("h", 5710)]

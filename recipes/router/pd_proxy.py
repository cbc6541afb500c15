"""A small prefill/decode proxy for vLLM instances running GlmPdConnector.

Per request it sends the prefill leg (``kv_transfer_params: {"do_remote_decode": true}``, ``max_tokens 1``,
``return_token_ids``, not streamed), then the decode leg with prefill's ``kv_transfer_params`` and the prompt
as prefill's token ids (so decode never re-tokenizes), and streams decode's answer back.
With ``--prefill-kv`` (both engines run GlmPdConnector with ``"streamed": true``) it sends both legs at once: each
carries a new transfer id, and decode's names the side channel of the prefill instance picked
(``--prefill-kv``, one HOST:PORT per ``--prefill``: its ``side_channel_host`` and port), so decode reads the
prompt's KV while prefill computes it. A failed prefill leg ends decode's (decode's load fails with it). Load is spread
over several prefill and several decode instances (fewest requests in flight, ties in turn). A decode that answers
503 (vLLM's admission control, ``--max-num-queued-reqs`` / ``--max-num-queued-tokens``: it cannot take the request
now) is passed over in streamed mode for the next decode, under the same transfer (prefill's work stands until a
decode takes it); the client gets the 503 when every decode refused. In pull mode the 503 goes to the client: vLLM
frees prefill's blocks of a refused request, so no other decode could read them. Every upstream call is bounded; a
bad upstream answer becomes an HTTP error that names the instance, never a hang.

At scale, use a production router instead: llm-d (Kubernetes, KV-aware scheduling), NVIDIA Dynamo, or
sglang-router in PD mode (for SGLang); this proxy is the reference for what they must forward.

Run: python pd_proxy.py --prefill http://p1:8100 [...] --decode http://d1:8200 [...] [--port 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION

logger = logging.getLogger("pd_proxy")


class UpstreamError(Exception):
    """An upstream answer the client must hear about, with the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": "upstream_error"}}, status_code=self.status)


@dataclass
class Instance:
    url: str
    kv: tuple[str, int] | None = None  # a prefill's side channel (host, base port), for streamed requests
    in_flight: int = 0
    served: int = 0
    failures: int = 0


class Pool:
    """Instances of one role; ``pick`` takes the one with the fewest requests in flight, ties in turn."""

    def __init__(self, role: str, urls: list[str], kv: list[tuple[str, int]] | None = None) -> None:
        if not urls:
            raise ValueError(f"no {role} instances given")
        if kv is not None and len(kv) != len(urls):
            raise ValueError(f"{len(kv)} side-channel addresses for {len(urls)} {role} instances")
        self.role = role
        self.instances = [Instance(u.rstrip("/"), kv[i] if kv else None) for i, u in enumerate(urls)]
        self._turn = itertools.count()

    def pick(self) -> Instance:
        return self.ordered()[0]

    def ordered(self) -> list[Instance]:
        """Every instance, the one ``pick`` would take first, then the rest by requests in flight."""
        start = next(self._turn) % len(self.instances)
        ordered = self.instances[start:] + self.instances[:start]
        return sorted(ordered, key=lambda i: i.in_flight)


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        msg = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
        return str(msg or body)[:500]
    except (json.JSONDecodeError, AttributeError):
        return resp.text[:500]


def _prefill_body(body: dict[str, Any], chat: bool, transfer_id: str = "") -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    params: dict[str, Any] = {"do_remote_decode": True}
    if transfer_id:
        params["glm_pd_transfer_id"] = transfer_id
    out.update(max_tokens=1, stream=False, return_token_ids=True, kv_transfer_params=params)
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def _leg_failure(leg: asyncio.Task | None) -> str | None:
    """Why a finished prefill leg failed, or None (running, cancelled or fine)."""
    if leg is None or not leg.done() or leg.cancelled() or leg.exception() is None:
        return None
    exc = leg.exception()
    return exc.message if isinstance(exc, UpstreamError) else repr(exc)


def _prompt_token_ids(data: dict[str, Any], chat: bool) -> list[int]:
    ids = data.get("prompt_token_ids")
    choices = data.get("choices") or []
    if ids is None and choices and isinstance(choices[0], dict):
        ids = choices[0].get("prompt_token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise UpstreamError(502, "prefill returned no prompt_token_ids (does it accept return_token_ids?)")
    return ids


def create_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    *,
    timeout_s: float = 600.0,
    connect_timeout_s: float = 5.0,
    prefill_kv: list[tuple[str, int]] | None = None,
) -> FastAPI:
    """The proxy; ``prefill_kv`` (each prefill's side channel) makes every request streamed."""
    prefill, decode = Pool("prefill", prefill_urls, prefill_kv), Pool("decode", decode_urls)
    timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="glm-pd PD proxy", lifespan=lifespan)
    legs: set[asyncio.Task] = set()  # streamed requests' prefill legs still running

    async def call(pool: Pool, inst: Instance, path: str, body: dict[str, Any], *, stream: bool) -> httpx.Response:
        try:
            resp = await client.send(client.build_request("POST", inst.url + path, json=body), stream=stream)
        except httpx.TimeoutException:
            inst.failures += 1
            raise UpstreamError(504, f"{pool.role} {inst.url} did not answer within {timeout_s:g} s") from None
        except httpx.TransportError as exc:
            inst.failures += 1
            raise UpstreamError(502, f"{pool.role} {inst.url} is unreachable: {exc!r}") from None
        if resp.status_code != 200:
            if stream:
                await resp.aread()
                await resp.aclose()
            status = resp.status_code if 400 <= resp.status_code < 500 or resp.status_code == 503 else 502
            if status != 503:  # a full instance is not a failing one
                inst.failures += 1
            raise UpstreamError(status, f"{pool.role} {inst.url} answered {resp.status_code}: {_error_text(resp)}")
        return resp

    async def to_decode(
        path: str, body: dict[str, Any], *, stream: bool, pass_over: bool
    ) -> tuple[Instance, httpx.Response]:
        """Decode's leg on the instance picked (counted in flight); with ``pass_over``, past one answering 503 the
        next."""
        refusals = []
        for d in decode.ordered():
            d.in_flight += 1
            try:
                return d, await call(decode, d, path, body, stream=stream)
            except UpstreamError as exc:
                d.in_flight -= 1
                if exc.status != 503 or not pass_over:
                    raise
                logger.info("%s; trying the next decode instance", exc.message)
                refusals.append(exc.message)
        raise UpstreamError(503, f"every decode instance refused the request: {'; '.join(refusals)}")

    async def handle(request: Request, path: str, chat: bool) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "request body is not JSON", "type": "bad_request"}}, 400)
        if not isinstance(body, dict):
            return JSONResponse(
                {"error": {"message": "request body must be a JSON object", "type": "bad_request"}}, 400
            )
        if body.get("n", 1) != 1:
            return JSONResponse({"error": {"message": "n > 1 is not supported in PD mode", "type": "bad_request"}}, 400)
        if prefill_kv is not None:
            return await streamed(body, path, chat)
        try:
            p = prefill.pick()
            p.in_flight += 1
            try:
                first = await call(prefill, p, path, _prefill_body(body, chat), stream=False)
                p.served += 1
            finally:
                p.in_flight -= 1
            try:
                data = first.json()
            except json.JSONDecodeError:
                raise UpstreamError(502, f"prefill {p.url} returned a body that is not JSON") from None
            params = data.get("kv_transfer_params")
            if not isinstance(params, dict) or not params:
                raise UpstreamError(
                    502,
                    f"prefill {p.url} returned no kv_transfer_params: is it running GlmPdConnector as kv_producer?",
                )
            ids = _prompt_token_ids(data, chat)
            if chat:
                second = {**body, "kv_transfer_params": {**params, "prompt_token_ids": ids}}
            else:
                second = {**body, "prompt": ids, "kv_transfer_params": params}
            d, resp = await to_decode(path, second, stream=bool(body.get("stream")), pass_over=False)
        except UpstreamError as exc:
            logger.warning("%s", exc.message)
            return exc.response()
        if not body.get("stream"):
            d.in_flight -= 1
            d.served += 1
            return Response(resp.content, media_type="application/json")
        return StreamingResponse(relay(d, resp), media_type="text/event-stream")

    async def prefill_leg(p: Instance, path: str, body: dict[str, Any]) -> None:
        """A streamed request's prefill leg: only its failure matters (decode computes every answer token)."""
        p.in_flight += 1
        try:
            await call(prefill, p, path, body, stream=False)
            p.served += 1
        finally:
            p.in_flight -= 1

    async def streamed(body: dict[str, Any], path: str, chat: bool) -> Response:
        """Both legs at once, one transfer id; a failed prefill leg ends decode's."""
        transfer_id = uuid.uuid4().hex
        p = prefill.pick()
        assert p.kv is not None
        host, port = p.kv
        params = {
            "do_remote_prefill": True,
            "glm_pd_protocol": PROTOCOL_VERSION,
            "glm_pd_transfer_id": transfer_id,
            "remote_host": host,
            "remote_port": port,
        }
        first = asyncio.create_task(prefill_leg(p, path, _prefill_body(body, chat, transfer_id)))
        legs.add(first)  # kept until it ends, even past decode's answer
        first.add_done_callback(legs.discard)
        try:
            leg = {**body, "kv_transfer_params": params}
            d, resp = await to_decode(path, leg, stream=bool(body.get("stream")), pass_over=True)
        except UpstreamError as exc:
            first.cancel()  # the prefill leg's work is for nobody now
            logger.warning("%s", exc.message)
            return exc.response()
        if not body.get("stream"):
            d.in_flight -= 1
            try:
                await first
            except UpstreamError as exc:
                logger.warning("%s", exc.message)
                return exc.response()
            d.served += 1
            return Response(resp.content, media_type="application/json")
        return StreamingResponse(relay(d, resp, first), media_type="text/event-stream")

    async def relay(inst: Instance, resp: httpx.Response, first: asyncio.Task | None = None) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in resp.aiter_raw():
                failure = _leg_failure(first)
                if failure is not None:  # streamed: prefill's leg failed, decode's load fails with it
                    yield f"data: {json.dumps({'error': {'message': failure, 'type': 'upstream_error'}})}\n\n".encode()
                    return
                yield chunk
            inst.served += 1
            finished = True
        except httpx.HTTPError as exc:
            inst.failures += 1
            error = {"error": {"message": f"decode {inst.url} broke off the stream: {exc!r}", "type": "upstream_error"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            inst.in_flight -= 1
            if first is not None and not finished:
                first.cancel()  # the client went or decode broke off: prefill's leg is dropped (prefill aborts it)
            await resp.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions", chat=True)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {pool.role: [i.__dict__ for i in pool.instances] for pool in (prefill, decode)}

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill base URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode base URLs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on each upstream read")
    parser.add_argument(
        "--prefill-kv",
        nargs="+",
        metavar="HOST:PORT",
        help="streamed mode: each --prefill instance's glm-pd side channel (side_channel_host and its base port)",
    )
    args = parser.parse_args(argv)
    if args.prefill_kv is not None:
        if len(args.prefill_kv) != len(args.prefill):
            parser.error(f"--prefill-kv names {len(args.prefill_kv)} addresses for {len(args.prefill)} --prefill")
        args.prefill_kv = [_address(a, parser) for a in args.prefill_kv]
    return args


def _address(text: str, parser: argparse.ArgumentParser) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(f"--prefill-kv {text!r} is not HOST:PORT")
    return host, int(port)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    app = create_app(args.prefill, args.decode, timeout_s=args.timeout_s, prefill_kv=args.prefill_kv)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()

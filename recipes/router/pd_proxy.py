"""A small prefill/decode proxy for vLLM instances running GlmPdConnector.

Per request it sends the prefill leg (``kv_transfer_params: {"do_remote_decode": true}``, ``max_tokens 1``,
``return_token_ids``, not streamed), then the decode leg with prefill's ``kv_transfer_params`` and the prompt
as prefill's token ids (so decode never re-tokenizes), and streams decode's answer back. Load is spread
over several prefill and several decode instances (fewest requests in flight, ties in turn). Every upstream
call is bounded; a bad upstream answer becomes an HTTP error that names the instance, never a hang.

At scale, use a production router instead: llm-d (Kubernetes, KV-aware scheduling), NVIDIA Dynamo, or
sglang-router in PD mode (for SGLang); this proxy is the reference for what they must forward.

Run: python pd_proxy.py --prefill http://p1:8100 [...] --decode http://d1:8200 [...] [--port 8000]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
    in_flight: int = 0
    served: int = 0
    failures: int = 0


class Pool:
    """Instances of one role; ``pick`` takes the one with the fewest requests in flight, ties in turn."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"no {role} instances given")
        self.role = role
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self._turn = itertools.count()

    def pick(self) -> Instance:
        start = next(self._turn) % len(self.instances)
        ordered = self.instances[start:] + self.instances[:start]
        return min(ordered, key=lambda i: i.in_flight)


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        msg = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
        return str(msg or body)[:500]
    except (json.JSONDecodeError, AttributeError):
        return resp.text[:500]


def _prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, return_token_ids=True, kv_transfer_params={"do_remote_decode": True})
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def _prompt_token_ids(data: dict[str, Any], chat: bool) -> list[int]:
    ids = data.get("prompt_token_ids")
    choices = data.get("choices") or []
    if ids is None and choices and isinstance(choices[0], dict):
        ids = choices[0].get("prompt_token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise UpstreamError(502, "prefill returned no prompt_token_ids (does it accept return_token_ids?)")
    return ids


def create_app(
    prefill_urls: list[str], decode_urls: list[str], *, timeout_s: float = 600.0, connect_timeout_s: float = 5.0
) -> FastAPI:
    prefill, decode = Pool("prefill", prefill_urls), Pool("decode", decode_urls)
    timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="glm-pd PD proxy", lifespan=lifespan)

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
            inst.failures += 1
            status = resp.status_code if 400 <= resp.status_code < 500 else 502
            raise UpstreamError(status, f"{pool.role} {inst.url} answered {resp.status_code}: {_error_text(resp)}")
        return resp

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
            d = decode.pick()
            d.in_flight += 1
            try:
                resp = await call(decode, d, path, second, stream=bool(body.get("stream")))
            except UpstreamError:
                d.in_flight -= 1
                raise
        except UpstreamError as exc:
            logger.warning("%s", exc.message)
            return exc.response()
        if not body.get("stream"):
            d.in_flight -= 1
            d.served += 1
            return Response(resp.content, media_type="application/json")
        return StreamingResponse(relay(d, resp), media_type="text/event-stream")

    async def relay(inst: Instance, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
            inst.served += 1
        except httpx.HTTPError as exc:
            inst.failures += 1
            error = {"error": {"message": f"decode {inst.url} broke off the stream: {exc!r}", "type": "upstream_error"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            inst.in_flight -= 1
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
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(create_app(args.prefill, args.decode, timeout_s=args.timeout_s), host=args.host, port=args.port)


if __name__ == "__main__":
    main()

"""What the real-engine fault cases (tests/e2e/test_engine_faults.py) use beside the servers: a streamed completion
a client can drop, the PD proxy recipe as a process, a prefill/decode pair started for faults, and the prompts.

The fault pair differs from the session pair in two flags only: decode's KV cache holds ``KV_CACHE_TOKENS``
(so requests wait for blocks), and both sides lease for ``LEASE_S`` and wait at most ``TIMEOUT_S`` (so a queue
wait outlives a lease, and a killed prefill fails a load, within seconds).
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from tests.support.ports import free_port
from tests.support.scenarios import MAX_TOKENS, ids
from tests.support.vllm_servers import CORE, START_S, Server, disaggregated, glm_pd_config, prefill_leg, request

T = TypeVar("T")

LEASE_S = 4.0  # prefill holds a finished request's blocks this long unless decode renews the lease
TIMEOUT_S = 15.0  # decode's bound on each answer it awaits: a killed prefill fails its load within it
KV_CACHE_TOKENS = 4096  # decode's cache: two long streams leave no room for a third long prompt
# The fault prefill's chunked prefill: a 1950-token prompt takes 16 steps, where vLLM keeps it on (its CPU platform
# turns it off for MLA without AMX: one step, the streamed cases then wait on one announcement and the lease)
CHUNK_TOKENS = 128
TOKEN_BYTES = 3 * 1152  # the tiny model's KV per token: 3 layers x one bf16 latent row (512 + 64) x 2 B
PROXY = Path(__file__).parents[2] / "recipes" / "router" / "pd_proxy.py"

# Prompts (seeds of their own: none shares a prefix with another, or with tests/support/scenarios.py, unless meant).
PREFIX = ids(1024, 2001)  # decode keeps it cached while HEALTHY streams
HEALTHY, HEALTHY_TOKENS = PREFIX + ids(64, 2002), 400  # streams while a load that shares its prefix fails
SHARER = PREFIX + ids(96, 2003)  # that load's prompt; retried once the case is over
FILLERS, FILLER_TOKENS = [ids(1100, 2005), ids(1100, 2006)], 600  # two running streams holding most of the cache
BLOCKED = ids(1950, 2007)  # finds too few free blocks while both fillers run
# two streams holding decode's blocks until their clients go (900 tokens outlast a lease on any CPU seen here)
HOLDERS, HOLDER_TOKENS = [ids(1100, 2010), ids(1100, 2011)], 900
LATE = ids(1950, 2004)  # waits for blocks longer than LEASE_S
LOADED = ids(300, 2012)  # loads while its client goes away
KILLED = ids(300, 2013)  # loads while its prefill is killed
# Streamed on a frozen prefill, one per case: none is in prefill's prefix cache when its case thaws prefill.
STREAMED = {case: ids(1950, 2020 + i) for i, case in enumerate(("client_gone", "prefill_killed", "decode_killed"))}

# (name, prompt, max_tokens) the reference pair runs after tests/support/scenarios.RUNS, greedy with ignore_eos, in
# order, on a pair whose prefill chunks as the fault prefill does: each prompt meets the caches its case leaves, as
# the bytes (and so this random-weight model's tokens) follow how each block was computed. SHARER runs as the failed
# load's prefill leg (its prefix cached), then as the retry (prefill recomputes its last block, decode loads it).
FAULT_RUNS = [
    ("healthy", HEALTHY, HEALTHY_TOKENS),
    ("sharer", SHARER, MAX_TOKENS),
    ("sharer-retry", SHARER, MAX_TOKENS),
    ("late", LATE, MAX_TOKENS),
]


def wait_for(probe: Callable[[], T], ok: Callable[[T], bool], timeout_s: float, what: str) -> T:
    """Poll ``probe`` until ``ok`` holds; the last value is in the failure message."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s; last {value!r}")
        time.sleep(0.1)


def all_streaming(streams: list[Stream], decode: Server, offset: int, timeout_s: float, what: str) -> None:
    """Wait until every stream has a token. On failure the message says how each stream stands (tokens, error)
    and what decode's connector logged since ``offset``: a stream that never starts is a failed or stuck load."""
    try:
        wait_for(lambda: [len(s.tokens) for s in streams], all, timeout_s, what)
    except AssertionError as exc:
        states = [(len(s.tokens), s.finish_reason, s.error) for s in streams]
        log = decode.connector_lines(offset)
        raise AssertionError(f"{exc}\nstreams (tokens, finish, error): {states}\n{log}") from None


class Stream:
    """One streamed ``/v1/completions`` read on a thread. ``close`` drops the connection, as a client that goes
    away does; the server sees the disconnect and aborts the request."""

    def __init__(self, url: str, body: dict, timeout_s: float = 180) -> None:
        parts = urlsplit(url)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.closed = False
        self.done = threading.Event()
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
        self._body = json.dumps({**body, "stream": True}).encode()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self._conn.request("POST", "/v1/completions", self._body, {"content-type": "application/json"})
            resp = self._conn.getresponse()
            if resp.status != 200:
                self.error = f"HTTP {resp.status}: {resp.read()[:500]!r}"
                return
            while line := resp.readline():
                data = line.strip().removeprefix(b"data: ")
                if not data or data == b"[DONE]" or not line.startswith(b"data: "):
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    self.error = str(chunk["error"])[:500]
                    continue
                choice = chunk["choices"][0]
                self.tokens.extend(choice.get("token_ids") or [])
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if not self.closed:
                self.error = repr(exc)
        finally:
            self._conn.close()
            self.done.set()

    def close(self) -> None:
        """Shut the socket down (the server sees the client go); the reading thread, woken, closes the rest (a
        connection closed under a read in progress raises inside http.client)."""
        self.closed = True
        if self._conn.sock is not None:
            self._conn.sock.shutdown(socket.SHUT_RDWR)

    def result(self, timeout_s: float) -> Stream:
        assert self.done.wait(timeout_s), f"stream still open after {timeout_s:g} s ({len(self.tokens)} tokens)"
        return self


@contextmanager
def proxy(
    prefill: Server, decodes: list[Server], log_dir: Path, prefill_kv: tuple[str, int] | None = None
) -> Iterator[str]:
    """recipes/router/pd_proxy.py in a process of its own in front of one prefill and ``decodes`` (tried in that
    order first), streamed with ``prefill_kv`` (prefill's side channel); its URL."""
    port = free_port()
    cmd = [sys.executable, str(PROXY), "--prefill", prefill.url, "--decode", *(d.url for d in decodes)]
    cmd += ["--port", str(port), *(["--prefill-kv", f"{prefill_kv[0]}:{prefill_kv[1]}"] if prefill_kv else [])]
    with (log_dir / "pd_proxy.log").open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pd_proxy did not start ({proc.poll()}); see {log_dir}/pd_proxy.log") from exc
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def stream_legs(pair: FaultPair, model: str, prompt: list[int]) -> tuple[Stream, threading.Thread, dict]:
    """A streamed request on the fault pair, as pd_proxy --prefill-kv sends it: decode's leg (a ``Stream``) and
    prefill's (on a thread; its answer lands in the dict) at once, under one transfer id."""
    body = request(model, prompt, ignore_eos=True)
    transfer = uuid.uuid4().hex
    params = {"do_remote_prefill": True, "glm_pd_protocol": PROTOCOL_VERSION, "glm_pd_transfer_id": transfer,
              "remote_host": pair.kv[0], "remote_port": pair.kv[1]}  # fmt: skip
    answer: dict = {}

    def prefill_leg() -> None:
        leg = {"do_remote_decode": True, "glm_pd_transfer_id": transfer}
        try:
            answer.update(pair.prefill.complete({**body, "max_tokens": 1, "kv_transfer_params": leg}))
        except (OSError, http.client.HTTPException, ValueError) as exc:  # a killed prefill
            answer["error"] = repr(exc)

    leg = threading.Thread(target=prefill_leg, daemon=True)
    leg.start()
    return Stream(pair.decode.url, {**body, "kv_transfer_params": params}), leg, answer


@contextmanager
def streamed_on_frozen_prefill(
    pair: FaultPair, model: str, prompt: list[int], fresh: list[int]
) -> Iterator[tuple[Stream, dict, int]]:
    """A streamed request whose load waits on the fault prefill, frozen (SIGSTOP) before either leg was sent: both
    legs and decode's subscription wait in prefill's sockets, so the load cannot end while the caller acts (a race
    with prefill's compute, where prefill runs, is lost on a fast machine). A streamed request on ``fresh`` goes
    first, so decode knows that prefill by its address and holds a link to it. Yields decode's stream, prefill's
    answer (a dict its leg fills once prefill, thawed on exit unless the caller killed it, answers) and decode's
    log offset; on exit the leg is joined. Decode's load waits ``TIMEOUT_S`` on a silent prefill: it is seen
    waiting well within that."""
    first, first_leg, _ = stream_legs(pair, model, fresh)
    first.result(120)
    first_leg.join(120)
    assert first.finish_reason == "length", f"the first streamed request failed: {first.error}"
    offset = pair.decode.log_size()
    pair.prefill.signal(signal.SIGSTOP)
    leg: threading.Thread | None = None
    try:
        stream, leg, answer = stream_legs(pair, model, prompt)
        try:
            wait_for(pair.decode.scheduler_state, lambda s: s.get("waiting_deferred") == 1, 10, "its load runs")
        except AssertionError as exc:
            states = f"decode's leg: {len(stream.tokens)} tokens, finish {stream.finish_reason}, error {stream.error}"
            raise AssertionError(f"{exc}\n{states}\n{pair.decode.connector_lines(offset)}") from None
        yield stream, answer, offset
    finally:
        if pair.prefill.proc.poll() is None:
            pair.prefill.signal(signal.SIGCONT)
        if leg is not None:
            leg.join(120)


@contextmanager
def frozen_mid_load(
    prefill: Server, decode: Server, model: str, prompt: list[int], fresh: list[int], release: Callable[[], None]
) -> Iterator[tuple[Stream, int]]:
    """A request whose load waits in its claim on ``prefill``, frozen (SIGSTOP) so its side channel stops
    answering: yields the decode stream and decode's log offset; ``release`` (thaw or kill) runs on exit."""
    disaggregated(prefill, decode, model, fresh)  # the handshake is done: the load below is in its claim
    body = request(model, prompt, ignore_eos=True)
    params = prefill_leg(prefill, body)
    offset = decode.log_size()
    prefill.signal(signal.SIGSTOP)
    try:
        stream = Stream(decode.url, {**body, "kv_transfer_params": params})
        wait_for(decode.scheduler_state, lambda s: s.get("waiting_deferred") == 1, 10, "its load runs")
        time.sleep(1)
        yield stream, offset
    finally:
        release()


class FaultPair:
    """A prefill and a decode started for the fault cases. A case that killed one (or whose bug killed one) leaves
    it dead; ``ensure`` starts it again before the next case, so each case starts from serving engines."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.starts = {"prefill": 0, "decode": 0}
        self.servers = {role: self._start(role) for role in self.starts}
        self._wait()

    @property
    def prefill(self) -> Server:
        return self.servers["prefill"]

    @property
    def decode(self) -> Server:
        return self.servers["decode"]

    def _start(self, role: str) -> Server:
        self.starts[role] += 1
        name = f"fault-{role}-{self.starts[role]}"
        timing = {"lease_s": LEASE_S, "timeout_s": TIMEOUT_S, "streamed": True}
        if role == "prefill":
            self.kv = ("127.0.0.1", free_port())  # its side channel: a streamed request's decode leg names it
            side = {"side_channel_host": self.kv[0], "side_channel_port": self.kv[1]}
            config = glm_pd_config("kv_producer", **side, **timing)
            return Server(name, self.model, self.log_dir, "--kv-transfer-config", config,
                          "--max-num-batched-tokens", str(CHUNK_TOKENS),
                          env={"VLLM_CPU_OMP_THREADS_BIND": CORE["prefill"]})  # fmt: skip
        # The cases see a streamed load through vLLM's scheduler gauges, which it publishes once per step: a decode
        # step waiting for the load (``idle_wait_s``) would hide a park of a few hundred ms from them. Idle waits
        # on real engines: tests/e2e/test_vllm_engine.py (the default), benchmarks/stream_bench.py.
        config = glm_pd_config("kv_consumer", **timing, idle_wait_s=0.0)
        return Server(name, self.model, self.log_dir, "--kv-transfer-config", config, "--enable-prompt-tokens-details",
                      env={"VLLM_CPU_OMP_THREADS_BIND": CORE["decode"]},
                      kv_cache_bytes=KV_CACHE_TOKENS * TOKEN_BYTES)  # fmt: skip

    def _wait(self) -> None:
        deadline = time.monotonic() + START_S
        for server in self.servers.values():
            server.wait_ready(deadline)

    def ensure(self) -> None:
        dead = [role for role, server in self.servers.items() if not server.engine_alive()]
        for role in dead:
            self.servers[role].stop()
            self.servers[role] = self._start(role)
        if dead:
            self._wait()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()

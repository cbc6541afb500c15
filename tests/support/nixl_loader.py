"""Peer metadata blobs loaded through ``Transport.add_peer`` in child processes, one blob after another.

A damaged NIXL blob can kill the process that loads it inside UCX (SIGSEGV, SIGABRT on an assertion): the child
(``python -m tests.support.nixl_loader JOB``) says ``TRY i`` before each load and ``DONE {...}`` after it, so a
``TRY`` left without its ``DONE`` names the blob it died (or hung) on. The parent (``load_all``) records that blob's
fate and starts a new child at the next one.

Each blob meets a new prefill rank's agent (host caches registered) that has loaded nothing: a blob NIXL fails after
it took the connection info keeps that connection (NIXL 1.5.1; ``remove_remote_agent`` does not drop it), and every
later load under that agent name fails on it (NIXL_ERR_INVALID_PARAM) before parsing anything else.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import msgspec
import xxhash

from glm_pd_common.errors import GlmPdError
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.transport.base import Transport
from tests.support.lines import LineReader
from tests.support.services import endpoint
from tests.support.tiny_glm import TINY_GLM

SPEC = CacheSpec.create(ModelGeometry.from_config(TINY_GLM))


@dataclass(frozen=True)
class Outcome:
    """How loading blob ``index`` ended: ``loaded``; ``refused`` (a GlmPdError, ``error`` its class); ``raised``
    (any other exception); ``killed`` (``error``: the signal), ``exited`` (``error``: the code) or ``hung``."""

    index: int
    outcome: str
    error: str = ""
    message: str = ""
    library: int | None = None  # xxh3 of the bytes handed to the library (NIXL); None: it was handed none


def main() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash is expected here: no core file per blob
    job = json.loads(sys.argv[1])
    blobs: list[bytes] = msgspec.msgpack.decode(Path(job["blobs"]).read_bytes(), type=list[bytes])
    for index in range(job["start"], min(job["start"] + job["count"], len(blobs))):
        print(f"TRY {index}", flush=True)
        print(f"TRY {index}", file=sys.stderr, flush=True)  # what NIXL and UCX print next is this blob's
        transport = endpoint(SPEC, "prefill-0", 5.0)[1].transport  # a fresh agent per blob: see the module's doc
        with mock.patch.object(transport, "_add_peer", wraps=transport._add_peer) as library:
            how = _load(transport, blobs[index])
        transport.close()
        handed = xxhash.xxh3_64_intdigest(library.call_args.args[1]) if library.called else None
        print("DONE " + json.dumps(asdict(Outcome(index, *how, library=handed))), flush=True)


def _load(transport: Transport, blob: bytes) -> tuple[str, str, str]:
    """(outcome, error class, message) of loading ``blob``; a loaded peer is unloaded again at once."""
    try:
        transport.remove_peer(transport.add_peer(blob, []))
    except GlmPdError as exc:
        return "refused", type(exc).__name__, str(exc)[:300]
    except Exception as exc:
        return "raised", type(exc).__name__, str(exc)[:300]
    return "loaded", "", ""


def load_all(blobs: list[bytes], workdir: Path, *, per_child: int = 50, timeout_s: float = 60.0) -> list[Outcome]:
    """Every blob's outcome, in order: at most ``per_child`` loads per child, a new child after one dies."""
    path = workdir / "blobs.msgpack"
    path.write_bytes(msgspec.msgpack.encode(blobs))
    outcomes: list[Outcome] = []
    while len(outcomes) < len(blobs):
        outcomes += _child(path, len(outcomes), per_child, timeout_s, workdir / f"child-{len(outcomes)}.err")
    return outcomes


def _child(blobs: Path, start: int, count: int, timeout_s: float, errors: Path) -> list[Outcome]:
    """Loads from ``start`` in one child until ``count`` are done or it dies; a blob that hangs it past
    ``timeout_s`` is ``hung`` (the child killed). A child that dies before its first load is the harness's fault."""
    job = json.dumps({"blobs": str(blobs), "start": start, "count": count})
    with errors.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.nixl_loader", job],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=Path(__file__).parents[2],
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    lines = LineReader(proc.stdout)  # type: ignore[arg-type]  # PIPE: never None
    done: list[Outcome] = []
    trying: int | None = None
    try:
        while (line := lines.next_matching(lambda ln: ln.startswith(("TRY ", "DONE ")), timeout_s)) is not None:
            if line.startswith("TRY "):
                trying = int(line[4:])
            else:
                done.append(Outcome(**json.loads(line[5:])))
                trying = None
    except TimeoutError:
        proc.kill()
        proc.wait()
        if trying is None:
            raise RuntimeError(f"the loader child went silent outside any load: {_tail(errors)}") from None
        return [*done, Outcome(trying, "hung", "", f"no answer within {timeout_s:.0f} s: {_said(errors, trying)}")]
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the loader child did not exit after its last load: {_tail(errors)}") from None
    if trying is not None:
        how = ("killed", signal.Signals(-rc).name) if rc < 0 else ("exited", str(rc))
        return [*done, Outcome(trying, *how, _said(errors, trying))]
    if rc != 0 or not done:
        raise RuntimeError(f"the loader child failed outside any load (rc {rc}): {_tail(errors)}")
    return done


def _tail(path: Path, chars: int = 600) -> str:
    return path.read_text(errors="replace")[-chars:]


def _said(path: Path, index: int, chars: int = 600) -> str:
    """What the child wrote to stderr while loading blob ``index`` (NIXL's and UCX's last words)."""
    return path.read_text(errors="replace").rpartition(f"TRY {index}\n")[2][:chars]


if __name__ == "__main__":
    main()

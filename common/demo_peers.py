"""The two processes of ``glm-pd demo``: a prefill rank and a decode rank on 127.0.0.1.

Each walks the same core path the engine adapters use: regions from the spec, transport registration,
hello/fingerprint handshake, suffix pages, plan, lease claim, layer-by-layer pull, digest check, release
confirmation. Run as ``python -m glm_pd_common.demo_peers prefill|decode`` with a JSON job on stdin;
each prints its report as JSON lines marked ``GLMPD`` on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

from glm_pd_common import protocol
from glm_pd_common.checksum import mismatched_regions, page_digests, plan_digests, verify
from glm_pd_common.errors import GlmPdError
from glm_pd_common.fingerprint import PROTOCOL_VERSION, PeerShape
from glm_pd_common.geometry import ModelGeometry
from glm_pd_common.handoff import Handoff, HandoffState
from glm_pd_common.hostmem import HostCaches
from glm_pd_common.lease import LeaseTable
from glm_pd_common.pages import num_pages_for, suffix_pages
from glm_pd_common.peer import accept_hello, make_hello
from glm_pd_common.plan import TransferPlan, build_plan
from glm_pd_common.sidechannel import SideChannelClient, SideChannelServer
from glm_pd_common.spec import CacheSpec
from glm_pd_common.transport.base import TransportConfig, create_transport

SEED = 20261201
REQUEST_ID = "demo-0"


def _replace_geometry(spec: CacheSpec, **changes: Any) -> CacheSpec:
    return dataclasses.replace(spec, geometry=dataclasses.replace(spec.geometry, **changes))


# How ``--mismatch FIELD`` makes the prefill side differ in exactly that fingerprint field.
MISMATCHES = {
    "model_type": lambda s: _replace_geometry(s, model_type="deepseek_v32"),
    "full_indexer_layers": lambda s: _replace_geometry(
        s, full_indexer_layers=ModelGeometry.preset("glm-5").full_indexer_layers
    ),
    "mtp_layers": lambda s: _replace_geometry(s, num_mtp_layers=0),
    "cache_dtype": lambda s: CacheSpec.create(s.geometry, "fp8", s.indexer.scale_format),
    "indexer_scale_format": lambda s: CacheSpec.create(s.geometry, s.cache_dtype, "ue8m0x4"),
    "model_revision": lambda s: _replace_geometry(s, revision="prefill-rev"),
}


def job_spec(job: dict[str, Any], role: str) -> CacheSpec:
    spec = CacheSpec.create(ModelGeometry.preset(job["preset"]), job["kv_cache_dtype"], job["scale_format"])
    if role == "decode" and job.get("mismatch") == "model_revision":
        spec = _replace_geometry(spec, revision="decode-rev")
    if role == "prefill" and job.get("mismatch"):
        spec = MISMATCHES[job["mismatch"]](spec)
    return spec


def page_table(num_pages: int, pool_pages: int, allocator: str, seed: int) -> np.ndarray:
    if allocator == "contiguous":
        return np.arange(num_pages, dtype=np.int64)
    return np.random.default_rng(seed).permutation(pool_pages)[:num_pages].astype(np.int64)


def _caches(spec: CacheSpec, job: dict[str, Any], page_tokens: int, seed: int) -> tuple[HostCaches, np.ndarray]:
    pages = num_pages_for(job["tokens"], page_tokens)
    pool = pages if job["allocator"] == "contiguous" else pages + max(pages // 4, 2)
    return HostCaches(spec, page_tokens=page_tokens, num_pages=pool), page_table(pages, pool, job["allocator"], seed)


def _transport(job: dict[str, Any], name: str):
    return create_transport(
        name, TransportConfig(backend=job["transport"], allow_tcp=job["allow_tcp"], timeout_s=job["timeout_s"])
    )


MARK = "GLMPD "  # libraries log to stdout too; the reports are the lines carrying this mark


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def run_prefill(job: dict[str, Any]) -> int:
    spec = job_spec(job, "prefill")
    p_pt = job["prefill_page_tokens"]
    caches, table = _caches(spec, job, p_pt, seed=1)
    caches.write_tokens(table, 0, job["tokens"], seed=SEED)
    transport = _transport(job, "prefill-0")
    transport.register(caches.regions)
    server = SideChannelServer("127.0.0.1")
    leases = LeaseTable(ttl_s=job["lease_s"], transfer_ttl_s=job["timeout_s"])
    leases.grant(REQUEST_ID, table)
    # What vLLM's request_finished hands the router: enough for decode to find us and plan the pull.
    _emit(
        {
            "ready": True,
            "port": server.port,
            "request_id": REQUEST_ID,
            "num_tokens": job["tokens"],
            "page_table": table.tolist(),
            "engine_id": "prefill-0",
        }
    )
    shape = PeerShape(p_pt, 1, 0)
    deadline = time.monotonic() + job["timeout_s"]
    decode_id, plan, outcome = None, None, "timeout"
    try:
        while time.monotonic() < deadline:
            for _, payload in transport.notifs():
                msg = protocol.decode(payload)
                if isinstance(msg, protocol.Done) and msg.request_id == REQUEST_ID and decode_id is not None:
                    try:
                        leases.release(REQUEST_ID)
                        server.send(decode_id, protocol.Released(v=PROTOCOL_VERSION, request_id=REQUEST_ID))
                        outcome = "released"
                    except GlmPdError as exc:
                        server.send(
                            decode_id, protocol.Failed(v=PROTOCOL_VERSION, request_id=REQUEST_ID, reason=str(exc))
                        )
                        outcome = "lease expired"
            if outcome != "timeout":
                break
            try:
                ident, msg = server.recv(timeout_s=0.001)
            except GlmPdError:
                continue
            if isinstance(msg, protocol.Query):
                server.send(
                    ident,
                    make_hello("prefill-0", spec, shape, caches.regions, job["transport"], transport.agent_name, b""),
                )
            elif isinstance(msg, protocol.Hello):
                try:
                    peer = accept_hello(spec, msg, backend=job["transport"], role="decode", local_role="prefill")
                except GlmPdError as exc:
                    server.send(ident, protocol.Failed(v=PROTOCOL_VERSION, request_id="", reason=str(exc)))
                    outcome = "refused"
                    break
                transport.add_peer(peer.agent_metadata, peer.spans)
                decode_id, decode_peer = ident, peer
                server.send(
                    ident,
                    make_hello(
                        "prefill-0",
                        spec,
                        shape,
                        caches.regions,
                        job["transport"],
                        transport.agent_name,
                        transport.metadata(),
                    ),
                )
            elif isinstance(msg, protocol.Abort) and ident == decode_id:
                leases.drop(msg.request_id)
                outcome = "aborted"
                break
            elif isinstance(msg, protocol.DigestQuery) and ident == decode_id and plan is not None:
                wanted = [i for i in msg.region_indices if 0 <= i < len(plan.entries)][:8]
                server.send(
                    ident,
                    protocol.PageDigests(
                        v=PROTOCOL_VERSION,
                        request_id=msg.request_id,
                        pages={i: page_digests(plan, i, "src") for i in wanted},
                    ),
                )
            elif isinstance(msg, protocol.TransferRequest) and ident == decode_id:
                try:
                    lease = leases.claim(msg.request_id)
                    own = suffix_pages(
                        lease.pages, msg.num_tokens, msg.prefix_tokens, p_pt, align_tokens=decode_peer.shape.page_tokens
                    )
                    if not np.array_equal(own, np.asarray(msg.src_pages)):
                        raise GlmPdError("decode's source pages are not the pages this request holds")
                    plan = build_plan(
                        caches.regions,
                        decode_peer.regions,
                        own,
                        np.asarray(msg.dst_pages),
                        num_tokens=msg.num_tokens,
                        prefix_tokens=msg.prefix_tokens,
                    )
                    digests = plan_digests(plan, "src") if msg.verify else None
                    server.send(
                        ident,
                        protocol.Claimed(
                            v=PROTOCOL_VERSION,
                            request_id=msg.request_id,
                            lease_s=job["timeout_s"],
                            num_bytes=plan.num_bytes,
                            digests=digests,
                        ),
                    )
                except GlmPdError as exc:
                    server.send(ident, protocol.Failed(v=PROTOCOL_VERSION, request_id=msg.request_id, reason=str(exc)))
                    leases.drop(msg.request_id)
                    outcome = "failed"
                    break
    finally:
        _emit(
            {
                "role": "prefill",
                "outcome": outcome,
                "leases_left": len(leases),
                "transport": dataclasses.asdict(transport.info()),
            }
        )
        transport.close()
        server.close()
    return 0 if outcome in ("released", "refused", "aborted") else 1


def memcpy_gbps(num_bytes: int) -> float:
    """Single-thread memcpy ceiling of this machine, measured now on ``num_bytes`` (capped at 512 MiB)."""
    n = int(min(max(num_bytes, 1 << 20), 512 << 20))
    src, dst = np.ones(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def _verify_naming_page(client: SideChannelClient, plan: TransferPlan, digests: list[int], timeout: float) -> None:
    """Check region digests; on a mismatch, fetch prefill's page digests of those regions to name the page."""
    bad = mismatched_regions(plan, digests)
    if not bad:
        return
    client.send(protocol.DigestQuery(v=PROTOCOL_VERSION, request_id=REQUEST_ID, region_indices=bad))
    reply = client.recv(timeout)
    pages = reply.pages if isinstance(reply, protocol.PageDigests) else None
    verify(plan, digests, remote_pages=pages)


def run_decode(job: dict[str, Any], params: dict[str, Any]) -> int:
    handoff = Handoff(REQUEST_ID)
    result: dict[str, Any] = {"role": "decode", "ok": False}
    spec = job_spec(job, "decode")
    d_pt, n, prefix = job["decode_page_tokens"], params["num_tokens"], job["prefix_tokens"]
    caches, table = _caches(spec, job, d_pt, seed=2)
    caches.write_tokens(table, 0, prefix, seed=SEED)  # the prefix-cache hit decode already holds
    transport = _transport(job, "decode-0")
    transport.register(caches.regions)
    client = SideChannelClient("127.0.0.1", params["port"])
    timeout = job["timeout_s"]
    try:
        client.send(
            make_hello(
                "decode-0",
                spec,
                PeerShape(d_pt, 1, 0),
                caches.regions,
                job["transport"],
                transport.agent_name,
                transport.metadata(),
            )
        )
        reply = client.recv(timeout)
        if isinstance(reply, protocol.Failed):
            raise GlmPdError(f"prefill refused the handshake: {reply.reason}")
        assert isinstance(reply, protocol.Hello)
        peer = accept_hello(spec, reply, backend=job["transport"], role="prefill", local_role="decode")
        agent = transport.add_peer(peer.agent_metadata, peer.spans)
        handoff.advance(HandoffState.WAITING_FOR_INPUT)

        p_pt = peer.shape.page_tokens
        src = suffix_pages(np.asarray(params["page_table"]), n, prefix, p_pt, align_tokens=d_pt)
        dst = suffix_pages(table, n, prefix, d_pt, align_tokens=d_pt)
        t0 = time.perf_counter()
        plan = build_plan(peer.regions, caches.regions, src, dst, num_tokens=n, prefix_tokens=prefix)
        plan_ms = (time.perf_counter() - t0) * 1e3
        client.send(
            protocol.TransferRequest(
                v=PROTOCOL_VERSION,
                request_id=REQUEST_ID,
                num_tokens=n,
                prefix_tokens=prefix,
                src_pages=src.tolist(),
                dst_pages=dst.tolist(),
                dst_engine_id="decode-0",
                verify=job["verify"],
            )
        )
        claim = client.recv(timeout)
        if isinstance(claim, protocol.Failed):
            raise GlmPdError(f"prefill refused the transfer: {claim.reason}")
        assert isinstance(claim, protocol.Claimed)

        handoff.advance(HandoffState.TRANSFERRING)
        t0 = time.perf_counter()
        posted = [transport.post_plan(agent, plan, "READ", entries=entries) for _, entries in plan.layers()]
        for xfer in posted:
            transport.wait(xfer, timeout)
            transport.release(xfer)
        seconds = time.perf_counter() - t0
        if job.get("inject_corruption"):
            last = plan.entries[-1]  # the MTP layer's indexer: the cache a silent bug would lose first
            caches.buffers[last.dst.key][int(plan.dst_pages[-1]), -1] ^= 0xFF
        if claim.digests is not None:
            _verify_naming_page(client, plan, claim.digests, timeout)
        transport.send_notif(
            agent, protocol.encode(protocol.Done(v=PROTOCOL_VERSION, request_id=REQUEST_ID, num_bytes=plan.num_bytes))
        )
        confirm = client.recv(timeout)
        if not isinstance(confirm, protocol.Released):
            raise GlmPdError(f"prefill did not confirm the pages were held: {getattr(confirm, 'reason', confirm)}")
        bad = caches.mismatched_tokens(table, 0, n, seed=SEED)
        if bad:
            raise GlmPdError("decode pages differ from prefill's tokens: " + "; ".join(bad[:5]))
        handoff.advance(HandoffState.SUCCESS)
        by_kind = plan.bytes_by_kind()
        result.update(
            ok=True,
            seconds=seconds,
            gbps=plan.num_bytes / seconds / 1e9,
            memcpy_gbps=memcpy_gbps(plan.num_bytes),
            bytes={**by_kind, "total": plan.num_bytes},
            runs=plan.num_runs,
            runs_by_kind=plan.runs_by_kind(),
            pages={"prefill": int(src.size), "decode": int(dst.size)},
            posted_batches=len(posted),
            regions=len(plan.entries),
            plan_ms=plan_ms,
            verified_digests=claim.digests is not None,
            prefix_bytes_kept=sum(r.page_format.bytes_per_token for r in caches.regions) * prefix,
        )
    except GlmPdError as exc:
        handoff.fail(str(exc))
        result["error"] = str(exc)
        # Tell prefill, so it frees the pages now instead of at lease expiry.
        client.send(protocol.Abort(v=PROTOCOL_VERSION, request_id=REQUEST_ID, reason=str(exc)[:500]))
    finally:
        result["states"] = handoff.states
        result["transport"] = dataclasses.asdict(transport.info())
        _emit(result)
        transport.close()
        client.close()
    return 0 if result["ok"] else 1


def main() -> int:
    role = sys.argv[1]
    lines = sys.stdin.read().splitlines()
    job = json.loads(lines[0])
    try:
        if role == "prefill":
            return run_prefill(job)
        return run_decode(job, json.loads(lines[1]))
    except GlmPdError as exc:  # start-up refusals (TCP without allow_tcp, bad spec): one clear report
        _emit({"role": role, "ok": False, "error": str(exc), "states": []})
        return 2


if __name__ == "__main__":
    sys.exit(main())

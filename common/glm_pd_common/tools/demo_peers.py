"""The two processes of ``glm-pd demo``: a prefill rank and a decode rank on 127.0.0.1.

Each runs the same engine-free services the engine adapters run (``PrefillService``, ``DecodeService``):
regions from the spec, transport registration, hello/fingerprint handshake, suffix pages, plan, lease
claim, pull, digest check, release confirmation.
Run as ``python -m glm_pd_common.tools.demo_peers prefill|decode`` with a JSON job on stdin;
each prints its report as JSON lines marked ``GLMPD`` on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from typing import Any

import numpy as np

from glm_pd_common.errors import GlmPdError
from glm_pd_common.handoff.decode.service import DecodeService, LoadJob, LoadResult, RemotePrefill
from glm_pd_common.handoff.faults import FaultPoint
from glm_pd_common.handoff.prefill.service import PrefillService
from glm_pd_common.handoff.wire.handshake import Endpoint
from glm_pd_common.handoff.wire.trust import Trust
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.layout.regions import Region
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.cuda_driver import CudaDevice
from glm_pd_common.tools.demo_staging import demo_memory
from glm_pd_common.tools.devicemem import DeviceCaches
from glm_pd_common.tools.hostmem import HostCaches, memcpy_gbps
from glm_pd_common.transport.base import TransportConfig
from glm_pd_common.transport.factory import create_transport

SEED = 20261201  # prefill's content for every token
DECODE_PREFIX_SEED = SEED + 1  # decode's prefix hit holds other bytes, so a read that strays into it shows
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
    "cache_dtype": lambda s: CacheSpec.create(s.geometry, "fp8_raw", s.indexer.scale_format),
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


def _caches(
    spec: CacheSpec, job: dict[str, Any], page_tokens: int, seed: int, device: CudaDevice | None
) -> tuple[HostCaches, np.ndarray]:
    """One side's caches (in host memory, or on ``device``) and its request's page table."""
    pages = num_pages_for(job["tokens"], page_tokens)
    pool = pages if job["allocator"] == "contiguous" else pages + max(pages // 4, 2)
    table = page_table(pages, pool, job["allocator"], seed)
    if device is None:
        return HostCaches(spec, page_tokens=page_tokens, num_pages=pool), table
    return DeviceCaches(spec, page_tokens=page_tokens, num_pages=pool, device=device), table


MARK = "GLMPD "  # libraries log to stdout too; the reports are the lines carrying this mark


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _endpoint(job: dict[str, Any], role: str, page_tokens: int) -> tuple[HostCaches, np.ndarray, Endpoint]:
    """One side's caches (page table drawn per role), its registered transport, and its endpoint."""
    spec = job_spec(job, role)
    device = None if job["device"] is None else CudaDevice(job["device"])
    caches, table = _caches(spec, job, page_tokens, 1 if role == "prefill" else 2, device)
    config = TransportConfig(
        backend=job["transport"],
        allow_tcp=job["allow_tcp"],
        timeout_s=job["timeout_s"],
        posts="READ" if role == "decode" else None,  # decode pulls: the path UCX picks for it is observed on a GPU
    )
    transport = create_transport(f"{role}-0", config)
    transport.register(caches.regions)
    trust = Trust.from_settings(job["credential"], insecure=False)
    shape = PeerShape(page_tokens, 1, 0)
    staging, memory = demo_memory(job, transport, caches.regions, device)
    local = Endpoint(f"{role}-0", spec, caches.regions, transport, shape, memory=memory, trust=trust, staging=staging)
    if device is not None:  # every glm-pd thread on the device's context
        local = dataclasses.replace(local, on_thread=device.make_current)
    return caches, table, local


def run_prefill(job: dict[str, Any]) -> int:
    caches, table, local = _endpoint(job, "prefill", job["prefill_page_tokens"])
    caches.write_tokens(table, 0, job["tokens"], seed=SEED)
    transport = local.transport
    service = PrefillService(
        local,
        host="127.0.0.1",
        port=0,
        lease_s=job["lease_s"],
        timeout_s=job["timeout_s"],
    )
    service.grant(REQUEST_ID, table)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    # What vLLM's request_finished hands the router: enough for decode to find us and plan the pull.
    _emit(
        {
            "ready": True,
            "port": service.port,
            "request_id": REQUEST_ID,
            "num_tokens": job["tokens"],
            "page_table": table.tolist(),
            "engine_id": "prefill-0",
        }
    )
    outcome = "timeout"
    deadline = time.monotonic() + job["lease_s"] + job["timeout_s"]
    try:
        while time.monotonic() < deadline and outcome == "timeout":
            for done in service.finished():
                outcome = done.outcome
            time.sleep(0.005)
    finally:
        service.close()
        _emit({"role": "prefill", "outcome": outcome, "transport": dataclasses.asdict(transport.info())})
        transport.close()
    return 0 if outcome in ("released", "aborted") else 1


class CorruptLanded:
    """``--inject-corruption``: one landed byte inverted before the check, as a faulty link would leave it, to show
    the check naming the region and page. The demo's only fault; every other point passes."""

    def __init__(self, caches: HostCaches) -> None:
        self.caches = caches

    def at(self, key: str, point: FaultPoint) -> None:
        pass

    def landed(self, key: str, region: Region, offset: int) -> None:
        self.caches.flip(region, offset)

    def confirmations(self, key: str) -> int:
        return 1


def run_decode(job: dict[str, Any], params: dict[str, Any]) -> int:
    n, prefix = params["num_tokens"], job["prefix_tokens"]
    caches, table, local = _endpoint(job, "decode", job["decode_page_tokens"])
    caches.write_tokens(table, 0, prefix, seed=DECODE_PREFIX_SEED)  # the prefix-cache hit decode already holds
    transport = local.transport
    service = DecodeService(
        local,
        timeout_s=job["timeout_s"],
        verify_digests=job["verify"],
        faults=CorruptLanded(caches) if job.get("inject_corruption") else None,
    )
    remote = RemotePrefill(params["engine_id"], "127.0.0.1", params["port"], 1)
    service.submit(
        LoadJob(
            REQUEST_ID,
            remote,
            np.asarray(params["page_table"]),
            table,
            n,
            prefix,
        )
    )
    deadline = time.monotonic() + 4 * job["timeout_s"]
    results: list[LoadResult] = []
    while not results and time.monotonic() < deadline:
        results = service.results()
        time.sleep(0.005)
    service.close()
    load = results[0] if results else LoadResult(REQUEST_ID, False, "no result within the time bound")
    report: dict[str, Any] = {"role": "decode", "ok": load.ok, "states": load.states}
    if load.ok:
        # Measured, not inferred: decode's prefix still holds its own bytes, and the suffix equals prefill's.
        prefix_bytes = sum(r.page_format.bytes_per_token for r in caches.regions) * prefix
        kept = caches.equal_bytes(table, 0, prefix, seed=DECODE_PREFIX_SEED)
        bad = caches.mismatched_tokens(table, prefix, n, seed=SEED)
        report["ok"] = not bad and kept == prefix_bytes
        if bad:
            report["error"] = "decode pages differ from prefill's tokens: " + "; ".join(bad[:5])
        elif kept != prefix_bytes:
            report["error"] = f"the load wrote into decode's prefix: {prefix_bytes - kept} of {prefix_bytes} B changed"
        total = sum(load.bytes_by_kind.values())
        report.update(
            seconds=load.seconds,
            gbps=total / load.seconds / 1e9,
            memcpy_gbps=memcpy_gbps(total),
            bytes={**load.bytes_by_kind, "total": total},
            runs=load.runs,
            runs_by_kind=load.runs_by_kind,
            pages=load.pages,
            posted_batches=load.batches,
            staged_bytes=load.staged_bytes,
            staging=None if local.staging is None else {"slot_bytes": local.staging.slot_bytes, "mode": job["staging"]},
            regions=len(caches.regions),
            plan_ms=load.plan_ms,
            verified_digests=job["verify"],
            prefix_bytes_kept=kept,
            suffix_tokens_checked=n - prefix,
        )
    else:
        report["error"] = load.reason
    report["transport"] = dataclasses.asdict(transport.info())
    _emit(report)
    transport.close()
    return 0 if report["ok"] else 1


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

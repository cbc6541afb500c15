"""How close glm-pd's service path gets to raw NIXL on the same bytes, pull and streamed, and what authentication
costs, in one run.

One GLM-5.3 request (``--tokens``, shuffled page tables, 64-token pages) between a prefill and a decode NIXL agent
on loopback, with the services between them, authenticated with a deployment credential (the bulk bytes never
pass the side channel: the per-byte figures are authentication's too). Each repetition runs three cases, in an
order that rotates from one repetition to the next (no case always runs first, or always right after another's
copy), each after the same pause:
- ``raw``: the whole plan posted by decode's transport as one batch and waited for (the transport's best case);
- ``pull``: a decode load through ``DecodeService`` against ``PrefillService`` (verification off): the figure is
  the load's own read time (posting every batch and waiting), bytes from what the transport reported done;
- ``streamed``: the same request streamed in ``--chunks`` announcements 1 ms apart (faster than the link drains
  them), then the lease: the time from the first announcement to the last byte read, so what differs from pull
  is the posting (a batch per announcement), not prefill's compute.
The median of each, and of its ratio to the same repetition's raw (a shared host's speed drifts between
repetitions; within one it moves all three alike).

Authentication's cost is on each new side-channel connection: ``--handshakes`` times, alternating which goes first,
a new decode agent's first contact with a prefill until its handshake is accepted (CURVE and ZAP where a credential
is set, both hellos checked, each side loading the other's transport metadata), against two prefills alike but
for their trust: ``open`` (no credential) and ``credential``; medians, and the median of open's time over the same
repetition's credential. Prints a table (``of base``: raw's time over this case's, or open's over credential's),
writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.emit import emit_rows
from glm_pd_common.handoff.decode.links import PrefillLinks
from glm_pd_common.handoff.decode.service import DecodeService, LoadJob, LoadResult, RemotePrefill
from glm_pd_common.handoff.prefill.service import PrefillService
from glm_pd_common.handoff.wire.handshake import Endpoint
from glm_pd_common.handoff.wire.trust import Trust, load_credential, make_credential
from glm_pd_common.layout.fingerprint import PeerShape
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.base import TransportConfig
from glm_pd_common.transport.factory import create_transport

SPEC = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
PAGE_TOKENS = 64
SETTLE_S = 0.3  # before each case: a streamed load subscribes meanwhile, the others get the same pause
HANDSHAKE_PAGES = 4  # the handshake cases' caches: a hello carries their addresses, never their pages


def side(name: str, caches: HostCaches, trust: Trust) -> Endpoint:
    transport = create_transport(name, TransportConfig(allow_tcp=True, timeout_s=120))
    transport.register(caches.regions)
    return Endpoint(name, SPEC, caches.regions, transport, PeerShape(PAGE_TOKENS, 1, 0), trust=trust)


def first_contact(local: Endpoint, remote: RemotePrefill) -> float:
    """Seconds from ``local``'s (a new decode agent's) first contact with ``remote`` to its accepted handshake."""

    def progress() -> None:  # prefill's load of our metadata needs our transport's progress, as in a real load
        local.transport.notifs()

    links = PrefillLinks(local, timeout_s=60, progress=progress)
    t0 = time.perf_counter()
    links.get(remote, 0)
    took = time.perf_counter() - t0
    links.close()
    return took


def handshakes(trusts: dict[str, Trust], repeats: int) -> dict[str, list[float]]:
    """``first_contact`` with a prefill of each trust, ``repeats`` times (after one warm-up), alternating which
    goes first. Every decode agent lives until the prefills are gone: one that vanished first would leave them
    retrying a connection to it meanwhile (UCX), on the cases that follow."""
    caches = HostCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=HANDSHAKE_PAGES)
    prefills = {
        name: PrefillService(
            side(f"hs-prefill-{name}", caches, trust), host="127.0.0.1", port=0, lease_s=60, timeout_s=60
        )
        for name, trust in trusts.items()
    }
    decodes: list[Endpoint] = []
    seconds: dict[str, list[float]] = {name: [] for name in trusts}
    try:
        for rep in range(repeats + 1):
            for name in list(trusts)[:: 1 if rep % 2 else -1]:
                decodes.append(side(f"hs-decode-{name}-{rep}", caches, trusts[name]))
                remote = RemotePrefill(f"hs-prefill-{name}", "127.0.0.1", prefills[name].port, 1)
                took = first_contact(decodes[-1], remote)
                if rep:
                    seconds[name].append(took)
    finally:
        for prefill in prefills.values():
            prefill.close()
            prefill.local.transport.close()
        prefills.clear()  # their agents go first
        for decode in decodes:
            decode.transport.close()
    return seconds


def collect(decode: DecodeService) -> LoadResult:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        results = decode.results()
        if results:
            return results[0]
        time.sleep(0.001)
    raise SystemExit("no load result within 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--handshakes", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/posting_bench.json")
    args = parser.parse_args()
    pages = num_pages_for(args.tokens, PAGE_TOKENS)
    rng = np.random.default_rng(7)
    p_table, d_table = rng.permutation(2 * pages)[:pages], rng.permutation(2 * pages)[:pages]
    with tempfile.TemporaryDirectory() as keys:
        trusts = {"open": Trust(), "credential": Trust(load_credential(str(make_credential(Path(keys), "bench"))))}
    handshake_s = handshakes(trusts, args.handshakes)
    p_caches = HostCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=2 * pages)
    d_caches = HostCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=2 * pages)
    p_end, d_end = side("prefill", p_caches, trusts["credential"]), side("decode", d_caches, trusts["credential"])
    p_caches.write_tokens(p_table, 0, args.tokens, seed=1)
    prefill = PrefillService(p_end, host="127.0.0.1", port=0, lease_s=60, timeout_s=60, streamed=True)
    decode = DecodeService(d_end, timeout_s=60, verify_digests=False)
    where = RemotePrefill("prefill", "127.0.0.1", prefill.port, 1)
    plan = build_plan(p_end.regions, d_end.regions, p_table, d_table, num_tokens=args.tokens, prefix_tokens=0)
    seconds: dict[str, list[float]] = {"raw": [], "pull": [], "streamed": []}
    batches: dict[str, int] = {"raw": 1}
    moved: dict[str, int] = {"raw": plan.num_bytes}
    step = -(-pages // args.chunks)

    def raw(rep: int) -> float:
        time.sleep(SETTLE_S)
        agent = d_end.transport.remote_peers()[0]
        t0 = time.perf_counter()
        xfer = d_end.transport.post_plan(agent, plan, "READ")
        d_end.transport.wait(xfer)
        took = time.perf_counter() - t0
        d_end.transport.release(xfer)
        return took

    def pull(rep: int) -> float:
        prefill.grant(f"pull-{rep}", p_table)
        time.sleep(SETTLE_S)
        decode.submit(LoadJob(f"pull-{rep}", where, p_table, d_table, args.tokens, 0))
        return counted("pull", collect(decode)).seconds

    def streamed(rep: int) -> float:
        tid = f"stream-{rep}"
        prefill.open_stream(tid, args.tokens)
        stream_where = RemotePrefill(where.address, "127.0.0.1", prefill.port, 0)
        job = LoadJob(tid, stream_where, np.empty(0, np.int64), d_table, args.tokens, 0, stream_id=tid)
        decode.submit(job)
        time.sleep(SETTLE_S)  # subscribed
        announced = time.monotonic()
        for first in range(0, pages, step):
            upto = min((first + step) * PAGE_TOKENS, args.tokens)
            prefill.advance_stream(tid, p_table[first : first + step], upto)
            time.sleep(0.001)  # one announcement each (a grant in the same service turn would cover them)
        prefill.grant_stream(f"{tid}#0", tid, p_table, args.tokens)
        phases = counted("streamed", collect(decode)).phases  # seconds in each phase since submission, in order
        return job.submitted_at + sum(v for k, v in phases.items() if k != "release") - announced

    def counted(name: str, result: LoadResult) -> LoadResult:
        if not result.ok:
            raise SystemExit(f"a {name} load failed: {result.reason}")
        batches[name], moved[name] = result.batches, sum(result.bytes_by_kind.values())
        return result

    cases = [("pull", pull), ("streamed", streamed), ("raw", raw)]  # pull first: the warm-up connects
    try:
        for rep in range(args.repeats + 1):  # the first is a warm-up (handshake, UCX connection set-up)
            for name, case in cases[rep % 3 :] + cases[: rep % 3]:  # each case takes each place in turn
                took = case(rep)
                if rep:
                    seconds[name].append(took)
        wrong = d_caches.mismatched_tokens(d_table, 0, args.tokens, seed=1)
        if wrong:
            raise SystemExit(f"bytes differ after the loads: {wrong[:3]}")
    finally:
        decode.close()
        prefill.close()
        d_end.transport.close()
        p_end.transport.close()
    rows = [
        {
            "case": name,
            "trust": "credential",
            "tokens": args.tokens,
            "bytes": moved[name],
            "batches": batches[name],
            "s_median": statistics.median(values),
            "gbps_median": moved[name] / statistics.median(values) / 1e9,
            "of_raw": statistics.median(raw / v for raw, v in zip(seconds["raw"], values, strict=True)),
            "s_each": values,
        }
        for name, values in seconds.items()
    ] + [
        {
            "case": "handshake",
            "trust": name,
            "s_median": statistics.median(values),
            "of_open": statistics.median(o / v for o, v in zip(handshake_s["open"], values, strict=True)),
            "s_each": values,
        }
        for name, values in handshake_s.items()
    ]
    emit_rows(
        rows,
        args.out,
        as_json=args.json,
        header=f"{'case':>9} {'trust':>10} {'batches':>8} {'MB':>8} {'ms':>9} {'GB/s':>7} {'of base':>7}",
        line=table_line,
    )


def table_line(r: dict) -> str:
    """A transfer case (its base: raw) or a handshake (its base: the open one)."""
    if r["case"] == "handshake":
        blank = ""
        return (
            f"{'handshake':>9} {r['trust']:>10} {blank:>17} {r['s_median'] * 1e3:>9.2f} {blank:>7} {r['of_open']:>7.0%}"
        )
    return (
        f"{r['case']:>9} {r['trust']:>10} {r['batches']:>8} {r['bytes'] / 1e6:>8.1f} {r['s_median'] * 1e3:>9.1f} "
        f"{r['gbps_median']:>7.2f} {r['of_raw']:>7.0%}"
    )


if __name__ == "__main__":
    main()

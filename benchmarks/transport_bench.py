"""The same GLM-5.3 handoff bytes moved four ways, per transport, beside this machine's memcpy ceiling.

- ``one_run``: one descriptor over a flat buffer of the same size (the transport's best case);
- ``coalesced_fragmented``: a real plan over page tables made of short contiguous extents in random order
  (what a long-running engine's free list gives), coalesced;
- ``coalesced_shuffled``: a real plan over fully shuffled page tables, coalesced (little can merge);
- ``per_page``: one descriptor per page per region (what a per-block planner posts).

Decode (this process) READs from a prefill peer process over loopback. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np

from benchmarks.emit import emit_rows
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.layout.plan import TransferPlan, build_plan
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.flat import FLAT_LAYER_ID, flat_region
from glm_pd_common.tools.hostmem import HostCaches, memcpy_gbps
from glm_pd_common.transport.base import Transport, TransportConfig
from glm_pd_common.transport.factory import create_transport
from tests.support.peerproc import PeerProcess

SPEC = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
PAGE_TOKENS = 64


def fragmented(num_pages: int, pool: int, rng: np.random.Generator) -> np.ndarray:
    """Extents of 1..16 contiguous pages, in random order, drawn from a pool of ``pool`` pages."""
    edges = np.cumsum(rng.integers(1, 17, size=pool))
    edges = np.concatenate(([0], edges[edges < pool], [pool]))
    extents = [np.arange(a, b) for a, b in itertools.pairwise(edges)]
    order = rng.permutation(len(extents))
    return np.concatenate([extents[i] for i in order])[:num_pages]


def timed(
    transport: Transport, agent: str, local: np.ndarray, remote: np.ndarray, lens: np.ndarray, repeats: int
) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        xfer = transport.post(agent, "READ", local, remote, lens)
        transport.wait(xfer)
        out.append(time.perf_counter() - t0)
        transport.release(xfer)
    return out


def per_page_runs(plan: TransferPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, dst, lens = [], [], []
    for e in plan.entries:
        src.append(e.src.base_addr + plan.src_pages * e.src.page_stride)
        dst.append(e.dst.base_addr + plan.dst_pages * e.dst.page_stride)
        lens.append(np.full(plan.src_pages.size, e.src.page_bytes, dtype=np.int64))
    return np.concatenate(src), np.concatenate(dst), np.concatenate(lens)


def bench_backend(backend: str, tokens: int, repeats: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    pages = num_pages_for(tokens, PAGE_TOKENS)
    pool = pages * 2
    tables = {
        "fragmented": (fragmented(pages, pool, rng), fragmented(pages, pool, rng)),
        "shuffled": (rng.permutation(pool)[:pages], rng.permutation(pool)[:pages]),
    }
    nbytes = HostCaches.bytes_needed(SPEC, page_tokens=PAGE_TOKENS, num_pages=pages)
    rows = []
    for layout, (p_table, d_table) in tables.items():
        peer = PeerProcess(
            {
                "backend": backend,
                "page_tokens": PAGE_TOKENS,
                "num_pages": pool,
                "table": p_table.tolist(),
                "tokens": tokens,
                "fill": True,
                "seed": 1,
                "flat_bytes": nbytes if layout == "fragmented" else 0,
                "timeout_s": 120,
            }
        )
        local = HostCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=pool)
        regions = list(local.regions)
        flat = np.zeros(nbytes, dtype=np.uint8) if layout == "fragmented" else None
        if flat is not None:
            flat.fill(0)
            regions.append(flat_region(flat))
        transport = create_transport("bench", TransportConfig(backend=backend, allow_tcp=True, timeout_s=120))
        transport.register(regions)
        agent = transport.add_peer(peer.metadata, peer.spans)
        peer.introduce(transport.metadata(), regions)
        src_regions = peer.cache_regions()
        plan = build_plan(src_regions, local.regions, p_table, d_table, num_tokens=tokens, prefix_tokens=0)
        cases = {f"coalesced_{layout}": plan.absolute_runs()}
        if flat is not None:
            remote_flat = next(base for _, lay, base, _ in peer.announced if lay == FLAT_LAYER_ID)
            cases["one_run"] = (np.array([remote_flat]), np.array([flat.ctypes.data]), np.array([plan.num_bytes]))
            cases["per_page"] = per_page_runs(plan)
        for case, (src, dst, lens) in cases.items():
            seconds = timed(transport, agent, dst, src, lens, repeats)
            rows.append(
                {
                    "transport": backend,
                    "case": case,
                    "tokens": tokens,
                    "bytes": int(lens.sum()),
                    "runs": int(lens.size),
                    "s_median": statistics.median(seconds),
                    "gbps_median": int(lens.sum()) / statistics.median(seconds) / 1e9,
                }
            )
        if layout == "fragmented":
            mismatched = local.mismatched_tokens(d_table, 0, tokens, seed=1)
            if mismatched:
                raise SystemExit(f"{backend}: bytes differ after the transfer: {mismatched[:3]}")
        transport.close()
        peer.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", default="nixl,mooncake")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/transport_bench.json")
    args = parser.parse_args()
    rows = []
    for backend in args.transports.split(","):
        rows += bench_backend(backend, args.tokens, args.repeats, seed=7)
    nbytes, gbps = rows[0]["bytes"], memcpy_gbps(rows[0]["bytes"], args.repeats)
    rows.append(
        {
            "transport": "memcpy",
            "case": "one_run",
            "bytes": nbytes,
            "runs": 1,
            "s_median": nbytes / gbps / 1e9,
            "gbps_median": gbps,
        }
    )
    header = f"{'transport':>9} {'case':>22} {'runs':>8} {'MB':>8} {'ms':>9} {'GB/s':>7}"
    emit_rows(
        rows,
        args.out,
        as_json=args.json,
        header=header,
        line=lambda r: (
            f"{r['transport']:>9} {r['case']:>22} {r['runs']:>8,} {r['bytes'] / 1e6:>8.1f} "
            f"{r['s_median'] * 1e3:>9.1f} {r['gbps_median']:>7.2f}"
        ),
    )


if __name__ == "__main__":
    main()

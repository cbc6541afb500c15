"""Human-readable renderings of the core's plain-value results."""

from __future__ import annotations

from glm_pd_common.layout.shards import Sharding, describe


def human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def human_seconds(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s < 1 else f"{s:,.3f} s"


def print_table(rows: list[tuple[str, str]], title: str) -> None:
    width = max(len(k) for k, _ in rows)
    print(title)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def cache_dtype_line(a: dict) -> str:
    """What the engine allocates for the cache dtype named, and what other attention backends allocate instead."""
    default = a["main_rows_by_backend"]["default"]
    line = f"{a['engine']} {a['kv_cache_dtype']}: {default['format']} rows, {default['row_bytes']:,} B/token/layer"
    others: dict[tuple[str, int], list[str]] = {}
    for backend, row in a["main_rows_by_backend"].items():
        if row != default:
            others.setdefault((row["format"], row["row_bytes"]), []).append(backend)
    for (name, nbytes), backends in sorted(others.items()):
        line += f"; {name} ({nbytes:,} B) under DSA backend {' or '.join(sorted(backends))}"
    return line


def scattered_note(a: dict) -> str:
    """More runs than pages even with contiguous pages: the two sides' token shards do not line up."""
    if a["runs"]["contiguous"] <= a["regions_per_rank"] * a["suffix_pages"]:
        return ""
    return (
        " (scattered: decode ranks hold tokens that are not whole prefill pages; shard both sides alike, "
        "or interleave whole pages)"
    )


def print_account(a: dict) -> None:
    bpt, req, moved = a["bytes_per_token"], a["bytes_per_request"], a["bytes_moved_per_rank"]
    rows = [
        ("model", a["model_type"]),
        ("kv cache", cache_dtype_line(a)),
        ("full indexer layers", f"{len(a['full_indexer_layers'])}: {a['full_indexer_layers']}"),
        ("MTP layers", str(a["mtp_layers"])),
        ("bytes/token main", f"{bpt['main']:,} B"),
        ("bytes/token indexer", f"{bpt['indexer']:,} B"),
        ("bytes/token total", f"{bpt['total']:,} B ({a['bytes_per_token_with_mtp']:,} B with MTP)"),
        ("tokens", f"{a['tokens']:,} (decode prefix hit {a['prefix_tokens']:,})"),
        ("request main", human_bytes(req["main"])),
        ("request indexer", human_bytes(req["indexer"])),
        ("request total", human_bytes(req["total"])),
        ("pages", f"{a['pages']:,} of {a['page_tokens']} tokens (decode pages {a['decode_page_tokens']})"),
        ("suffix pages moved", f"{a['suffix_pages']:,}"),
        ("regions per rank", str(a["regions_per_rank"])),
        (
            "moved per decode rank (most)",
            f"{human_bytes(moved['total'])} "
            f"(main {human_bytes(moved['main'])}, indexer {human_bytes(moved['indexer'])})",
        ),
        ("runs, contiguous alloc", f"{a['runs']['contiguous']:,}{scattered_note(a)}"),
        ("runs, worst-case alloc", f"{a['runs']['worst_case']:,}"),
        ("prefill ranks", f"TP {a['prefill_tp']}, {describe(Sharding(**a['prefill_sharding']))}"),
        ("decode ranks", f"TP {a['decode_tp']}, {describe(Sharding(**a['decode_sharding']))}"),
        ("decode rank r reads", f"prefill ranks {a['sources_of_decode_rank']}[r]"),
        ("bytes over the network", f"{human_bytes(a['bytes_over_network'])} (every decode rank's reads)"),
        ("link", f"{a['nics_per_rank']} x {a['link_gbps']:g} Gbit/s per decode rank"),
        ("time on the link", human_seconds(a["link_seconds"])),
        (
            "per layer",
            f"main {human_seconds(a['per_layer_seconds']['main'])}, "
            f"indexer {human_seconds(a['per_layer_seconds']['indexer'])}",
        ),
    ]
    rows += exposure_rows(a["exposed"])
    rows += hbm_rows(a.get("hbm"))
    print_table(rows, "glm-pd plan: the handoff account of one request")


def exposure_rows(e: dict) -> list[tuple[str, str]]:
    """Each mode's exposed time; untimed round trips are named beside the seconds so none reads as the whole."""
    st, trips = e["streamed"], e["round_trips"]
    untimed = f" + {trips} round trips" if e["rtt_seconds"] is None else ""
    timed = "untimed (pass --rtt-ms)" if e["rtt_seconds"] is None else f"x {human_seconds(e['rtt_seconds'])}"
    if st["seconds"] is None:
        streamed = (
            f"unknown without --prefill-tokens-per-s; at least {human_seconds(st['last_chunk_seconds'])}{untimed} "
            "(the last chunk's share)"
        )
    else:
        streamed = (
            f"{human_seconds(st['seconds'])}{untimed} (last chunk {human_seconds(st['last_chunk_seconds'])} + "
            f"backlog {human_seconds(st['backlog_seconds'])}; prefill {human_seconds(st['prefill_seconds'])} at "
            f"{st['prefill_tokens_per_s']:,.0f} tokens/s)"
        )
    return [
        (
            "prefill chunks",
            f"{st['chunks']:,} of {st['chunk_tokens']:,} tokens; the last ({st['last_chunk_tokens']:,} tokens) "
            f"moves {human_bytes(st['last_chunk_bytes'])} on the busiest link",
        ),
        ("side-channel round trips", f"{trips} after prefill answers, either mode (claims, releases): {timed}"),
        (
            "exposed, pull",
            f"{human_seconds(e['pull']['seconds'])}{untimed} (all of the link time: decode reads after prefill)",
        ),
        ("exposed, streamed", streamed),
    ]


def hbm_rows(hbm: dict | None) -> list[tuple[str, str]]:
    """Per side: the GPU budget, what the weights leave for KV, the request's KV per rank, and the verdict."""
    if hbm is None:
        return [("fits the GPU?", "unknown: the checkpoint size is not known; pass --weights-gb")]
    rows = []
    for side in ("prefill", "decode"):
        h = hbm[side]
        cp = "DCP" if side == "decode" else "CP"
        layout = "replicated" if h["context_parallel"] == 1 else f"{cp} {h['context_parallel']}"
        if h["layer_split"] > 1:
            layout = f"layers split {h['layer_split']} ways"
        budget = (
            f"{hbm['gpu']} {human_bytes(h['hbm_bytes'])} x {h['utilization']:g} - weights "
            f"{human_bytes(h['weights_per_rank_bytes'])} - reserve {human_bytes(h['reserve_bytes'])} = "
            f"{human_bytes(h['kv_free_bytes'])} for KV"
        )
        need = h["min_context_parallel"]
        if h["fits"]:
            verdict = "fits"
        elif need is None:
            verdict = f"does not fit, even with {cp} = TP"
        else:
            verdict = f"does not fit; needs {cp} >= {need}"
        rows.append((f"{side} rank HBM", budget))
        rows.append((f"{side} request KV", f"{human_bytes(h['kv_per_rank_bytes'])} per rank ({layout}): {verdict}"))
        if h["staging_bytes"]:
            room = "fits" if h["staging_fits"] else "does NOT fit: lower staging_mib or gpu-memory-utilization"
            left = human_bytes(h["headroom_bytes"])
            rows.append(
                (f"{side} staging", f"{human_bytes(h['staging_bytes'])} of the {left} the engine leaves: {room}")
            )
    return rows

"""``glm-pd`` command line: plan (the capacity account), demo (a real loopback handoff), doctor, keygen (a
deployment's side-channel key).

A plain install runs every command but the demo, which needs the side channel and a transport (extras);
so the demo's modules are imported only when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from glm_pd_common.errors import GlmPdError
from glm_pd_common.layout.hbm import GPU_HBM_GB
from glm_pd_common.layout.shards import Sharding
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.args import add_model_args, cache_dtype, cache_spec, main_rows_by_backend, token_count
from glm_pd_common.tools.extras import OPTIONAL_MODULES, install_hint, installed, require_transport


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the capacity account of one request")
    add_model_args(p)
    p.add_argument("--tokens", type=token_count, default=token_count("1M"))
    p.add_argument("--page-tokens", type=int, default=64, help="prefill page size in tokens")
    p.add_argument("--decode-page-tokens", type=int, help="decode page size (default: --page-tokens)")
    p.add_argument("--prefix-tokens", type=token_count, default=0, help="decode's prefix hit (page-aligned)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--link-gbps", type=float, default=400.0, help="line rate of one NIC in Gbit/s")
    p.add_argument("--nics", type=int, default=1, help="NICs each decode rank reads over")
    hbm = p.add_argument_group("whether the request fits each rank's GPU memory")
    hbm.add_argument("--gpu", choices=sorted(GPU_HBM_GB), default="h200", help="GPU preset (default h200)")
    hbm.add_argument("--hbm-gb", type=float, help="GPU memory in GB, instead of the preset's")
    hbm.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="the engine's setting (0.9)")
    hbm.add_argument("--weights-gb", type=float, help="checkpoint size in GB, split over TP (default: the config "
                     "folder's safetensors index, or the preset's FP8 checkpoint)")  # fmt: skip
    hbm.add_argument("--reserve-gb", type=float, default=4.0, help="activations and workspace per rank (4)")
    hbm.add_argument(
        "--staging-mib",
        type=int,
        default=256,
        help="glm-pd's staging buffer per rank (vLLM staging_mib, SGLANG_GLM_PD_STAGING_MIB; 256; 0: none); it must "
        "fit the headroom the engine leaves",
    )
    cp = p.add_argument_group("context parallelism: how each side's ranks shard the caches (default: replicated)")
    cp.add_argument("--prefill-cp", type=int, default=1, help="prefill's token shards (vLLM -dcp on prefill)")
    cp.add_argument("--prefill-layer-split", type=int, default=1, help="prefill's layer shards (SGLang CP layer split)")
    cp.add_argument("--decode-dcp", type=int, default=1, help="decode's token shards (vLLM -dcp)")
    cp.add_argument("--prefill-interleave", type=int, default=1, help="prefill's tokens per shard turn (1)")
    cp.add_argument("--decode-interleave", type=int, default=1, help="decode's tokens per shard turn (1)")
    ex = p.add_argument_group(
        "exposed handoff time: what the time to first token waits for",
        "pull: the busiest rank's whole link time, as decode reads after prefill answers. streamed: each prefill "
        "chunk's KV moves while prefill computes the next, so the last chunk's share stays exposed, plus any "
        "backlog a link slower than prefill leaves. Assumes prefill computes only the suffix decode lacks, at a "
        "constant rate (really late chunks run slower, which only helps streaming), and a chunk's bytes "
        "pro rata to its tokens. Both modes add their side-channel round trips (a claim per source, a release "
        "per copy), timed with --rtt-ms.",
    )
    ex.add_argument("--chunk-tokens", type=token_count,
                    help="prefill's chunk (vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size); default: "
                    "both engines' default for --gpu (h100/h200 8192, b200 16384)")  # fmt: skip
    ex.add_argument("--prefill-tokens-per-s", type=float,
                    help="prefill throughput on one request; without it the streamed figure is unknown")  # fmt: skip
    ex.add_argument("--rtt-ms", type=float, help="one side-channel round trip; without it they are counted, untimed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from glm_pd_common.layout.capacity import AccountInputs, account
    from glm_pd_common.layout.exposure import DEFAULT_CHUNK_TOKENS
    from glm_pd_common.layout.fingerprint import PeerShape, require_convertible
    from glm_pd_common.tools.report import print_account

    if args.link_gbps <= 0 or args.nics <= 0:
        raise GlmPdError("--link-gbps and --nics must be positive")
    if args.tokens <= 0:
        raise GlmPdError("--tokens must be positive")
    if any(v is not None and v <= 0 for v in (args.chunk_tokens, args.prefill_tokens_per_s)):
        raise GlmPdError("--chunk-tokens and --prefill-tokens-per-s must be positive")
    if args.rtt_ms is not None and args.rtt_ms < 0:
        raise GlmPdError("--rtt-ms must not be negative")
    decode_pt = args.decode_page_tokens or args.page_tokens
    prefill_sharding = Sharding(args.prefill_cp, args.prefill_interleave, args.prefill_layer_split)
    decode_sharding = Sharding(args.decode_dcp, args.decode_interleave)
    require_convertible(
        PeerShape(args.page_tokens, args.prefill_tp, 0, sharding=prefill_sharding),
        PeerShape(decode_pt, args.decode_tp, 0, sharding=decode_sharding),
    )
    spec = cache_spec(args)
    result = account(
        AccountInputs(
            geometry=spec.geometry,
            row=spec.row,
            indexer=spec.indexer,
            num_tokens=args.tokens,
            prefill_page_tokens=args.page_tokens,
            decode_page_tokens=decode_pt,
            prefix_tokens=args.prefix_tokens,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            link_gbps=args.link_gbps,
            nics_per_rank=args.nics,
            prefill_sharding=prefill_sharding,
            decode_sharding=decode_sharding,
            chunk_tokens=args.chunk_tokens or DEFAULT_CHUNK_TOKENS[args.gpu],
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            rtt_s=None if args.rtt_ms is None else args.rtt_ms / 1e3,
        )
    )
    result["engine"] = args.engine
    result["kv_cache_dtype"] = cache_dtype(args)
    result["hbm"] = hbm_sides(args, spec, prefill_sharding)
    result["main_rows_by_backend"] = main_rows_by_backend(args, spec.geometry)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_account(result)
    return 0


def hbm_sides(args: argparse.Namespace, spec: CacheSpec, prefill_sharding: Sharding) -> dict[str, object] | None:
    """The HBM account of a prefill and a decode rank (None when the checkpoint size is unknown). Under a
    layer split the busiest prefill rank holds every token of its share of the layers."""
    from glm_pd_common.layout.hbm import GB, HbmInputs, checkpoint_bytes, hbm_account, kv_bytes_per_token

    weights = args.weights_gb * GB if args.weights_gb is not None else checkpoint_bytes(args.config, args.preset)
    if weights is None:
        return None
    hbm = (args.hbm_gb if args.hbm_gb is not None else GPU_HBM_GB[args.gpu]) * GB
    out: dict[str, object] = {"gpu": args.gpu if args.hbm_gb is None else f"{args.hbm_gb:g} GB"}
    for side, tp, shards, sharding in (
        ("prefill", args.prefill_tp, args.prefill_cp, prefill_sharding),
        ("decode", args.decode_tp, args.decode_dcp, None),
    ):
        inputs = HbmInputs(
            kv_bytes_per_token=kv_bytes_per_token(spec, sharding, tp),
            num_tokens=args.tokens,
            tp=tp,
            hbm_bytes=hbm,
            utilization=args.gpu_memory_utilization,
            weights_per_rank_bytes=weights / tp,
            reserve_bytes=args.reserve_gb * GB,
            staging_bytes=args.staging_mib * 2**20,
        )
        out[side] = hbm_account(inputs, shards)
        out[side]["layer_split"] = sharding.layer_shards if sharding else 1  # type: ignore[index]
    return out


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """All commands; the demo's own parser (and the modules behind it) only when ``command`` is the demo."""
    parser = argparse.ArgumentParser(prog="glm-pd", description="GLM-5.x-aware PD handoff for vLLM and SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    if command == "demo":
        _demo_parser(sub)
    else:
        sub.add_parser("demo", help="run one real loopback handoff between two processes (needs a transport extra)")
    from glm_pd_common.tools.doctor import add_parser as add_doctor

    add_doctor(sub)
    _keygen_parser(sub)
    return parser


def _keygen_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="make a deployment's side-channel credential (a CURVE key pair)")
    p.add_argument("directory", help="where to write NAME.key (public) and NAME.key_secret (give it to every peer)")
    p.add_argument("--name", default="glm-pd", help="file name stem (default glm-pd)")
    p.set_defaults(func=_run_keygen)


def _run_keygen(args: argparse.Namespace) -> int:
    if not installed("zmq"):
        raise GlmPdError(f"needs pyzmq, which this install lacks: {install_hint('nixl')}")
    from pathlib import Path

    from glm_pd_common.handoff.wire.trust import make_credential

    path = make_credential(Path(args.directory), args.name)
    print(f"{path.resolve()}  (owner-only; set it as every prefill's and decode's `credential`)")
    return 0


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    """The real demo parser, or, without the side channel, one that takes any arguments and names the extra."""
    try:
        from glm_pd_common.tools.demo import add_parser
    except ModuleNotFoundError as exc:
        if exc.name not in OPTIONAL_MODULES:
            raise
        missing = OPTIONAL_MODULES[exc.name][0]
        # No option prefix: every argument is a positional, so any demo command line reaches the message.
        p = sub.add_parser("demo", prefix_chars="\0")
        p.add_argument("arguments", nargs="*")
        p.set_defaults(func=lambda _args: _refuse_demo(missing))
        return
    add_parser(sub)
    demo = sub.choices["demo"]
    run = demo.get_default("func")

    def checked(args: argparse.Namespace) -> int:
        require_transport("demo", args.transport)
        return run(args)

    demo.set_defaults(func=checked)


def _refuse_demo(missing: str) -> NoReturn:
    raise GlmPdError(
        f"needs {missing} and a transport, which this install lacks: {install_hint('nixl')} "
        f"(or {install_hint('mooncake')} for --transport mooncake)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (GlmPdError, ValueError) as exc:
        print(f"glm-pd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

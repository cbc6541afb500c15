"""``glm-pd`` command line: plan (the capacity account), demo (a real loopback handoff), doctor."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from glm_pd_common.errors import GlmPdError
from glm_pd_common.layout.geometry import ModelGeometry

_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def token_count(text: str) -> int:
    """``1M`` = 1,048,576 tokens, ``128k`` = 131,072; plain integers as given."""
    raw = text.strip().lower()
    scale = _SUFFIXES.get(raw[-1:], 1)
    digits = raw[:-1] if scale > 1 else raw
    try:
        value = int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (use e.g. 4096, 128k, 1M)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"token count must not be negative: {text!r}")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--preset", default="glm-5.3", help="named model geometry (default glm-5.3)")
    src.add_argument("--config", help="path to an HF config.json (or its folder) instead of a preset")
    parser.add_argument("--kv-cache-dtype", default="fp8_ds_mla", help="fp8_ds_mla (default), bf16/auto, fp8")
    parser.add_argument("--indexer-scale-format", default="fp32", choices=["fp32", "ue8m0x4"])


def load_geometry(args: argparse.Namespace) -> ModelGeometry:
    return ModelGeometry.from_config(args.config) if args.config else ModelGeometry.preset(args.preset)


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
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from glm_pd_common.layout.capacity import AccountInputs, account
    from glm_pd_common.layout.fingerprint import PeerShape, require_convertible
    from glm_pd_common.layout.spec import CacheSpec
    from glm_pd_common.tools.report import print_account

    if args.link_gbps <= 0 or args.nics <= 0:
        raise GlmPdError("--link-gbps and --nics must be positive")
    if args.tokens <= 0:
        raise GlmPdError("--tokens must be positive")
    decode_pt = args.decode_page_tokens or args.page_tokens
    require_convertible(PeerShape(args.page_tokens, args.prefill_tp, 0), PeerShape(decode_pt, args.decode_tp, 0))
    spec = CacheSpec.create(load_geometry(args), args.kv_cache_dtype, args.indexer_scale_format)
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
        )
    )
    result["kv_cache_dtype"] = args.kv_cache_dtype
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_account(result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm-pd", description="GLM-5.x-aware PD handoff for vLLM and SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    from glm_pd_common.tools.demo import add_parser as add_demo
    from glm_pd_common.tools.doctor import add_parser as add_doctor

    add_demo(sub)
    add_doctor(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (GlmPdError, ValueError) as exc:
        print(f"glm-pd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

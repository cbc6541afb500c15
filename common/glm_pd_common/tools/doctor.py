"""``glm-pd doctor``: check one node before deployment; every failing line says how to fix it.

It never imports torch or the engines: GPU visibility is read from the driver (and from torch in a child
process when torch is installed), and the UCX data path is observed, not guessed, by a loopback READ and WRITE
between child processes run with ``UCX_PROTO_INFO=y``: on host memory, and on GPU memory where a GPU is visible.
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata as pkg_metadata

from glm_pd_common.errors import GlmPdError
from glm_pd_common.layout.shards import describe
from glm_pd_common.tools.args import add_model_args, cache_spec
from glm_pd_common.tools.extras import OPTIONAL_MODULES, install_hint, installed
from glm_pd_common.tools.ucxprobe import OPERATIONS
from glm_pd_common.transport.base import rdma_devices
from glm_pd_common.transport.datapath import Selection, between_peers, judge_gpu_path, judge_without_rdma, observe
from glm_pd_common.transport.mooncake import gpu_memory_refusal, installed_wheel
from glm_pd_common.transport.node import node_id

_NO_TORCH_NIXL = "without torch: pip install pyzmq, then pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
Probe = tuple[list[Selection], str]  # ``datapath.observe``'s answer: UCX's choices, and why the probe failed


@dataclass(frozen=True)
class Check:
    status: str  # PASS | WARN | FAIL | INFO
    name: str
    detail: str
    fix: str = ""


def _version(dist: str) -> str | None:
    try:
        return pkg_metadata.version(dist)
    except pkg_metadata.PackageNotFoundError:
        return None


def check_side_channel() -> list[Check]:
    if installed("zmq"):
        return [Check("PASS", "side channel", f"pyzmq {_version('pyzmq')} importable")]
    extras = " or ".join(sorted({install_hint(extra) for _, extra in OPTIONAL_MODULES.values()}))
    return [Check("FAIL", "side channel", "pyzmq not installed: no handshake is possible", extras)]


def check_transports() -> list[Check]:
    out = []
    nixl = _version("nixl")
    found = nixl and installed("nixl")
    out.append(
        Check("PASS", "nixl", f"nixl {nixl} importable")
        if found
        else Check(
            "FAIL",
            "nixl",
            "nixl not installed",
            f"{install_hint('nixl')} (its nixl-cu12 pulls torch; {_NO_TORCH_NIXL})",
        )
    )
    wheel = installed_wheel()
    if wheel and installed("mooncake"):
        out.append(check_mooncake_wheel(wheel, gpus_visible=bool(_gpus())))
    else:
        out.append(
            Check(
                "WARN",
                "mooncake",
                "mooncake transfer engine not installed",
                f"{install_hint('mooncake')} (CUDA hosts; else mooncake-transfer-engine-non-cuda); needs libibverbs1",
            )
        )
    return out


def check_mooncake_wheel(wheel: tuple[str, str], *, gpus_visible: bool) -> Check:
    """The Mooncake wheel must match the node: the non-CUDA build cannot register the GPU caches."""
    verbs = ctypes.util.find_library("ibverbs")
    detail = f"{wheel[0]} {wheel[1]}, libibverbs {'found' if verbs else 'MISSING'}"
    refusal = gpu_memory_refusal(wheel)
    if gpus_visible and refusal is not None:
        return Check("FAIL", "mooncake", f"{detail}; GPUs are visible, but {refusal.split('; ')[0]}", refusal)
    if not verbs:
        return Check("FAIL", "mooncake", detail, "apt-get install libibverbs1")
    return Check("PASS", "mooncake", detail + ("" if refusal is None else " (host memory only: no GPUs here)"))


def _gpus() -> list[str]:
    """GPUs the NVIDIA driver lists (none without ``nvidia-smi``)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    res = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    return [ln for ln in res.stdout.splitlines() if ln.startswith("GPU")]


def check_rdma(devices: tuple[str, ...], gpu_probe: Probe | None) -> list[Check]:
    """RDMA devices; without them GPU caches may still move by cuda_ipc to peers on this node, as NIXL accepts
    (``judge_without_rdma`` on ``gpu_probe``, the loopback probe of GPU memory): a warning then, not a failure."""
    dev_nodes = sorted(os.listdir("/dev/infiniband")) if os.path.isdir("/dev/infiniband") else []
    if devices:
        return [
            Check("PASS", "rdma devices", f"{', '.join(devices)} (/dev/infiniband: {', '.join(dev_nodes) or 'none'})")
        ]
    why = "no RDMA devices under /sys/class/infiniband"
    selections, err = gpu_probe or ([], "")  # no probe: nothing observed, so no operation is accepted
    intra = [
        op
        for op in OPERATIONS
        if judge_without_rdma(why, {"VRAM"}, op, between_peers(selections, op, "cuda"), err).accepted
    ]
    if intra:
        return [
            Check(
                "WARN",
                "rdma devices",
                f"none under /sys/class/infiniband: GPU caches move by cuda_ipc for {' and '.join(intra)}, intra-node "
                "only (peers on this node); host caches and other nodes would be TCP",
                "for pairs across nodes install the NIC driver/rdma-core and expose /dev/infiniband to the container",
            )
        ]
    return [
        Check(
            "FAIL",
            "rdma devices",
            "none under /sys/class/infiniband: KV would move over TCP",
            "install the NIC driver/rdma-core and expose /dev/infiniband to the container; "
            "or accept TCP explicitly with allow_tcp",
        )
    ]


def check_ucx_path(memory: str, probe: Probe | None = None) -> list[Check]:
    """What UCX picks between two processes of this node, for READ (pull) and WRITE (push) on ``memory`` (as
    ``probe`` saw it, else as a new probe sees it)."""
    name = f"ucx data path ({memory})"
    selections, err = probe or observe(memory)
    if err:
        return [Check("FAIL", name, err, "run with UCX_LOG_LEVEL=info for details")]
    checks = []
    for op in OPERATIONS:
        chosen = between_peers(selections, op, memory)
        if chosen is None:
            checks.append(Check("WARN", name, f"UCX printed no {op} table for {memory} memory", "set UCX_PROTO_INFO=y"))
        elif memory == "cuda":
            verdict = judge_gpu_path(chosen, allow_tcp=False)
            checks.append(Check("PASS" if verdict.accepted else "FAIL", name, verdict.detail, verdict.fix))
        elif chosen.path == "rdma":
            checks.append(Check("PASS", name, chosen.describe()))
        else:
            detail = f"{chosen.describe()}: no RDMA transport, so between hosts this is tcp"
            fix = "set UCX_NET_DEVICES to the RDMA ports (e.g. mlx5_0:1) and do not restrict UCX_TLS to tcp"
            checks.append(Check("WARN", name, detail, fix))
    return checks


def check_gpus() -> list[Check]:
    out = []
    if shutil.which("nvidia-smi"):
        gpus = _gpus()
        out.append(
            Check(
                "PASS" if gpus else "WARN",
                "gpus",
                f"{len(gpus)} visible to the driver" + (f": {gpus[0]}" if gpus else ""),
                "" if gpus else "check CUDA_VISIBLE_DEVICES",
            )
        )
    else:
        out.append(Check("INFO", "gpus", "no nvidia-smi: no NVIDIA driver on this host"))
    if importlib.util.find_spec("torch") is not None:
        code = "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())"
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        words = res.stdout.split()
        detail = (
            f"torch {words[0]}, cuda available {words[1]}, {words[2]} device(s)"
            if len(words) == 3
            else f"torch failed to import: {res.stderr.strip()[-200:]}"
        )
        out.append(Check("INFO", "torch", detail))
    return out


def check_node() -> Check:
    """The id a transport announces to its peers: one limited to its node (cuda_ipc, no RDMA) names both ids."""
    return Check("INFO", "node", f"{node_id()} (the kernel's boot id, hashed: one per host and boot)")


def check_peer(address: str, spec_args: argparse.Namespace) -> list[Check]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise GlmPdError(f"--peer must be host:port, got {address!r}")
    if not installed("zmq"):
        return [Check("FAIL", "peer", f"{address}: cannot ask without pyzmq", install_hint("nixl"))]
    from glm_pd_common.handoff.wire import protocol
    from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
    from glm_pd_common.handoff.wire.sidechannel import SideChannelClient
    from glm_pd_common.handoff.wire.trust import Trust
    from glm_pd_common.layout.fingerprint import diff

    spec = cache_spec(spec_args)
    client = SideChannelClient(host, int(port), Trust.from_settings(spec_args.credential, spec_args.insecure))
    try:
        client.send(protocol.Query(v=PROTOCOL_VERSION, engine_id="glm-pd-doctor"))
        reply = client.recv(timeout_s=10)
    except GlmPdError as exc:
        hint = "is the peer's side channel listening on that address, and does --credential name its deployment's key?"
        return [Check("FAIL", "peer", f"{address}: {exc}", hint)]
    finally:
        client.close()
    if not isinstance(reply, protocol.Hello):
        return [Check("FAIL", "peer", f"{address} answered {type(reply).__name__}, not a hello")]
    diffs = diff(spec.fingerprint(), reply.fingerprint)
    if not diffs:
        return [
            Check(
                "PASS",
                "peer fingerprint",
                f"{reply.engine_id} at {address} matches "
                f"(digest {reply.fingerprint.digest()}, page {reply.shape.page_tokens} tokens, "
                f"TP {reply.shape.tp_size}, {describe(reply.shape.sharding)}, "
                f"transport {reply.transport})",
            )
        ]
    return [
        Check(
            "FAIL",
            f"peer fingerprint {name}",
            f"this node {a!r}, {reply.engine_id} {b!r}",
            "both sides must run the same model config, kv cache dtype and indexer scale format",
        )
        for name, a, b in diffs
    ]


def run(args: argparse.Namespace) -> int:
    probing = not args.skip_probe and bool(_version("nixl"))
    gpu_probe = observe("cuda") if probing and _gpus() else None  # GPU caches move between GPU buffers
    checks = check_side_channel() + check_transports() + check_rdma(rdma_devices(), gpu_probe) + check_gpus()
    checks.append(check_node())
    if probing:
        checks += check_ucx_path("host")
        if gpu_probe is not None:
            checks += check_ucx_path("cuda", gpu_probe)
    if args.peer:
        checks += check_peer(args.peer, args)
    if args.json:
        print(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        for c in checks:
            print(
                f"[{c.status}] {c.name}: {c.detail}"
                + (f"\n       fix: {c.fix}" if c.fix and c.status != "PASS" else "")
            )
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:

    p = sub.add_parser("doctor", help="check this node before deployment")
    add_model_args(p)
    p.add_argument("--peer", help="host:port of a peer's side channel: compare fingerprints")
    p.add_argument("--credential", default="", help="the deployment key the peer authenticates (`glm-pd keygen`)")
    p.add_argument("--insecure", action="store_true", help="ask a peer off loopback without a credential")
    p.add_argument("--skip-probe", action="store_true", help="skip the UCX loopback probe")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)

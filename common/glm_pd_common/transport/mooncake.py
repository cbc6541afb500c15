"""Mooncake transfer-engine transport, P2P handshake (no etcd or metadata server).

Facts this module is built on (checked with mooncake-transfer-engine 0.3.13.post1):
- ``initialize``'s protocol does not choose the transport: the engine uses RDMA when it finds HCAs and TCP
  otherwise, returning 0 either way. So RDMA is checked here, before start-up, and TCP is refused unless
  allowed (then ``MC_FORCE_TCP=1`` makes the choice explicit).
- Over TCP the per-peer queue admits ~1,024 descriptors by default; a larger batch fails with -1 and
  repeated failures can wedge the peer. The limits are raised and batches are cut to stay under them.
- Transfers return -1 on failure rather than raising; every return code is checked.
- There is no non-blocking status for multi-descriptor batches, so a batch runs on a worker thread (the
  calls release the GIL) and ``poll`` checks that thread.
- Two wheels install the same ``mooncake`` module: ``mooncake-transfer-engine`` (built with CUDA) and
  ``mooncake-transfer-engine-non-cuda``. Only the first can register GPU memory, so VRAM regions are refused
  under the second before anything is registered, with the fix.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata as pkg_metadata

import numpy as np

from glm_pd_common.errors import ConfigError, TransferFailed
from glm_pd_common.layout.regions import Region
from glm_pd_common.transport.base import (
    Placement,
    Span,
    Transfer,
    Transport,
    TransportConfig,
    TransportInfo,
    rdma_devices,
    tcp_refusal,
)

BATCH_DESCRIPTORS = 16_384
CUDA_WHEEL, HOST_WHEEL = "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"
_QUEUE_LIMIT = "65535"


def _prepare_environment(force_tcp: bool, timeout_s: float) -> None:
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", _QUEUE_LIMIT)
    os.environ.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", _QUEUE_LIMIT)
    os.environ.setdefault("MC_TCP_ADMISSION_TIMEOUT_MS", str(int(timeout_s * 1000)))
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(timeout_s))))
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    if force_tcp:
        os.environ["MC_FORCE_TCP"] = "1"


def installed_wheel() -> tuple[str, str] | None:
    """The distribution that provides the ``mooncake`` module, and its version (None when none does)."""
    for dist in pkg_metadata.packages_distributions().get("mooncake", []):
        if dist in (CUDA_WHEEL, HOST_WHEEL):
            return dist, pkg_metadata.version(dist)
    return None


def gpu_memory_refusal(wheel: tuple[str, str] | None) -> str | None:
    """Why this Mooncake install cannot register GPU memory, with the fix; None when it can."""
    if wheel is None or wheel[0] != HOST_WHEEL:
        return None
    return (
        f"Mooncake is installed from {HOST_WHEEL} {wheel[1]}, which cannot register GPU memory; on GPU nodes "
        f"install the CUDA build: pip uninstall -y {HOST_WHEEL} && pip install {CUDA_WHEEL}=={wheel[1]}"
    )


class MooncakeTransport(Transport):
    backend = "mooncake"

    def __init__(self, agent_name: str, config: TransportConfig) -> None:
        super().__init__(agent_name, config)
        devices = rdma_devices()
        if not devices and not config.allow_tcp:
            raise tcp_refusal("Mooncake", "no RDMA devices under /sys/class/infiniband: it would log '0 HCAs'")
        self._devices = devices
        self._tcp = not devices
        _prepare_environment(self._tcp, config.timeout_s)
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        self._notify_cls = TransferNotify
        self._opcodes = {"READ": TransferOpcode.Read, "WRITE": TransferOpcode.Write}
        self._engine = TransferEngine()
        protocol = "tcp" if self._tcp else "rdma"
        device = config.devices if not self._tcp else ""
        rc = self._engine.initialize(config.host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferFailed(f"Mooncake initialize({config.host}, P2PHANDSHAKE, {protocol}) returned {rc}")
        self.session_id = f"{config.host}:{self._engine.get_rpc_port()}"
        # One worker per decode lane (decode_service.LANES): a stuck batch holds up only its own lane.
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"mooncake-{agent_name}")
        self._peers: dict[str, str] = {}
        self._registered: list[int] = []

    def _register(self, regions: Sequence[Region | Span]) -> None:
        device = next((r for r in regions if r.mem_kind != "DRAM"), None)
        refusal = gpu_memory_refusal(installed_wheel()) if device is not None else None
        if device is not None and refusal is not None:
            raise ConfigError(f"region {device.name} is {device.mem_kind}: {refusal}")
        for r in regions:
            if r.size_bytes == 0:
                continue  # Mooncake refuses zero-length registrations; nothing would move there anyway
            rc = self._engine.register_memory(r.base_addr, r.size_bytes)
            if rc != 0:
                raise TransferFailed(f"Mooncake register_memory of region {r.name} returned {rc}")
            self._registered.append(r.base_addr)

    def _metadata(self) -> bytes:
        return self.session_id.encode()

    def _add_peer(self, agent_name: str, payload: bytes) -> None:
        session = payload.decode()
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise TransferFailed(f"Mooncake session id {session!r} of peer {agent_name!r} is not host:port")
        self._peers[agent_name] = session

    def _remove_peer(self, agent_name: str) -> None:
        # The Python engine has no per-segment close (0.3.13): forgetting the session id is all there is.
        self._peers.pop(agent_name, None)

    def _post(
        self,
        xfer: Transfer,
        local: np.ndarray,
        remote: np.ndarray,
        lengths: np.ndarray,
        notif: bytes | None,
        places: tuple[Placement, Placement],
    ) -> None:  # Mooncake finds each address's segment itself
        session = self._peers[xfer.peer]
        xfer.handle = self._pool.submit(self._run_batches, xfer, session, local, remote, lengths, notif)

    def _run_batches(
        self,
        xfer: Transfer,
        session: str,
        local: np.ndarray,
        remote: np.ndarray,
        lengths: np.ndarray,
        notif: bytes | None,
    ) -> None:
        opcode = self._opcodes[xfer.op]
        cuts = list(range(0, lengths.size, BATCH_DESCRIPTORS)) or [0]
        for start in cuts:
            stop = min(start + BATCH_DESCRIPTORS, lengths.size)
            last = stop >= lengths.size
            note = self._notify(notif) if last and notif is not None else None
            rc = self._engine.batch_transfer_sync(
                session,
                local[start:stop].tolist(),
                remote[start:stop].tolist(),
                lengths[start:stop].tolist(),
                opcode,
                note,
            )
            if rc != 0:
                raise TransferFailed(
                    f"Mooncake {xfer.op} of {xfer.what} with peer {xfer.peer} ({session}) returned {rc} "
                    f"for descriptors {start}..{stop - 1}"
                )

    def _notify(self, payload: bytes) -> object:
        return self._notify_cls(self.agent_name, base64.b64encode(payload).decode())

    def _poll(self, xfer: Transfer) -> bool:
        future: Future = xfer.handle
        if not future.done():
            return False
        future.result()  # re-raises the batch's TransferFailed
        return True

    def _release(self, xfer: Transfer) -> None:
        future: Future = xfer.handle
        future.cancel()  # a running batch finishes on its own; the engine has no cancel

    def send_notif(self, peer: str, payload: bytes) -> None:
        """A zero-byte write carrying the notification (the engine has no standalone message)."""
        session = self._peers.get(peer)
        spans = self._remote.get(peer)
        if session is None or not spans or not self._local:
            raise TransferFailed(f"Mooncake notification to unknown peer {peer!r}")
        rc = self._engine.batch_transfer_sync(
            session,
            [self._local[0].base_addr],
            [spans[0].base_addr],
            [0],
            self._opcodes["WRITE"],
            self._notify(payload),
        )
        if rc != 0:
            raise TransferFailed(f"Mooncake notification to peer {peer} ({session}) returned {rc}")

    def notifs(self) -> list[tuple[str, bytes]]:
        return [(n.name, base64.b64decode(n.msg)) for n in self._engine.get_notifies()]

    def info(self) -> TransportInfo:
        path = "tcp (MC_FORCE_TCP=1, no HCA)" if self._tcp else f"rdma over {', '.join(self._devices)}"
        return TransportInfo(
            backend="mooncake",
            version=pkg_metadata.version("mooncake-transfer-engine-non-cuda")
            if _installed("mooncake-transfer-engine-non-cuda")
            else pkg_metadata.version("mooncake-transfer-engine"),
            data_path=path,
            path="tcp" if self._tcp else "rdma",
            rdma=not self._tcp,
            rdma_devices=self._devices,
            notes=(f"session {self.session_id}, metadata P2PHANDSHAKE",),
        )

    def _close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for addr in self._registered:
            self._engine.unregister_memory(addr)
        self._registered.clear()


def _installed(dist: str) -> bool:
    try:
        pkg_metadata.version(dist)
    except pkg_metadata.PackageNotFoundError:
        return False
    return True

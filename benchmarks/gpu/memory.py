"""Where the caches live: DRAM (``--memory host``) or one GPU's VRAM, and what that changes for the rows.

Every row runs the same services on either memory; only the buffers, the memory's own copies (the reference
rows), the staging buffer and a streamed chunk's clock differ, and they differ here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from benchmarks.gpu.environment import nvidia_smi
from benchmarks.gpu.ranks import PAGE_TOKENS, spec

if TYPE_CHECKING:
    from glm_pd_common.layout.regions import Region
    from glm_pd_common.transport.base import Transport
    from glm_pd_common.transport.memory import MemoryReader
    from glm_pd_common.transport.staging import Staging


class Pace(Protocol):
    """A streamed writer's clock: ``chunk`` makes one chunk and returns its ready event (None: ready now);
    ``finish`` waits for the last and gives every chunk's end on the monotonic clock."""

    def chunk(self) -> Any: ...

    def finish(self) -> list[float]: ...


class HostKind:
    """DRAM caches (numpy), the CPU's copies, a host sleep per streamed chunk."""

    ucx = "host"  # UCX's name for the memory type in its tables
    engine = "numpy"

    def describe(self) -> dict[str, Any]:
        return {"memory": "host (DRAM)", "numpy": np.__version__}

    def caches(self, num_pages: int) -> Any:
        from glm_pd_common.tools.hostmem import HostCaches

        return HostCaches(spec(), page_tokens=PAGE_TOKENS, num_pages=num_pages)

    def flat(self, nbytes: int) -> tuple[Region, Any]:
        from glm_pd_common.tools.flat import flat_region

        buf = self.scratch(nbytes)
        return flat_region(buf), buf

    def staging(self, transport: Transport, regions: list[Region], *, size_bytes: int, slot_bytes: int) -> Staging:
        """A staging buffer registered with ``transport``; mode ``always`` (on DRAM ``auto`` posts directly)."""
        from glm_pd_common.tools.hostmem import host_staging

        pairs = size_bytes // (2 * slot_bytes)
        return host_staging(transport, regions, slot_bytes=slot_bytes, pairs=pairs, mode="always")

    def endpoint_extras(self, regions: list[Region]) -> dict[str, Any]:
        return {}

    def digesters(self) -> dict[str, MemoryReader]:
        """The readers whose digests the bench times, by name (the endpoints' own is among them)."""
        from glm_pd_common.transport.memory import HOST

        return {"numpy": HOST}

    def scratch(self, nbytes: int) -> Any:
        return np.ones(nbytes, dtype=np.uint8)  # touched: no page faults inside a measurement

    def copy_s(self, dst: Any, src: Any) -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    def gather_s(self, dst: Any, src: Any, row_bytes: int, order: np.ndarray) -> float:
        rows = order.size
        source, out = src[: rows * row_bytes].reshape(rows, row_bytes), dst[: rows * row_bytes].reshape(rows, row_bytes)
        t0 = time.perf_counter()
        np.take(source, order, axis=0, out=out)
        return time.perf_counter() - t0

    def pace(self, chunk_s: float) -> Pace:
        return HostPace(chunk_s)


class HostPace:
    """A streamed writer's chunks on the host: each ends after a sleep, announced at once (nothing to wait for)."""

    def __init__(self, chunk_s: float) -> None:
        self.chunk_s = chunk_s
        self.ends: list[float] = []

    def chunk(self) -> Any:
        time.sleep(self.chunk_s)
        self.ends.append(time.monotonic())
        return None

    def finish(self) -> list[float]:
        return self.ends


class CudaKind(HostKind):
    """VRAM caches (torch, one tensor per region as vLLM allocates them), torch's copies, a GPU sleep per chunk."""

    ucx = "cuda"
    engine = "torch"

    def __init__(self) -> None:
        import torch

        from tests.gpu.vram import cuda_device

        self.torch = torch
        self.device = cuda_device()
        self._cycles_per_s = 0.0

    def describe(self) -> dict[str, Any]:
        torch = self.torch
        return {
            "memory": f"cuda:{self.device.index} (VRAM)",
            "gpu": torch.cuda.get_device_name(self.device),
            "driver": nvidia_smi("driver_version"),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
        }

    def caches(self, num_pages: int) -> Any:
        from tests.gpu.vram import VramCaches

        return VramCaches(spec(), page_tokens=PAGE_TOKENS, num_pages=num_pages, device=self.device)

    def flat(self, nbytes: int) -> tuple[Region, Any]:
        from glm_pd_common.tools.flat import flat_span

        buf = self.scratch(nbytes)
        return flat_span(buf.data_ptr(), nbytes, "VRAM", self.device.index), buf

    def staging(self, transport: Transport, regions: list[Region], *, size_bytes: int, slot_bytes: int) -> Staging:
        """The engines' own staging buffer on the caches' GPU (``torch_staging``), mode ``always``."""
        from glm_pd_common.transport.staging import torch_staging

        staging = torch_staging(
            self.torch, transport, regions, size_bytes=size_bytes, slot_bytes=slot_bytes, mode="always"
        )
        if staging is None:
            raise ValueError(f"no staging buffer of {size_bytes} B in {slot_bytes} B slots")
        return staging

    def endpoint_extras(self, regions: list[Region]) -> dict[str, Any]:
        from glm_pd_common.transport.devices import thread_device
        from glm_pd_common.transport.torch_memory import reader_for

        return {
            "memory": reader_for(regions, self.torch),
            "on_thread": thread_device(regions, self.torch),
        }

    def digesters(self) -> dict[str, MemoryReader]:
        """torch's ops and, where Triton is installed, the one-pass kernel (what ``reader_for`` gives engines)."""
        from glm_pd_common.transport.torch_memory import TorchMemory, digest_kernel

        kernel = digest_kernel()
        out: dict[str, MemoryReader] = {"torch ops": TorchMemory(self.torch)}
        if kernel is not None:
            out["triton kernel"] = TorchMemory(self.torch, kernel=kernel)
        return out

    def scratch(self, nbytes: int) -> Any:
        return self.torch.ones(nbytes, dtype=self.torch.uint8, device=self.device)

    def _synced(self, work: Callable[[], object]) -> float:
        self.torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        work()
        self.torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def copy_s(self, dst: Any, src: Any) -> float:
        return self._synced(lambda: dst.copy_(src))

    def gather_s(self, dst: Any, src: Any, row_bytes: int, order: np.ndarray) -> float:
        rows = order.size
        index = self.torch.as_tensor(order, device=self.device)
        source, out = src[: rows * row_bytes].view(rows, row_bytes), dst[: rows * row_bytes].view(rows, row_bytes)
        return self._synced(lambda: self.torch.index_select(source, 0, index, out=out))

    def pace(self, chunk_s: float) -> Pace:
        if not self._cycles_per_s:
            from tests.gpu.prefill_child import sleep_cycles_per_s

            self._cycles_per_s = sleep_cycles_per_s()
        return CudaPace(self.torch, chunk_s, self._cycles_per_s)


class CudaPace:
    """A streamed writer's chunks on the GPU: a sleep kernel each, then an event that gates its announcement. The
    chunks' end times come from the events' timings against a start event synchronized on the host clock."""

    def __init__(self, torch: Any, chunk_s: float, cycles_per_s: float) -> None:
        self.torch = torch
        self.cycles = int(chunk_s * cycles_per_s)
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        self.start.synchronize()
        self.start_at = time.monotonic()
        self.events: list[Any] = []

    def chunk(self) -> Any:
        self.torch.cuda._sleep(self.cycles)
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return event

    def finish(self) -> list[float]:
        self.events[-1].synchronize()
        return [self.start_at + self.start.elapsed_time(e) / 1e3 for e in self.events]


def memory_kind(name: str) -> HostKind:
    return CudaKind() if name == "cuda" else HostKind()

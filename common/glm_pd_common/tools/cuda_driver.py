"""The CUDA driver through ctypes, for the tools that put buffers in GPU memory (the demo's caches, the data-path
probe): the core imports no torch. A device's primary context is made current on every thread that touches its
memory (a thread starts on no context: the driver would fail, or act on another device)."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

from glm_pd_common.errors import ConfigError


class CudaDevice:
    """GPU ``index`` in this process: allocations and host <-> device copies (each waits for its copy)."""

    def __init__(self, index: int) -> None:
        # ldconfig's cache may not list the driver in a container that mounts it: then its soname is tried
        path = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            self._cuda = ctypes.CDLL(path)
        except OSError as exc:
            raise ConfigError(
                f"no CUDA driver (libcuda) on this machine: there is no GPU memory to use ({exc})"
            ) from exc
        self.index = index
        self._call("cuInit", 0)
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        if not 0 <= index < count.value:
            raise ConfigError(f"no GPU {index}: the CUDA driver lists {count.value}")
        self._context = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self._context), index)
        self.make_current()
        # called once per run by a staging copy: typed here rather than wrapped per call
        self._copy = self._cuda.cuMemcpyDtoDAsync_v2
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int

    def _call(self, name: str, *args: object) -> None:
        status = getattr(self._cuda, name)(*args)
        if status != 0:
            raise ConfigError(f"{name} on GPU {self.index} failed: CUDA error {status}")

    def make_current(self) -> None:
        """This device's context on the calling thread (a ``ThreadSetup`` for the threads glm-pd starts)."""
        self._call("cuCtxSetCurrent", self._context)

    def alloc(self, size: int) -> int:
        """``size`` bytes of device memory, held until the process exits."""
        pointer = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(size))
        return int(pointer.value)

    def upload(self, pointer: int, host: np.ndarray) -> None:
        """``host`` (contiguous) to device memory at ``pointer``."""
        self._call(
            "cuMemcpyHtoD_v2", ctypes.c_uint64(pointer), ctypes.c_void_p(host.ctypes.data), ctypes.c_size_t(host.nbytes)
        )

    def download(self, host: np.ndarray, pointer: int) -> None:
        """Device memory at ``pointer`` into ``host`` (contiguous, its whole size)."""
        self._call(
            "cuMemcpyDtoH_v2", ctypes.c_void_p(host.ctypes.data), ctypes.c_uint64(pointer), ctypes.c_size_t(host.nbytes)
        )

    def new_stream(self) -> int:
        """A stream on this device that does not wait for the legacy default stream (for one thread's copies)."""
        handle = ctypes.c_void_p()
        self._call("cuStreamCreate", ctypes.byref(handle), ctypes.c_uint(1))  # CU_STREAM_NON_BLOCKING
        return int(handle.value or 0)

    def copy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        """``size`` bytes from device address ``src`` to ``dst``, queued on ``stream``."""
        status = self._copy(dst, src, size, stream)
        if status != 0:
            raise ConfigError(f"cuMemcpyDtoDAsync_v2 on GPU {self.index} failed: CUDA error {status}")

    def synchronize(self, stream: int) -> None:
        """Wait until everything queued on ``stream`` is done."""
        self._call("cuStreamSynchronize", ctypes.c_void_p(stream))

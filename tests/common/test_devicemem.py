"""The demo's GPU caches (tools/devicemem.py) over a stand-in for the CUDA driver: content written on the host
mirror reaches "device" memory, checks read it back from there, a flipped device byte is seen, and a digest read
through the driver copier equals the host digest of the same bytes.

``HostDriver`` is a test double of ``CudaDevice``: its allocations are host buffers and its copies ``memmove``,
the driver's semantics for synchronous copies. The real driver runs in tests/gpu/test_demo_device.py."""

from __future__ import annotations

import ctypes

import numpy as np

from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.tools.devicemem import DeviceCaches, driver_copier
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.digests import region_pages_digest
from glm_pd_common.transport.memory import StagedMemory

SPEC = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
PAGE_TOKENS, NUM_PAGES, SEED = 64, 6, 11


class HostDriver:
    index = 3

    def __init__(self) -> None:
        self.memory: dict[int, np.ndarray] = {}
        self.current = 0

    def make_current(self) -> None:
        self.current += 1

    def alloc(self, size: int) -> int:
        buf = np.full(size, 0xEE, dtype=np.uint8)
        self.memory[buf.ctypes.data] = buf
        return buf.ctypes.data

    def upload(self, pointer: int, host: np.ndarray) -> None:
        ctypes.memmove(pointer, host.ctypes.data, host.nbytes)

    def download(self, host: np.ndarray, pointer: int) -> None:
        ctypes.memmove(host.ctypes.data, pointer, host.nbytes)


def test_device_caches_hold_on_the_device_what_the_host_content_says() -> None:
    driver = HostDriver()
    caches = DeviceCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES, device=driver)  # type: ignore[arg-type]
    table = np.array([4, 1, 5, 0], dtype=np.int64)
    caches.write_tokens(table, 0, 4 * PAGE_TOKENS, seed=SEED)
    reference = HostCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES)
    reference.write_tokens(table, 0, 4 * PAGE_TOKENS, seed=SEED)
    assert len(caches.regions) == len(reference.regions) == 101
    for region, host in zip(caches.regions, reference.regions, strict=True):
        assert (region.mem_kind, region.device_id, region.name) == ("VRAM", 3, host.name)
        on_device = driver.memory[region.base_addr].reshape(NUM_PAGES, -1)
        assert np.array_equal(on_device[table], reference.buffers[host.key][table])  # what moves is the device's
    assert caches.mismatched_tokens(table, 0, 4 * PAGE_TOKENS, seed=SEED) == []
    victim = caches.regions[7]
    driver.memory[victim.base_addr][int(table[2]) * victim.page_stride + 5] ^= 0x40  # damage on the device only
    bad = caches.mismatched_tokens(table, 0, 4 * PAGE_TOKENS, seed=SEED)
    assert len(bad) == 1 and bad[0].startswith(f"{victim.name}: 1 token(s) differ"), bad


def test_digests_through_the_driver_copier_equal_the_host_digests() -> None:
    driver = HostDriver()
    caches = DeviceCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES, device=driver)  # type: ignore[arg-type]
    reference = HostCaches(SPEC, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES)
    table = np.array([2, 0, 3], dtype=np.int64)
    for side in (caches, reference):
        side.write_tokens(table, 0, 3 * PAGE_TOKENS, seed=SEED)
    staged = StagedMemory(driver_copier(driver), staging_bytes=50_000)  # type: ignore[arg-type]
    before = driver.current
    for region, host in zip(caches.regions[:9], reference.regions[:9], strict=True):
        assert region_pages_digest(region, table, staged) == region_pages_digest(host, table)
    assert driver.current > before  # each copy made the device's context current on the reading thread

"""Descriptors carry the device their region was registered on (issue 15 item 2).

A TP rank's caches live on its own GPU (device 1..7 on an 8-GPU node); NIXL finds a descriptor only in a
registration of the same memory kind and device, so a batch described as device 0 fails on every other rank
(``NIXL_ERR_NOT_FOUND`` when the list is prepared). On this machine the same rule holds for DRAM registered
under a device id, which is how these tests stand in for GPU memory: two NIXL agents in this process, regions
on devices other than 0, a real READ, bytes compared.
"""

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from glm_pd_common.errors import TransferFailed
from glm_pd_common.transport.base import Span, Transport, TransportConfig, place_runs
from glm_pd_common.transport.factory import create_transport

pytest.importorskip("nixl")


@pytest.fixture
def pair() -> Iterator[tuple[Transport, Transport]]:
    cfg = TransportConfig(backend="nixl", allow_tcp=True, timeout_s=10)
    local, remote = create_transport("reader", cfg), create_transport("holder", cfg)
    stop = threading.Event()

    def passive() -> None:  # UCX progresses only while the holder's agent is polled
        while not stop.is_set():
            remote.notifs()
            time.sleep(0.001)

    thread = threading.Thread(target=passive, daemon=True)
    thread.start()
    yield local, remote
    stop.set()
    thread.join()
    local.close()
    remote.close()


def span(name: str, buf: np.ndarray, device: int) -> Span:
    return Span(name, buf.ctypes.data, buf.nbytes, "DRAM", device)


@pytest.mark.parametrize(("local_devices", "remote_devices"), [((3, 3), (3, 3)), ((1, 2), (5, 6))])
def test_runs_on_devices_other_than_0_are_read(pair, local_devices, remote_devices) -> None:
    """Two regions a side, each on its own device; one batch reads runs from both."""
    local, remote = pair
    rng = np.random.default_rng(7)
    srcs = [rng.integers(0, 256, 1 << 16, dtype=np.uint8) for _ in range(2)]
    dsts = [np.zeros(1 << 16, dtype=np.uint8) for _ in range(2)]
    local_spans = [span(f"dst{i}", d, dev) for i, (d, dev) in enumerate(zip(dsts, local_devices, strict=True))]
    remote_spans = [span(f"src{i}", s, dev) for i, (s, dev) in enumerate(zip(srcs, remote_devices, strict=True))]
    local.register(local_spans)
    remote.register(remote_spans)
    peer = local.add_peer(remote.metadata(), remote_spans)
    remote.add_peer(local.metadata(), local_spans)
    # region 0: [100, +4096) -> [0, +4096); region 1: [8192, +1000) -> [50000, +1000)
    local_addrs = np.array([dsts[0].ctypes.data, dsts[1].ctypes.data + 50000])
    remote_addrs = np.array([srcs[0].ctypes.data + 100, srcs[1].ctypes.data + 8192])
    lengths = np.array([4096, 1000])
    xfer = local.post(peer, "READ", local_addrs, remote_addrs, lengths)
    local.wait(xfer, 10)
    local.release(xfer)
    assert np.array_equal(dsts[0][:4096], srcs[0][100:4196])
    assert np.array_equal(dsts[1][50000:51000], srcs[1][8192:9192])
    assert not dsts[0][4096:].any() and not dsts[1][:50000].any()


def test_each_run_is_placed_on_its_regions_device() -> None:
    spans = [Span("a", 1000, 100, "VRAM", 4), Span("b", 5000, 100, "VRAM", 7)]
    placed = place_runs(np.array([5010, 1000, 5090]), np.array([10, 100, 10]), spans, where="t")
    assert placed.mem_kind == "VRAM"
    assert placed.device_ids.tolist() == [7, 4, 7]


def test_a_batch_across_memory_kinds_is_refused_naming_both() -> None:
    spans = [Span("cache", 1000, 100, "VRAM", 1), Span("meta", 5000, 100, "DRAM", 0)]
    with pytest.raises(TransferFailed, match="spans memory kinds DRAM, VRAM"):
        place_runs(np.array([1000, 5000]), np.array([10, 10]), spans, where="t")

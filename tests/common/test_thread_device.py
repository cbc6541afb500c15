"""Every CUDA call glm-pd makes on a thread of its own runs under its rank's device, never on GPU 0 by default.

A thread starts on device 0, so on a rank whose GPU is another its first event query or staging copy would open
GPU 0's context. ``DeviceDouble`` (tests/support/device_double.py) stands in for torch's device selection and
events and notes the device each call ran on; the services themselves are real, on NIXL over loopback.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.decode.service import LoadJob
from glm_pd_common.tools.hostmem import HostCaches
from glm_pd_common.transport.devices import host_only, thread_device
from tests.support.device_double import DeviceDouble, NotingReader
from tests.support.services import PAGE_TOKENS, Decode, Prefill, wait_for

DEVICE = 3
SETUP_CALLS = ("set_device", "set_stream")


def _regions(spec):
    return HostCaches(spec, page_tokens=PAGE_TOKENS, num_pages=1).regions


def test_the_setup_selects_the_device_the_regions_live_on_and_a_stream_of_each_threads_own(small_spec) -> None:
    """Off the device's default stream, where the engine's forward steps queue, and not shared between threads."""
    devices = DeviceDouble()
    regions = _regions(small_spec)
    assert thread_device(regions, devices.torch) is host_only  # host caches: no CUDA call at all
    setup = devices.setup_for(regions, DEVICE)
    streams = {}

    def run() -> None:
        setup()
        streams[threading.current_thread().name] = devices.current_stream()

    threads = [threading.Thread(target=run, name=f"glm-pd-t{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(devices.calls) == sorted((f"glm-pd-t{i}", call, DEVICE) for i in range(2) for call in SETUP_CALLS)
    first, second = streams.values()
    assert first is not None and second is not None and first is not second


def test_regions_on_two_devices_are_refused_by_name(small_spec) -> None:
    first, *rest = _regions(small_spec)
    regions = [replace(first, mem_kind="VRAM", device_id=0), *(replace(r, mem_kind="VRAM", device_id=2) for r in rest)]
    with pytest.raises(ConfigError, match=r"CUDA devices \[0, 2\]"):
        thread_device(regions, DeviceDouble().torch)


def test_service_threads_query_events_and_read_pages_on_the_rank_device(small_spec) -> None:
    """Prefill's service thread queries the grant's ready event; decode's lane reads the landed pages for their
    digests. Both run on threads glm-pd started, so both must run under the rank's device."""
    devices = DeviceDouble()
    setup = devices.setup_for(_regions(small_spec), DEVICE)
    prefill = Prefill(small_spec, on_thread=setup)
    decode = Decode(small_spec, on_thread=setup, memory=NotingReader(devices))
    try:
        pages = 3
        table = prefill.table[:pages]
        prefill.service.grant("r0", table, ready=devices.event())
        decode.service.submit(LoadJob("r0", prefill.remote, table, np.arange(pages), pages * PAGE_TOKENS - 5, 0))
        results = wait_for(decode.service.results, bool, 30.0)
        assert results and results[0].ok, results
        queried, copied = devices.off_main("event.query"), devices.off_main("copy")
        assert queried and copied, devices.calls  # prefill asked the event; decode's digests read the pages
        assert all(dev == DEVICE for _, dev in queried + copied), queried + copied
        on_own_stream = {name for name, _ in devices.off_main("set_stream")}
        assert {name for name, _ in queried + copied} <= on_own_stream, devices.calls
        assert any("prefill" in name for name, _ in queried) and any("decode" in name for name, _ in copied)
    finally:
        decode.close()
        prefill.close()

"""How a demo process moves and digests its caches (``glm-pd demo --staging``): the staging buffer an engine's
rank would hold, and the digest reader.

As in the engines, ``auto`` stages GPU memory where a plan's runs are short and posts host memory directly;
``always`` stages either. Host slots are gathered with numpy, GPU slots with driver copies (the demo holds its
GPU caches through the CUDA driver: the core imports no torch), and GPU digests are read through the driver.
"""

from __future__ import annotations

from typing import Any

from glm_pd_common.layout.regions import Region
from glm_pd_common.tools.cuda_driver import CudaDevice
from glm_pd_common.tools.devicemem import device_staging, driver_copier
from glm_pd_common.tools.hostmem import host_staging
from glm_pd_common.transport.base import Transport
from glm_pd_common.transport.memory import HOST, MemoryReader, StagedMemory
from glm_pd_common.transport.staging import Staging


def demo_memory(
    job: dict[str, Any], transport: Transport, regions: list[Region], device: CudaDevice | None
) -> tuple[Staging | None, MemoryReader]:
    """This process's staging buffer (None: it posts directly) and digest reader, per the job's ``staging``,
    ``staging_mib`` and ``staging_slot_kib`` (checked by the CLI)."""
    mode, size, slot = job["staging"], job["staging_mib"] << 20, job["staging_slot_kib"] << 10
    pairs = size // (2 * slot)
    if device is not None:
        memory = StagedMemory(driver_copier(device))
        if mode == "never":
            return None, memory
        return device_staging(device, transport, slot_bytes=slot, pairs=pairs, mode=mode), memory
    if mode != "always":
        return None, HOST
    return host_staging(transport, regions, slot_bytes=slot, pairs=pairs, mode=mode), HOST

"""How a demo process moves and digests its caches (``glm-pd demo --staging``): the staging buffer an engine's
rank would hold, and the digest reader.

On host memory ``always`` stages through numpy (``auto`` posts host memory directly, as the engines do). On a GPU
the demo holds its caches through the CUDA driver and the core imports no torch, so it has no device copies to
gather and scatter with: it posts directly and digests through the driver, and ``always`` is refused by name (the
engines' adapters stage GPU memory with their own torch).
"""

from __future__ import annotations

from typing import Any

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.regions import Region
from glm_pd_common.tools.cuda_driver import CudaDevice
from glm_pd_common.tools.devicemem import driver_copier
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
    if device is not None:
        if mode == "always":
            raise ConfigError("--staging always needs host caches: the demo's GPU caches have no device copies")
        return None, StagedMemory(driver_copier(device))
    if mode != "always":
        return None, HOST
    return host_staging(transport, regions, slot_bytes=slot, pairs=size // (2 * slot), mode=mode), HOST

"""How a demo process moves and digests its caches (``glm-pd demo --staging``): the staging buffer an engine's
rank would hold, and the digest reader.

On host memory ``always`` stages through numpy (``auto`` posts host memory directly, as the engines do). On a GPU
both need the engines' own torch, as in a deployment: the staging buffer is a torch allocation on the caches'
device and the slots are gathered and scattered with torch, and digests are computed on the device
(``TorchMemory``). Without torch (a node where glm-pd was installed alone) the demo posts directly and digests
through the driver, and ``always`` is refused by name.
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
from glm_pd_common.transport.staging import Staging, torch_staging
from glm_pd_common.transport.torch_memory import TorchMemory


def cuda_torch() -> Any | None:
    """The engines' torch, where it is installed and sees a GPU; None otherwise."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def demo_memory(
    job: dict[str, Any], transport: Transport, regions: list[Region], device: CudaDevice | None
) -> tuple[Staging | None, MemoryReader]:
    """This process's staging buffer (None: it posts directly) and digest reader, per the job's ``staging``,
    ``staging_mib`` and ``staging_slot_kib`` (checked by the CLI)."""
    mode, size, slot = job["staging"], job["staging_mib"] << 20, job["staging_slot_kib"] << 10
    if device is None:
        if mode != "always":
            return None, HOST
        return host_staging(transport, regions, slot_bytes=slot, pairs=size // (2 * slot), mode=mode), HOST
    torch = cuda_torch()
    if torch is None:
        if mode == "always":
            raise ConfigError("--staging always on a GPU needs torch with CUDA (the engines' own) for its copies")
        return None, StagedMemory(driver_copier(device))
    staging = torch_staging(torch, transport, regions, size_bytes=size, slot_bytes=slot, mode=mode)
    return staging, TorchMemory(torch)

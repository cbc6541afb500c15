"""The CUDA device and stream glm-pd's own threads run on.

A thread starts on CUDA device 0. The first CUDA call it makes (an event query, a staging copy, UCX posting
from device memory) then brings up GPU 0's primary context, about 0.5 GiB, in every rank whose GPU is another:
on a TP 8 node GPU 0 loses some 3.5 GiB after the engine sized its KV cache. So every thread glm-pd starts
(service threads, lanes, listeners) first selects the device its rank's regions live on.

It also starts on that device's default stream, the one the engine's forward steps are queued on (torch's legacy
stream, shared by every thread of the process). A staging gather or scatter, or a digest, queued there would run
only after every step the engine queued before it, and its wait for its own work would wait for theirs. So each
thread also takes a stream of its own (torch's pool streams do not wait for the default one). Nothing glm-pd
reads needs the engine's stream order: it reads pages only after their ready event completed (prefill's grant and
stream steps, SGLang's chunk events), and decode counts a load only after its scatter was waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.regions import Region

ThreadSetup = Callable[[], None]  # run once at the start of each thread glm-pd starts, before any other call


def host_only() -> None:
    """The setup of a rank whose caches are host memory: its threads make no CUDA call."""


def thread_device(regions: Iterable[Region], torch: Any) -> ThreadSetup:
    """The setup that puts a glm-pd thread on the regions' CUDA device and a stream of its own there, through the
    engine's ``torch`` (the core imports none). A rank's caches all live on one device; regions spread over several
    are refused by name."""
    devices = sorted({r.device_id for r in regions if r.mem_kind == "VRAM"})
    if not devices:
        return host_only
    if len(devices) > 1:
        raise ConfigError(f"this rank's caches sit on CUDA devices {devices}; glm-pd serves one device per rank")
    device = devices[0]

    def on_device() -> None:
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))

    return on_device

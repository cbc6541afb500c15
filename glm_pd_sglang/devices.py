"""The RDMA devices of one rank, read from SGLang's ``--disaggregation-ib-device``."""

from __future__ import annotations

from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu

from glm_pd_common.errors import ConfigError


def rank_ib_devices(ib_device: str | None, gpu_id: int) -> str:
    """The devices for GPU ``gpu_id``, comma separated; empty lets the transport find them.

    The flag holds a device list every GPU shares, a JSON map from GPU id to devices, or the path of a ``.json``
    file holding that map. SGLang's own resolver reads it, so a map names the same NICs for glm-pd as for
    SGLang's Mooncake and NIXL backends; handed through raw, a map would match no device. A map that does not
    parse, or has no entry for this GPU, is refused.
    """
    try:
        devices = get_ib_devices_for_gpu(ib_device, gpu_id)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"--disaggregation-ib-device {ib_device!r} (GPU {gpu_id}): {exc}") from exc
    return ",".join(name.strip() for name in (devices or "").split(",") if name.strip())

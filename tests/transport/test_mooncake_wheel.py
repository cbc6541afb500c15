"""The Mooncake wheel must match the memory it registers (issue 15 item 5).

``mooncake-transfer-engine-non-cuda`` (what these venvs install: no CUDA here) cannot register GPU memory, and on a
GPU node that surfaces late, as a failed registration. GPU regions are now refused before anything is registered,
naming the wheel and the command that fixes it; ``glm-pd doctor`` says the same where GPUs are visible.
"""

import numpy as np
import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_common.tools.doctor import check_mooncake_wheel
from glm_pd_common.transport.base import Span, TransportConfig
from glm_pd_common.transport.factory import create_transport
from glm_pd_common.transport.mooncake import CUDA_WHEEL, HOST_WHEEL, gpu_memory_refusal, installed_wheel

pytest.importorskip("mooncake")


def test_these_venvs_carry_the_host_only_wheel() -> None:
    wheel = installed_wheel()
    assert wheel is not None and wheel[0] == HOST_WHEEL, wheel


def test_gpu_regions_are_refused_before_registration_with_the_fix() -> None:
    version = installed_wheel()[1]
    transport = create_transport("mc-wheel", TransportConfig(backend="mooncake", allow_tcp=True, timeout_s=5))
    host = np.zeros(1 << 16, dtype=np.uint8)
    try:
        spans = [Span("meta", host.ctypes.data, 4096, "DRAM", 0), Span("kv", host.ctypes.data + 8192, 8192, "VRAM", 3)]
        with pytest.raises(ConfigError) as refused:
            transport.register(spans)
        message = str(refused.value)
        assert "region kv is VRAM" in message
        assert f"pip uninstall -y {HOST_WHEEL} && pip install {CUDA_WHEEL}=={version}" in message
        assert transport._registered == []  # nothing half-registered
        transport.register(spans[:1])  # host memory is fine with this wheel
        assert transport._registered == [host.ctypes.data]
    finally:
        transport.close()


def test_doctor_fails_the_host_only_wheel_where_gpus_are_visible() -> None:
    wheel = (HOST_WHEEL, "0.3.13.post1")
    on_gpus = check_mooncake_wheel(wheel, gpus_visible=True)
    assert on_gpus.status == "FAIL"
    assert on_gpus.fix == gpu_memory_refusal(wheel)
    assert "install mooncake-transfer-engine==0.3.13.post1" in on_gpus.fix
    here = check_mooncake_wheel(wheel, gpus_visible=False)
    assert "host memory only" in here.detail
    assert gpu_memory_refusal((CUDA_WHEEL, "0.3.13.post1")) is None

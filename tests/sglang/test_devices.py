"""Per-rank device facts glm-pd reads from SGLang: the GPU's RDMA devices from ``--disaggregation-ib-device``,
and the indexer scale encoding SGLang writes on the GPU's capability."""

import json
from pathlib import Path

import pytest
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.platforms.device_mixin import DeviceCapability  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.utils.common import get_device_capability  # noqa: E402

from glm_pd_common.errors import ConfigError  # noqa: E402
from glm_pd_sglang.config import GlmPdSglangConfig  # noqa: E402
from glm_pd_sglang.devices import rank_ib_devices  # noqa: E402
from glm_pd_sglang.model import scale_format  # noqa: E402


def ib_device_arg(tiny_model: str, value: str) -> str:
    """``--disaggregation-ib-device`` as SGLang's own argument handling leaves it for the glm-pd backend."""
    args = prepare_server_args(
        ["--model-path", tiny_model, "--device", "cpu", "--disaggregation-mode", "prefill",
         "--disaggregation-transfer-backend", "glm-pd", "--page-size", "64", "--disaggregation-ib-device", value]
    )  # fmt: skip
    return str(args.disaggregation_ib_device)


def test_a_plain_list_serves_every_gpu(tiny_model: str) -> None:
    value = ib_device_arg(tiny_model, "mlx5_0,mlx5_1")
    assert [rank_ib_devices(value, gpu) for gpu in (0, 7)] == ["mlx5_0,mlx5_1", "mlx5_0,mlx5_1"]


def test_an_inline_map_gives_each_gpu_its_own(tiny_model: str) -> None:
    value = ib_device_arg(tiny_model, '{"0": "mlx5_0, mlx5_1", "1": "mlx5_2"}')
    assert rank_ib_devices(value, 0) == "mlx5_0,mlx5_1"
    assert rank_ib_devices(value, 1) == "mlx5_2"


def test_a_map_in_a_json_file(tiny_model: str, tmp_path: Path) -> None:
    path = tmp_path / "nics.json"
    path.write_text(json.dumps({str(gpu): f"mlx5_{gpu}" for gpu in range(8)}))
    value = ib_device_arg(tiny_model, str(path))
    assert [rank_ib_devices(value, gpu) for gpu in (0, 5)] == ["mlx5_0", "mlx5_5"]


def test_no_flag_leaves_the_choice_to_the_transport() -> None:
    assert rank_ib_devices(None, 0) == ""


def test_a_map_without_this_gpu_is_refused(tiny_model: str) -> None:
    value = ib_device_arg(tiny_model, '{"0": "mlx5_0", "1": "mlx5_1"}')
    with pytest.raises(ConfigError, match=r"\(GPU 2\): No IB devices configured for GPU 2. Available GPUs: \[0, 1\]"):
        rank_ib_devices(value, 2)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"0": mlx5_0}', "Invalid JSON mapping"),
        ('{"gpu0": "mlx5_0"}', "keys must be integers"),
        ('{"0": ["mlx5_0"]}', "values must be strings"),
    ],
)
def test_a_malformed_inline_map_is_refused(tiny_model: str, text: str, needle: str) -> None:
    value = ib_device_arg(tiny_model, text)
    with pytest.raises(ConfigError, match=needle) as err:
        rank_ib_devices(value, 0)
    assert "--disaggregation-ib-device" in str(err.value)


def test_a_malformed_or_missing_json_file_is_refused(tiny_model: str, tmp_path: Path) -> None:
    bad = tmp_path / "nics.json"
    bad.write_text('{"0": "mlx5_0",')
    value = ib_device_arg(tiny_model, str(bad))
    with pytest.raises(ConfigError, match=f"Failed to parse JSON content from file {bad}"):
        rank_ib_devices(value, 0)
    with pytest.raises(ConfigError, match="does not exist"):
        rank_ib_devices(str(tmp_path / "absent.json"), 0)


def config(configured: str = "") -> GlmPdSglangConfig:
    return GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_INDEXER_SCALE_FORMAT": configured} if configured else {})


@pytest.mark.parametrize(
    ("device", "capability"),
    [
        ("cuda", DeviceCapability(9, 0)),  # H100 / H200
        ("cuda", DeviceCapability(10, 0)),  # B200: SGLang, unlike vLLM, stores fp32 here too
        ("cuda", DeviceCapability(10, 3)),  # B300
        ("cuda", DeviceCapability(12, 0)),  # RTX PRO 6000 / DGX Spark class
        ("cpu", (None, None)),
    ],
)
def test_sglang_writes_fp32_indexer_scales_on_every_device(device: str, capability) -> None:
    assert scale_format(config(), device, capability) == "fp32"
    assert scale_format(config("fp32"), device, capability) == "fp32"


@pytest.mark.parametrize("capability", [DeviceCapability(10, 0), DeviceCapability(12, 0), DeviceCapability(9, 0)])
def test_a_configured_scale_format_the_device_contradicts_is_refused(capability: DeviceCapability) -> None:
    sm = f"SM{capability.to_int()}"
    with pytest.raises(ConfigError, match=rf"configured 'ue8m0x4', but SGLang writes 'fp32' .*\(CUDA {sm}\)"):
        scale_format(config("ue8m0x4"), "cuda", capability)


def test_the_capability_as_sglang_reads_it_for_the_rank_gpu() -> None:
    """SGLang's own probe answers ``(None, None)`` where it finds no CUDA device: a CUDA rank is then refused
    rather than guessed; with a GPU, its real capability gives fp32."""
    capability = get_device_capability(0)
    if capability[0] is None:
        with pytest.raises(ConfigError, match="cannot read the CUDA device capability"):
            scale_format(config(), "cuda", capability)
    else:
        assert scale_format(config(), "cuda", capability) == "fp32"
    assert scale_format(config(), "cpu", capability) == "fp32"

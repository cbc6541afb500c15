"""Per-rank facts glm-pd reads from SGLang: each GPU's RDMA devices from ``--disaggregation-ib-device``."""

import json
from pathlib import Path

import pytest
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.server_args import prepare_server_args  # noqa: E402

from glm_pd_common.errors import ConfigError  # noqa: E402
from glm_pd_sglang.devices import rank_ib_devices  # noqa: E402


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

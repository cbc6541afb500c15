"""The entry point: SGLang's own ``load_plugins`` makes ``glm-pd`` a backend and leaves the others alone."""

import os
import subprocess
import sys

import pytest
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager  # noqa: E402
from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver  # noqa: E402
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from glm_pd_sglang import conn, endpoints, plugin  # noqa: E402


def test_backend_resolves_to_glm_pd_classes() -> None:
    backend = TransferBackend("glm-pd")
    assert backend is TransferBackend.GLM_PD
    assert get_kv_class(backend, KVClassType.MANAGER) is conn.GlmPdKVManager
    assert get_kv_class(backend, KVClassType.SENDER) is endpoints.GlmPdKVSender
    assert get_kv_class(backend, KVClassType.RECEIVER) is endpoints.GlmPdKVReceiver
    assert get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER) is endpoints.GlmPdKVBootstrapServer
    # KVArgs stays SGLang's own: the scheduler fills it, glm-pd reads it.
    assert get_kv_class(backend, KVClassType.KVARGS).__module__ == "sglang.srt.disaggregation.base.conn"


def test_other_backends_unchanged_and_hooks_reach_importers() -> None:
    assert get_kv_class(TransferBackend("mooncake"), KVClassType.MANAGER) is MooncakeKVManager
    assert get_kv_class(TransferBackend("nixl"), KVClassType.RECEIVER) is NixlKVReceiver
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill

    # prefill.py and decode.py bound get_kv_class by name at import; they see the hooked one.
    assert prefill.get_kv_class(TransferBackend.GLM_PD, KVClassType.SENDER) is endpoints.GlmPdKVSender
    assert decode.get_kv_class(TransferBackend.GLM_PD, KVClassType.RECEIVER) is endpoints.GlmPdKVReceiver
    with pytest.raises(ValueError):
        TransferBackend("glm-pdx")


def test_register_is_idempotent() -> None:
    before = list(TransferBackend)
    plugin.register()
    plugin.register()
    assert list(TransferBackend) == before
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES

    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("glm-pd") == 1
    assert get_kv_class(TransferBackend.GLM_PD, KVClassType.MANAGER) is conn.GlmPdKVManager


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_server_args_accept_the_flag(mode: str, tiny_model: str) -> None:
    args = prepare_server_args(
        ["--model-path", tiny_model, "--device", "cpu", "--disaggregation-mode", mode,
         "--disaggregation-transfer-backend", "glm-pd", "--page-size", "64"]
    )  # fmt: skip
    assert args.disaggregation_transfer_backend == "glm-pd"
    assert TransferBackend(args.disaggregation_transfer_backend) is TransferBackend.GLM_PD


@pytest.mark.parametrize(("plugins", "resolves"), [("glm_pd", True), ("someone_else", False), ("", True)])
def test_sglang_plugins_filter(plugins: str, resolves: bool) -> None:
    """SGLANG_PLUGINS whitelists entry-point names; glm-pd's is ``glm_pd`` (a fresh process each time)."""
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.disaggregation.utils import TransferBackend\n"
        "try:\n    TransferBackend('glm-pd'); print('RESOLVED')\nexcept ValueError:\n    print('UNKNOWN')\n"
    )
    env = {**os.environ, "SGLANG_PLUGINS": plugins}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert ("RESOLVED" if resolves else "UNKNOWN") in out.stdout, out.stderr[-2000:]

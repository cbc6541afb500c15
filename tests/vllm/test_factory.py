"""GlmPdConnector resolves through vLLM's own factory, by module path and by the plugin entry point."""

import pytest
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.v1.kv_cache_interface import KVCacheConfig

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.prefill.caps import PeerCaps
from glm_pd_vllm.config import GlmPdVllmConfig
from glm_pd_vllm.connector import GlmPdConnector
from glm_pd_vllm.plugin import register


def make_config(model, role="kv_producer", module_path="glm_pd_vllm.connector", extra=None):
    kv = KVTransferConfig(
        kv_connector="GlmPdConnector",
        kv_connector_module_path=module_path,
        kv_role=role,
        kv_connector_extra_config=extra or {"allow_tcp": True},
    )
    return VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, enforce_eager=True),
        cache_config=CacheConfig(block_size=64, cache_dtype="fp8"),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv,
    )


def kv_cache_config():
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[])


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_module_path_route_builds_the_scheduler_connector(tiny_model, role):
    config = make_config(tiny_model, role)
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is GlmPdConnector
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert isinstance(conn, GlmPdConnector) and supports_hma(conn)
    assert conn._scheduler.is_producer == (role == "kv_producer")
    assert conn._scheduler.is_consumer == (role == "kv_consumer")


def test_plugin_route_is_idempotent(tiny_model):
    register()
    register()  # vLLM loads plugins in every process; a second registration must not raise
    config = make_config(tiny_model, module_path=None)
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is GlmPdConnector


def test_unknown_extra_key_is_an_error(tiny_model):
    config = make_config(tiny_model, extra={"allow_tcp": True, "side_chanel_port": 1})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['side_chanel_port'\]"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_wrong_type_is_an_error(tiny_model):
    config = make_config(tiny_model, extra={"lease_s": "long"})
    with pytest.raises(ConfigError, match="lease_s"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_idle_wait_is_a_bounded_setting():
    """A negative wait is refused by name; a wait near the lease's renewal interval would starve renewals,
    which the scheduler sends with the steps: the worker waits at most half of it."""
    with pytest.raises(ConfigError, match=r"\['idle_wait_s'\] must be 0 or more, got -1.0"):
        GlmPdVllmConfig.from_extra({"idle_wait_s": -1.0})
    assert GlmPdVllmConfig.from_extra({"idle_wait_s": 0}).idle_wait_s == 0.0


def test_kv_both_is_refused(tiny_model):
    config = make_config(tiny_model, role="kv_both")
    with pytest.raises(ConfigError, match="kv_role must be kv_producer"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_prefill_caps_are_settings():
    caps = GlmPdVllmConfig.from_extra({"caps": {"peers": 64, "early_claims": 8}}).caps
    assert (caps.peers, caps.early_claims) == (64, 8) and caps.subscriptions == PeerCaps().subscriptions
    with pytest.raises(ConfigError, match=r"unknown cap\(s\) \['peer'\]"):
        GlmPdVllmConfig.from_extra({"caps": {"peer": 64}})
    with pytest.raises(ConfigError, match="cap on early_pages must be an integer of at least 1"):
        GlmPdVllmConfig.from_extra({"caps": {"early_pages": 0}})
    with pytest.raises(ConfigError, match=r"\['caps'\] must be an object"):
        GlmPdVllmConfig.from_extra({"caps": 5})

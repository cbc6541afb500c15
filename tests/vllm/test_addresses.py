"""Each prefill rank's published address: what a node may bind, and the relay from the workers' metadata."""

from __future__ import annotations

import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_vllm.addresses import RankAddress, check_bindable, rank_hosts
from glm_pd_vllm.config import HOST_ENV, GlmPdVllmConfig


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "10.0.0.7", "node-a.cluster"])
def test_any_dialable_host_is_accepted_on_one_node(host: str) -> None:
    check_bindable(host, nodes=1)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_is_refused_naming_the_fix(host: str) -> None:
    with pytest.raises(ConfigError, match=HOST_ENV):
        check_bindable(host, nodes=1)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_is_refused_when_the_instance_spans_nodes(host: str) -> None:
    with pytest.raises(ConfigError, match="spans 2 nodes"):
        check_bindable(host, nodes=2)
    check_bindable("10.0.0.7", nodes=2)


def test_the_relay_orders_hosts_by_rank_and_refuses_gaps_and_stray_ports() -> None:
    published = {1: RankAddress(1, "10.0.0.2", 5711), 0: RankAddress(0, "10.0.0.1", 5710)}
    assert rank_hosts(published, 2, 5710) == ("10.0.0.1", "10.0.0.2")
    with pytest.raises(ConfigError, match=r"TP rank\(s\) \[1\] of 2"):
        rank_hosts({0: published[0]}, 2, 5710)
    with pytest.raises(ConfigError, match="at port 5799, not port 5711"):
        rank_hosts({**published, 1: RankAddress(1, "10.0.0.2", 5799)}, 2, 5710)


def test_a_node_names_its_own_address_in_the_environment() -> None:
    extra = {"side_channel_host": "10.0.0.1"}
    assert GlmPdVllmConfig.from_extra(extra, env={}).side_channel_host == "10.0.0.1"
    assert GlmPdVllmConfig.from_extra(extra, env={HOST_ENV: " 10.0.0.2 "}).side_channel_host == "10.0.0.2"

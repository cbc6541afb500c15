"""Prefill's table of accepted decode registrations (glm_pd_sglang/registrations.py): who may replace an entry,
and who makes way past the cap. The pair-level case (an impostor on a real prefill rank) is in
test_authenticated.py."""

from __future__ import annotations

import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_sglang import wire
from glm_pd_sglang.config import GlmPdSglangConfig
from glm_pd_sglang.registrations import Registrations, agent_name

REG = wire.Registration(b"hello", "127.0.0.1", 1, 0, [])


def test_only_the_same_proof_replaces_a_registered_agent() -> None:
    table = Registrations(cap=4)
    table.add("a", REG, b"p" * 32)
    assert table.impostor("a", b"p" * 32) == ""  # the same process registering again (after a resume)
    assert "cannot prove to be it replaces nothing" in table.impostor("a", b"q" * 32)
    assert table.impostor("a", b"") != ""  # no proof proves nothing
    assert table.impostor("b", b"") == ""  # a new agent has nothing to prove


def test_past_the_cap_the_least_recently_used_idle_agent_makes_way() -> None:
    table = Registrations(cap=2)
    table.add("old", REG, b"1")
    table.add("new", REG, b"2")
    table.touch("old")  # a room named it since: "new" is now the least recently used
    assert table.make_way("third", set()) == ("new", "")
    assert table.make_way("third", {"new"}) == ("old", "")  # a room waits for "new": it stays
    evict, why = table.make_way("third", {"new", "old"})
    assert evict is None and "at most 2 decode ranks" in why
    assert table.make_way("old", {"new", "old"}) == (None, "")  # a registered agent needs no room


def test_agent_names_differ_per_process_at_one_address() -> None:
    names = {agent_name("decode", "10.0.0.1", 5000) for _ in range(8)}
    assert len(names) == 8 and all(n.startswith("glmpd-decode-10.0.0.1-5000-") for n in names)


def test_the_caps_are_settings() -> None:
    assert GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_DECODE_PEERS": "8"}).decode_peers == 8
    with pytest.raises(ConfigError, match="SGLANG_GLM_PD_DECODE_PEERS must be at least 1, got 0"):
        GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_DECODE_PEERS": "0"})
    with pytest.raises(ConfigError, match="must be an integer, got 'many'"):
        GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_DECODE_PEERS": "many"})
    assert GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_CONNECTIONS": "64"}).connections == 64
    with pytest.raises(ConfigError, match="SGLANG_GLM_PD_CONNECTIONS must be at least 1, got -1"):
        GlmPdSglangConfig.from_env({"SGLANG_GLM_PD_CONNECTIONS": "-1"})

"""Hostile ``kv_transfer_params``: decode's scheduler refuses them by key and fails the load, never crashes.

The params come from the router (or anyone who can send decode a request): arbitrary JSON.
``KvTransferParams.decode`` must turn them into the typed struct or raise ConfigError naming the key; the
scheduler must turn a refusal into a failed load that vLLM's failure policy handles, not an exception in its
step loop. Expected outcomes are written from the generated input, never from the decoder itself.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.handoff.wire.sidechannel import SideChannelClient
from glm_pd_common.handoff.wire.trust import Trust
from glm_pd_common.layout.pages import num_pages_for
from glm_pd_common.layout.tp import SUPPORTED_TP
from glm_pd_vllm.params import MAX_BLOCKS, KvTransferParams

INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
BLOCK = 64
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KEYS = [
    "glm_pd_protocol",
    "remote_num_tokens",
    "remote_page_tokens",
    "remote_token_shards",
    "remote_interleave",
    "remote_block_ids",
    "remote_port",
    "tp_size",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
]
GOOD = {  # a real prefill's params for a 100-token prompt in 64-token blocks
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "glm_pd_protocol": PROTOCOL_VERSION,
    "remote_engine_id": "P",
    "remote_request_id": "r",
    "remote_host": "127.0.0.1",
    "remote_port": 5710,
    "tp_size": 1,
    "remote_block_ids": [0, 1],
    "remote_num_tokens": 100,
    "remote_page_tokens": 64,
    "remote_token_shards": 1,
    "remote_interleave": 1,
    "remote_hosts": [],  # every rank on remote_host (one node)
}

json_ints = st.one_of(
    st.integers(-3, 300),
    st.integers(INT64_MIN, UINT64_MAX),
    st.sampled_from([0, 1, 65535, 65536, INT64_MAX, INT64_MAX + 1, UINT64_MAX]),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), json_ints, st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12,
)


@st.composite
def valid_params(draw: st.DrawFn, num_tokens: int | None = None) -> dict[str, Any]:
    """What a prefill's request_finished returns (plus keys vLLM and the router add, which decode ignores)."""
    page_tokens = draw(st.sampled_from([16, 32, 64, 128]))
    tp_size = draw(st.sampled_from(SUPPORTED_TP))
    token_shards = draw(st.sampled_from([n for n in SUPPORTED_TP if tp_size % n == 0]))  # vLLM's DCP size
    interleave = draw(st.sampled_from([i for i in (1, 2, 8, 16, 64, 128) if page_tokens % i == 0]))
    num_tokens = num_tokens or draw(st.integers(1, 2000))
    need = num_pages_for(num_tokens, page_tokens * token_shards)  # one DCP block spans page_tokens x shards
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "glm_pd_protocol": PROTOCOL_VERSION,
        "remote_engine_id": draw(st.text(min_size=1, max_size=20)),
        "remote_request_id": draw(st.text(min_size=1, max_size=20)),
        "remote_host": draw(st.sampled_from(["10.0.0.1", "127.0.0.1", "::1", "prefill-0"])),
        "remote_port": draw(st.integers(1, 65535)),
        "tp_size": tp_size,
        "remote_block_ids": draw(st.lists(st.integers(0, INT64_MAX), min_size=need, max_size=need)),
        "remote_num_tokens": num_tokens,
        "remote_page_tokens": page_tokens,
        "remote_token_shards": token_shards,
        "remote_interleave": interleave,
    }
    for _ in range(draw(st.integers(0, 2))):  # e.g. vLLM's remote_prefill_cached_tokens, the router's own
        params[draw(st.text(max_size=10).filter(lambda k: k not in params))] = draw(json_values)
    return params


def bad_value(key: str) -> st.SearchStrategy[Any]:
    """Values that are wrong for ``key`` on their own (whatever the other keys say)."""
    not_int = json_values.filter(lambda v: type(v) is not int)
    if key == "glm_pd_protocol":
        return st.one_of(not_int, json_ints.filter(lambda v: v != PROTOCOL_VERSION), st.just(True))
    if key in ("remote_num_tokens", "remote_page_tokens"):
        return st.one_of(not_int, st.integers(INT64_MIN, 0), st.integers(INT64_MAX + 1, UINT64_MAX), st.just(True))
    if key == "remote_port":
        return st.one_of(not_int, st.integers(INT64_MIN, 0), st.integers(65536, UINT64_MAX), st.just(True))
    if key == "tp_size":
        return st.one_of(not_int, json_ints.filter(lambda v: v not in SUPPORTED_TP), st.just(True))
    if key == "remote_token_shards":  # divides no supported TP size
        return st.one_of(not_int, json_ints.filter(lambda v: v not in SUPPORTED_TP), st.just(True))
    if key == "remote_interleave":  # divides no page of 16 to 128 tokens
        return st.one_of(not_int, json_ints.filter(lambda v: v < 1 or 128 % v), st.just(True))
    if key == "remote_block_ids":
        return st.one_of(
            json_values.filter(lambda v: not isinstance(v, list)),
            st.lists(st.one_of(st.booleans(), st.floats(), st.text(), st.none()), min_size=1, max_size=3),
            st.lists(st.integers(INT64_MIN, -1), min_size=1, max_size=2),
            st.lists(st.integers(INT64_MAX + 1, UINT64_MAX + 10), min_size=1, max_size=2),
            st.lists(st.lists(st.integers(0, 9), max_size=3), min_size=1, max_size=2),  # nested: one flat list only
        )
    return st.one_of(
        json_values.filter(lambda v: not isinstance(v, str)), st.just(""), st.text(min_size=257, max_size=300)
    )


def check_decoded(params: dict[str, Any], out: KvTransferParams) -> None:
    """A decoded struct is exactly typed and says what the input said."""
    assert type(out) is KvTransferParams and out.glm_pd_protocol == PROTOCOL_VERSION
    for key in ("remote_num_tokens", "remote_page_tokens", "remote_token_shards", "remote_interleave"):
        assert type(getattr(out, key)) is int and getattr(out, key) == params[key]
    for key in ("remote_port", "tp_size"):
        assert type(getattr(out, key)) is int and getattr(out, key) == params[key]
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        assert type(getattr(out, key)) is str and getattr(out, key) == params[key]
    assert 1 <= out.remote_port <= 65535 and out.tp_size in SUPPORTED_TP and out.remote_num_tokens >= 1
    ids = out.remote_block_ids
    assert type(ids) is list and all(type(b) is int and 0 <= b <= INT64_MAX for b in ids)
    assert ids == params["remote_block_ids"]
    span = params["remote_page_tokens"] * params["remote_token_shards"]
    assert len(ids) == -(-params["remote_num_tokens"] // span)


@settings(max_examples=200, deadline=None)
@given(params=valid_params())
def test_valid_params_decode_to_exact_types(params) -> None:
    """The converse of the refusals: what a real prefill sends always decodes, to exact types."""
    check_decoded(params, KvTransferParams.decode(params))


@settings(max_examples=200, deadline=None)
@given(params=valid_params())
def test_what_prefill_encodes_survives_json_and_decodes_to_the_same_struct(params) -> None:
    """Prefill's side: the struct becomes a JSON object with vLLM's routing keys, and decodes back to itself."""
    sent = KvTransferParams(**{k: params[k] for k in KEYS if k != "glm_pd_protocol"})
    wire = json.loads(json.dumps(sent.encode()))
    assert wire["do_remote_prefill"] is True and wire["do_remote_decode"] is False
    assert wire["glm_pd_protocol"] == PROTOCOL_VERSION
    assert {k: wire[k] for k in KEYS} == {k: params[k] for k in KEYS}
    assert KvTransferParams.decode(wire) == sent


@settings(max_examples=200, deadline=None)
@given(params=valid_params(), key=st.sampled_from(KEYS), data=st.data())
def test_one_bad_or_missing_key_is_refused_naming_it(params, key, data) -> None:
    """One key wrong or missing in otherwise good params: the error names that key."""
    if data.draw(st.booleans()):
        del params[key]
    else:
        params[key] = data.draw(bad_value(key))
    with pytest.raises(ConfigError, match=key):
        KvTransferParams.decode(params)


@settings(max_examples=200, deadline=None)
@given(
    params=st.one_of(
        st.dictionaries(st.sampled_from(KEYS), json_values, max_size=9),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), json_values, max_size=10),
        json_values,
    )
)
def test_arbitrary_json_is_decoded_or_refused_by_key(params) -> None:
    """Anything JSON can say: the typed struct, or ConfigError naming one of the keys. Never another exception."""
    try:
        out = KvTransferParams.decode(params)
    except ConfigError as exc:
        assert "kv_transfer_params" in str(exc)
        assert not isinstance(params, dict) or any(k in str(exc) for k in KEYS), str(exc)
        return
    check_decoded(params, out)


@pytest.mark.parametrize("version", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 0, UINT64_MAX])
def test_another_protocol_version_is_refused_naming_both(version) -> None:
    """Params from a prefill of another glm-pd version: refused before any field is read, both versions named."""
    params = {**GOOD, "glm_pd_protocol": version, "remote_block_ids": "not even a list"}
    with pytest.raises(ConfigError, match=rf"'glm_pd_protocol'\] is {version}; this decode speaks {PROTOCOL_VERSION}"):
        KvTransferParams.decode(params)


@pytest.mark.parametrize("version", [None, True, float(PROTOCOL_VERSION), str(PROTOCOL_VERSION)])
def test_a_missing_or_non_integer_version_is_refused(version) -> None:
    """No version (a prefill before versioned params) or one of another type: refused, this side's named."""
    params = dict(GOOD) if version is None else {**GOOD, "glm_pd_protocol": version}
    if version is None:
        del params["glm_pd_protocol"]
    with pytest.raises(ConfigError, match=rf"glm_pd_protocol.*speaks {PROTOCOL_VERSION}\), got {version!r}"):
        KvTransferParams.decode(params)


@settings(max_examples=100, deadline=None)
@given(
    params=valid_params(),
    flip=st.sampled_from(
        [
            "remote_num_tokens",
            "remote_page_tokens",
            "remote_token_shards",
            "remote_interleave",
            "remote_port",
            "tp_size",
        ]
    ),
)
def test_bools_are_not_ints(params, flip) -> None:
    """JSON true is not 1: a bool where an integer belongs is refused (Python would compare it equal)."""
    params[flip] = True
    with pytest.raises(ConfigError, match=flip):
        KvTransferParams.decode(params)


def test_block_lists_past_the_cap_are_refused_without_a_scan() -> None:
    """4M+1 ids ending in a non-integer: refused by length, so no element was looked at before the refusal
    (the remote cannot make decode walk an arbitrarily long list)."""
    params = {**GOOD, "remote_block_ids": [0] * MAX_BLOCKS + ["x"]}
    with pytest.raises(ConfigError) as err:
        KvTransferParams.decode(params)
    assert f"'remote_block_ids']: Expected `array` of length <= {MAX_BLOCKS}, got a list of {MAX_BLOCKS + 1}" in str(
        err.value
    )
    assert "non-integer" not in str(err.value)


@settings(max_examples=200, deadline=None)
@given(
    params=valid_params(),
    host=st.one_of(
        st.text(max_size=30),
        st.from_regex(r"[a-z0-9.:\[\]*_ -]{1,20}", fullmatch=True),
        st.sampled_from(["*", "a b", "\x00", "tcp://x", "host;rm", "[::1]", "::1", "10.0.0.1", "prefill-0.svc"]),
    ),
)
def test_an_accepted_host_is_one_the_side_channel_can_connect_to(params, host) -> None:
    """Decode connects to whatever remote_host says: one zmq cannot parse must be a ConfigError here, not a
    ZMQError out of the decode service (which fails the load as an internal error, outside the abort path)."""
    params["remote_host"] = host
    try:
        out = KvTransferParams.decode(params)
    except ConfigError as exc:
        assert "remote_host" in str(exc)
        return
    SideChannelClient(out.remote_host, out.remote_port, Trust(insecure=True)).close()  # zmq's parse, not trust's


@pytest.mark.parametrize("bad", [-1, INT64_MAX + 1, UINT64_MAX, 1 << 80])
def test_block_ids_outside_int64_are_refused_by_value(bad) -> None:
    """An id past int64 would overflow np.asarray(..., int64) later, not be refused: it is refused here, as sent."""
    params = {**GOOD, "remote_block_ids": [0, bad]}
    with pytest.raises(ConfigError, match=rf"holds block id {bad}, outside 0\.\.{INT64_MAX}"):
        KvTransferParams.decode(params)


@pytest.mark.parametrize("tp", [0, 3, 6, 32, UINT64_MAX])
def test_unsupported_tp_is_refused(tp) -> None:
    """A TP size the rank mapping cannot serve is refused here, not inside the decode service."""
    with pytest.raises(ConfigError, match=re.escape(f"'tp_size'] must be one of {SUPPORTED_TP}, got {tp}")):
        KvTransferParams.decode({**GOOD, "tp_size": tp})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tp_size": 4, "remote_token_shards": 8}, "'remote_token_shards'] 8 must divide tp_size 4"),
        ({"remote_interleave": 128}, "'remote_interleave'] 128 must divide remote_page_tokens 64"),
        ({"remote_num_tokens": 10000}, "2 remote_block_ids for 10000 tokens in blocks of 64 (need 157)"),
        (
            {"tp_size": 8, "remote_token_shards": 8, "remote_num_tokens": 10000, "remote_block_ids": [0] * 157},
            "157 remote_block_ids for 10000 tokens in blocks of 64 x 8 token shards (need 20)",
        ),
    ],
)
def test_a_sharding_the_block_ids_contradict_is_refused_naming_it(change, message) -> None:
    """Prefill's DCP size and interleave are checked against its TP size, its blocks and the block count: one
    block id of a DCP-N prefill spans N blocks' worth of tokens."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        KvTransferParams.decode({**GOOD, **change})


def test_dcp_params_decode_to_prefill_sharding() -> None:
    """A DCP-8 prefill's 10,000 tokens in blocks of 64 are 20 block ids of 512 tokens each."""
    params = {**GOOD, "tp_size": 8, "remote_token_shards": 8, "remote_interleave": 16, "remote_num_tokens": 10000}
    out = KvTransferParams.decode({**params, "remote_block_ids": list(range(20))})
    assert (out.remote_token_shards, out.remote_interleave, len(out.remote_block_ids)) == (8, 16, 20)


def test_prefill_does_not_build_params_decode_would_refuse() -> None:
    """The struct's checks run where prefill builds it too (request_finished then frees instead of publishing)."""
    fields = {k: GOOD[k] for k in KEYS if k != "glm_pd_protocol"}
    with pytest.raises(ConfigError, match="3 remote_block_ids for 100 tokens in blocks of 64"):
        KvTransferParams(**{**fields, "remote_block_ids": [0, 1, 2]})
    with pytest.raises(ConfigError, match="remote_host"):
        KvTransferParams(**{**fields, "remote_host": "tcp://x"})
    with pytest.raises(ConfigError, match=r"kv_transfer_params\['remote_hosts'\] is not an IP address"):
        KvTransferParams(**{**fields, "remote_hosts": ["tcp://x"]})
    with pytest.raises(ConfigError, match="names 2 hosts for tp_size 1"):
        KvTransferParams(**{**fields, "remote_hosts": ["10.0.0.1", "10.0.0.2"]})
    assert msgspec.to_builtins(KvTransferParams(**fields)) == GOOD


# -- the scheduler: hostile params on a real vLLM Request --------------------------------------------
@pytest.fixture(scope="module")
def scheduler(tiny_model):
    """Decode's scheduler-side GlmPdConnector, built by vLLM's factory from a real VllmConfig."""
    kv = KVTransferConfig(
        kv_connector="GlmPdConnector",
        kv_connector_module_path="glm_pd_vllm.connector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"allow_tcp": True},
    )
    config = VllmConfig(
        model_config=ModelConfig(model=tiny_model, skip_tokenizer_init=True, enforce_eager=True),
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype="fp8"),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv,
    )
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[])
    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache)


# vLLM itself refuses extra_args integers outside [-2**63, 2**64): those never reach a connector.
engine_ints = st.integers(INT64_MIN, UINT64_MAX)
engine_json = st.recursive(
    st.one_of(st.none(), st.booleans(), engine_ints, st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12,
)


@st.composite
def hostile_params(draw: st.DrawFn, num_tokens: int) -> tuple[dict[str, Any], set[str] | None]:
    """A real prefill's params for this prompt with 0-3 keys made hostile or dropped, or arbitrary JSON
    without one required key. Returns the params and the keys a refusal may name (None: a valid load)."""
    if draw(st.integers(0, 4)) == 0:
        params = draw(st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), engine_json))
        params.pop("remote_request_id", None)  # so it can never be valid by chance
        bad: set[str] | None = set(KEYS)
    else:
        params = draw(valid_params(num_tokens))
        bad = draw(st.sets(st.sampled_from(KEYS), max_size=3)) or None
        for key in bad or ():
            if draw(st.booleans()):
                params.pop(key)
            else:
                params[key] = draw(bad_value(key).filter(lambda v: _engine_ok(v)))
    params["do_remote_prefill"] = True
    return params, bad


def _engine_ok(value: Any) -> bool:
    """Would vLLM's SamplingParams accept this value in extra_args (ints within msgpack's range)?"""
    if isinstance(value, bool) or not isinstance(value, (int, list, dict)):
        return True
    if isinstance(value, int):
        return INT64_MIN <= value <= UINT64_MAX
    return all(_engine_ok(v) for v in (value.values() if isinstance(value, dict) else value))


_ids = iter(range(1 << 30))


@FUZZ
@given(data=st.data(), num_tokens=st.integers(1, 600), prefix_blocks=st.integers(0, 3))
def test_hostile_params_become_a_failed_load_not_an_exception(scheduler, data, num_tokens, prefix_blocks) -> None:
    """get_num_new_matched_tokens and update_state_after_alloc never raise; the load is queued with its error."""
    params, bad = data.draw(hostile_params(num_tokens))
    sent = json.loads(json.dumps(params))  # what the router sent, before the scheduler touches the dict
    prefix = min(prefix_blocks * BLOCK, (num_tokens - 1) // BLOCK * BLOCK)  # a block-aligned local hit
    request_id = f"fuzz-{next(_ids)}"
    request = Request(
        request_id,
        list(range(num_tokens)),
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
        None,
    )
    count, is_async = scheduler.get_num_new_matched_tokens(request, prefix)
    assert (count, is_async) == (num_tokens - prefix, True)
    local = [KVCacheBlock(b) for b in range(num_pages_for(num_tokens, BLOCK))]
    scheduler.update_state_after_alloc(request, KVCacheBlocks((local,)), count)
    meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    (load,) = [x for x in meta.loads if x.request_id == request_id]
    if bad is None:  # nothing was made hostile: a normal load of exactly what prefill sent
        assert load.error == "" and load.num_tokens == num_tokens and load.prefix_tokens == prefix
        assert load.remote_block_ids == sent["remote_block_ids"] and load.local_block_ids == list(range(len(local)))
        assert load.remote is not None
        remote = load.remote
        assert (remote.engine_id, load.remote_request_id, remote.host, remote.base_port, remote.tp_size) == (
            sent["remote_engine_id"],
            sent["remote_request_id"],
            sent["remote_host"],
            sent["remote_port"],
            sent["tp_size"],
        )
    else:  # refused, naming one of the keys that were made bad
        assert load.error.startswith("invalid kv_transfer_params: kv_transfer_params"), load.error
        assert any(key in load.error for key in bad), (bad, load.error)
        assert load.remote_block_ids == [] and load.local_block_ids == list(range(len(local)))
    assert request.kv_transfer_params["do_remote_prefill"] is False  # never loaded twice after preemption


def test_a_token_count_that_does_not_match_the_prompt_fails_the_load(scheduler) -> None:
    """Valid-looking params for a different prompt: refused by the scheduler's own check, not by the plan."""
    params = {**GOOD, "remote_num_tokens": 128}
    request = Request(
        "short", list(range(100)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None
    )
    count, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(0), KVCacheBlock(1)],)), count)
    (load,) = [x for x in scheduler.build_connector_meta(SchedulerOutput.make_empty()).loads if x.request_id == "short"]
    assert "prefill computed 128 tokens; this prompt has 100" in load.error

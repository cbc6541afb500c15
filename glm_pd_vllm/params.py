"""``kv_transfer_params``: one versioned struct, encoded by prefill for the router and decoded by decode.

Decode treats the params as remote input: the protocol version first, then every field's type and range,
then the block count against the token count, before a load is planned (the core plan then bounds-checks
every block id against its regions).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import replace
from typing import Annotated, Any, TypeVar, cast

import msgspec
from vllm.config import VllmConfig

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION, PageId
from glm_pd_common.layout.cache_dtypes import row_format_for, vllm_indexer_scale_format
from glm_pd_common.layout.geometry import ModelGeometry
from glm_pd_common.layout.pages import INT64_MAX, num_pages_for
from glm_pd_common.layout.shards import Sharding
from glm_pd_common.layout.spec import CacheSpec
from glm_pd_common.layout.tp import SUPPORTED_TP
from glm_pd_vllm.caches import MAIN_CACHE
from glm_pd_vllm.config import GlmPdVllmConfig

MAX_BLOCKS = 1 << 22  # 4M blocks of 16 tokens: far past any context; more is hostile
# the wire's int64 bound: ids past it would overflow
_MAX_BLOCK_ID = cast(msgspec.inspect.IntType, msgspec.inspect.type_info(PageId)).le
_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}(\.[A-Za-z0-9][A-Za-z0-9_-]{0,62})*\.?")


def cache_spec(vllm_config: VllmConfig, config: GlmPdVllmConfig) -> CacheSpec:
    """The core spec from vLLM's config: the main row for vLLM's cache dtype under the attention backend vLLM
    chose (``cache_dtypes``), the indexer scale format vLLM writes on this device (a configured value must
    agree with it). The worker checks the cache tensors against it when it registers them."""
    hf = vllm_config.model_config.hf_config
    geometry = ModelGeometry.from_config(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))
    if config.model_revision:
        geometry = replace(geometry, revision=config.model_revision)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    backend = attention_backend(vllm_config)
    platform, capability = device_of(vllm_config)
    scale_format = vllm_indexer_scale_format(platform, capability, config.indexer_scale_format)
    where = f"CUDA SM{capability[0]}{capability[1]}" if capability else platform
    origin = f"vLLM cache dtype {cache_dtype!r} under {backend or 'its default backend'} on {where}"
    return CacheSpec.create(geometry, row_format_for("vllm", cache_dtype, backend), scale_format, origin=origin)


def context_parallel(vllm_config: VllmConfig) -> Sharding:
    """How this engine's ranks shard every request's caches: vLLM's decode context parallelism deals tokens
    out to ``dcp`` consecutive TP ranks (``dcp_rank = tp_rank % dcp``), ``cp_kv_cache_interleave_size`` at a
    time. Prefill context parallelism is refused: its ranks are world ranks outside TP (``pcp_rank·TP +
    tp_rank``), which glm-pd's rank pairing and side-channel ports (TP rank r on base + r) do not know."""
    parallel = vllm_config.parallel_config
    pcp = parallel.prefill_context_parallel_size
    if pcp != 1:
        raise ConfigError(
            f"GlmPdConnector does not support prefill_context_parallel_size {pcp} yet: its ranks are world ranks "
            "beyond the TP group (pcp_rank * TP + tp_rank), which glm-pd neither pairs nor gives side-channel "
            "ports; use decode_context_parallel_size (or 1)"
        )
    return Sharding(token_shards=parallel.decode_context_parallel_size, interleave=parallel.cp_kv_cache_interleave_size)


def attention_backend(vllm_config: VllmConfig) -> str | None:
    """The attention backend of the main MLA layers this process built (a worker builds them before its
    connector), else the one selected with ``--attention-backend``; None when neither is known (vLLM's
    engine-core process under a multiprocess executor builds no layers)."""
    layers = vllm_config.compilation_config.static_forward_context
    names = {
        layer.attn_backend.get_name()
        for name, layer in layers.items()
        if MAIN_CACHE.match(name) and getattr(layer, "attn_backend", None) is not None
    }
    if len(names) > 1:
        raise ConfigError(f"the main MLA layers run several attention backends {sorted(names)}; glm-pd needs one")
    if names:
        return names.pop()
    selected = getattr(vllm_config.attention_config, "backend", None)
    return None if selected is None else str(selected.name)


def device_of(vllm_config: VllmConfig) -> tuple[str, tuple[int, int] | None]:
    """The device kind the caches live on (``cuda`` for NVIDIA, ``rocm``, ``cpu``, ...) and the CUDA compute
    capability. It asks vLLM's platform (NVML), as vLLM's own indexer-scale rule does, so the engine-core
    process stays without a CUDA context."""
    from vllm.platforms import current_platform

    kind = str(vllm_config.device_config.device_type)
    if kind == "cuda" and current_platform.is_rocm():
        return "rocm", None
    if kind != "cuda":
        return kind, None
    capability = current_platform.get_device_capability()
    return "cuda", None if capability is None else (capability.major, capability.minor)


Text = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Count = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]  # token math is int64
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class KvTransferParams(msgspec.Struct, kw_only=True, frozen=True):
    """What prefill hands the router for decode, and all decode reads of it.

    Not ``forbid_unknown_fields``: vLLM and the router add keys of their own on the way
    (``remote_prefill_cached_tokens``, ``prompt_token_ids``). Prefill's fingerprint and lease are not
    here: decode checks the fingerprint field by field at the handshake, and only prefill can time its
    lease (no shared clock); a claim after expiry is refused by prefill, and decode fails the load.
    """

    glm_pd_protocol: int = PROTOCOL_VERSION
    do_remote_prefill: bool = True  # vLLM's own keys: decode loads, prefill's part is done
    do_remote_decode: bool = False
    remote_engine_id: Text
    remote_request_id: Text
    remote_host: Text
    remote_port: Port
    tp_size: int
    remote_block_ids: Annotated[list[PageId], msgspec.Meta(max_length=MAX_BLOCKS)]
    remote_num_tokens: Count
    remote_page_tokens: Count  # tokens of one block on one rank (vLLM's --block-size)
    remote_token_shards: Count  # prefill's DCP size: one block id spans remote_page_tokens x this many tokens
    remote_interleave: Count  # prefill's cp_kv_cache_interleave_size

    def __post_init__(self) -> None:
        _check_host(self.remote_host)
        if self.tp_size not in SUPPORTED_TP:
            raise ConfigError(f"kv_transfer_params['tp_size'] must be one of {SUPPORTED_TP}, got {self.tp_size}")
        if self.tp_size % self.remote_token_shards:
            raise ConfigError(
                f"kv_transfer_params['remote_token_shards'] {self.remote_token_shards} must divide tp_size "
                f"{self.tp_size}"
            )
        if self.remote_page_tokens % self.remote_interleave:
            raise ConfigError(
                f"kv_transfer_params['remote_interleave'] {self.remote_interleave} must divide remote_page_tokens "
                f"{self.remote_page_tokens}"
            )
        span = self.remote_page_tokens * self.remote_token_shards
        need = num_pages_for(self.remote_num_tokens, span)
        if len(self.remote_block_ids) != need:
            shards = f" x {self.remote_token_shards} token shards" if self.remote_token_shards > 1 else ""
            raise ConfigError(
                f"kv_transfer_params: {len(self.remote_block_ids)} remote_block_ids for {self.remote_num_tokens} "
                f"tokens in blocks of {self.remote_page_tokens}{shards} (need {need})"
            )

    def encode(self) -> dict[str, Any]:
        """The JSON object vLLM returns to the router (plain lists, ints, strings and bools)."""
        return msgspec.to_builtins(self)

    @classmethod
    def decode(cls, params: object) -> KvTransferParams:
        """Validate what decode got from the router: the version first, then every field. Raises naming the key."""
        return _convert(params, cls)


class StreamParams(msgspec.Struct, kw_only=True, frozen=True):
    """A streamed request's params on decode: the router sends them beside prefill's leg, before prefill has
    computed anything, so they name only the transfer id both legs carry and prefill's side channel (rank 0
    tells decode its TP size and sharding). Prefill's leg carries ``glm_pd_transfer_id`` and
    ``do_remote_decode``."""

    glm_pd_protocol: int = PROTOCOL_VERSION
    do_remote_prefill: bool = True
    glm_pd_transfer_id: Text
    remote_host: Text
    remote_port: Port

    def __post_init__(self) -> None:
        _check_host(self.remote_host)

    @property
    def address(self) -> str:
        return f"{self.remote_host}:{self.remote_port}"

    @classmethod
    def decode(cls, params: object) -> StreamParams:
        return _convert(params, cls)


def decode_params(params: dict[str, Any]) -> KvTransferParams | StreamParams:
    """Decode's params of either mode: a transfer id marks a streamed request."""
    return StreamParams.decode(params) if "glm_pd_transfer_id" in params else KvTransferParams.decode(params)


def transfer_id(params: dict[str, Any]) -> str:
    """The transfer id on prefill's leg of a streamed request; refused unless it is short text."""
    value = params.get("glm_pd_transfer_id")
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise ConfigError(
            f"kv_transfer_params['glm_pd_transfer_id'] must be text of 1..256 characters, got {_shown(value)}"
        )
    return value


_Params = TypeVar("_Params", KvTransferParams, StreamParams)


def _convert(params: object, cls: type[_Params]) -> _Params:
    """The version first, then every field of ``cls``; an error names the key."""
    if not isinstance(params, dict):
        raise ConfigError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    version = params.get("glm_pd_protocol")
    if type(version) is not int:
        raise ConfigError(
            f"kv_transfer_params['glm_pd_protocol'] must be the glm-pd protocol version (this decode speaks "
            f"{PROTOCOL_VERSION}), got {_shown(version)}: not from a GlmPdConnector prefill of this version"
        )
    if version != PROTOCOL_VERSION:
        raise ConfigError(
            f"kv_transfer_params['glm_pd_protocol'] is {version}; this decode speaks {PROTOCOL_VERSION} "
            "(upgrade prefill and decode together)"
        )
    try:
        return msgspec.convert(params, cls)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, ConfigError):  # raised by __post_init__, already names the key
            raise exc.__cause__ from None
        raise _refusal(params, str(exc)) from None


def _check_host(host: str) -> None:
    """An IP address or a DNS name: decode connects there, and zmq refuses anything else with a ZMQError."""
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        if not _HOSTNAME.fullmatch(host):
            raise ConfigError(
                f"kv_transfer_params['remote_host'] is not an IP address or host name, got {host!r}"
            ) from None


_AT = re.compile(r"(?P<what>.*) - at `\$\.(?P<key>\w+)(?:\[(?P<index>\d+)\])?`")
_MISSING = re.compile(r"Object missing required field `(?P<key>\w+)`")


def _refusal(params: dict[str, Any], message: str) -> ConfigError:
    """msgspec's reason, restated with the key and the value that was sent."""
    missing = _MISSING.fullmatch(message)
    if missing:
        return ConfigError(f"kv_transfer_params[{missing['key']!r}] is missing")
    at = _AT.fullmatch(message)
    if at is None:
        return ConfigError(f"kv_transfer_params: {message}")
    key = at["key"]
    value: Any = params.get(key)  # msgspec named it, so it is there: a list when an index came with it
    if at["index"] is not None and key == "remote_block_ids":
        block = value[int(at["index"])]
        if type(block) is int:
            return ConfigError(f"kv_transfer_params[{key!r}] holds block id {block}, outside 0..{_MAX_BLOCK_ID}")
        return ConfigError(f"kv_transfer_params[{key!r}] holds a non-integer block id {_shown(block)}")
    return ConfigError(f"kv_transfer_params[{key!r}]: {at['what']}, got {_shown(value)}")


def _shown(value: object) -> str:
    """A sent value as an error message shows it: long lists by their length, long text cut."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."

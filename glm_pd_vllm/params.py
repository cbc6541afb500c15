"""``kv_transfer_params``: one versioned struct, encoded by prefill for the router and decoded by decode.

Decode treats the params as remote input: the protocol version first, then every field's type and range,
then the block count against the token count, before a load is planned (the core plan then bounds-checks
every block id against its regions).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, TypeVar, cast

import msgspec

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.decode.loads import RemotePrefill
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION, PageId
from glm_pd_common.layout.pages import INT64_MAX, num_pages_for
from glm_pd_common.layout.shards import Sharding
from glm_pd_common.layout.tp import SUPPORTED_TP

MAX_BLOCKS = 1 << 22  # 4M blocks of 16 tokens: far past any context; more is hostile
# the wire's int64 bound: ids past it would overflow
_MAX_BLOCK_ID = cast(int, cast(msgspec.inspect.IntType, msgspec.inspect.type_info(PageId)).le)
_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}(\.[A-Za-z0-9][A-Za-z0-9_-]{0,62})*\.?")


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
    # rank r's host, when prefill's ranks span nodes (rank r listens at remote_hosts[r]:remote_port + r)
    remote_hosts: Annotated[list[Text], msgspec.Meta(max_length=max(SUPPORTED_TP))] = []

    def __post_init__(self) -> None:
        _check_host(self.remote_host)
        for host in self.remote_hosts:
            _check_host(host, "remote_hosts")
        if self.remote_hosts and len(self.remote_hosts) != self.tp_size:
            raise ConfigError(
                f"kv_transfer_params['remote_hosts'] names {len(self.remote_hosts)} hosts for tp_size {self.tp_size}"
            )
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

    @property
    def remote(self) -> RemotePrefill:
        """The prefill these params name, as decode pairs with it, loads from it and renews its leases."""
        sharding = Sharding(token_shards=self.remote_token_shards, interleave=self.remote_interleave)
        hosts = tuple(self.remote_hosts)
        return RemotePrefill(self.remote_engine_id, self.remote_host, self.remote_port, self.tp_size, sharding, hosts)

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
    def remote(self) -> RemotePrefill:
        """Prefill's side channel only (its engine id is that address; rank 0 tells its TP size and sharding)."""
        return RemotePrefill(f"{self.remote_host}:{self.remote_port}", self.remote_host, self.remote_port, 0)

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
        raise _refusal(params, cls, exc) from None


def _refusal(params: dict[str, Any], cls: type[_Params], exc: msgspec.ValidationError) -> ConfigError:
    """Which key was refused, found by checking each field of ``cls`` on its own (only once the whole failed), and
    msgspec's reason restated with that key and the value that was sent."""
    for field in msgspec.structs.fields(cls):
        key = field.encode_name
        if key not in params:
            if field.required:
                return ConfigError(f"kv_transfer_params[{key!r}] is missing")
            continue
        try:
            msgspec.convert(params[key], field.type)
        except msgspec.ValidationError as bad:
            return _bad_value(key, params[key], bad)
    return ConfigError(f"kv_transfer_params: {exc}")


def _check_host(host: str, key: str = "remote_host") -> None:
    """An IP address or a DNS name: decode connects there, and zmq refuses anything else with a ZMQError."""
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        if not _HOSTNAME.fullmatch(host):
            raise ConfigError(
                f"kv_transfer_params[{key!r}] is not an IP address or host name, got {_shown(host)}"
            ) from None


def _bad_value(key: str, value: Any, exc: msgspec.ValidationError) -> ConfigError:
    """One key's refusal; a bad block id is named by value (the list's length passed, so one of its ids failed)."""
    if key == "remote_block_ids" and isinstance(value, list) and len(value) <= MAX_BLOCKS:
        block = next((b for b in value if type(b) is not int or not 0 <= b <= _MAX_BLOCK_ID), None)
        if type(block) is int:
            return ConfigError(f"kv_transfer_params[{key!r}] holds block id {block}, outside 0..{_MAX_BLOCK_ID}")
        if block is not None:
            return ConfigError(f"kv_transfer_params[{key!r}] holds a non-integer block id {_shown(block)}")
    return ConfigError(f"kv_transfer_params[{key!r}]: {exc}, got {_shown(value)}")


def _shown(value: object) -> str:
    """A sent value as an error message shows it: long lists by their length, long text cut."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."

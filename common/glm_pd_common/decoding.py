"""Remote msgpack decoded whole before anything acts on it, every failure a ``ProtocolError``.

Beside a wrong shape (msgspec's ``DecodeError``), decoding remote bytes can raise what a caller's loop never
expects: a frame nested 1,000 deep is a ``RecursionError``. Turned into a ``ProtocolError``, it is one refused
message, not a service step thrown away.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import msgspec

from glm_pd_common.errors import ProtocolError

T = TypeVar("T")
# One decoder per type and thread: building one costs ~60 small decodes, and a thread never shares its decoders
# (prefill's service thread, decode's lanes and SGLang's listeners all decode at once).
_DECODERS = threading.local()


def decode_as(data: bytes, kind: type[T], what: str) -> T:
    """``data`` as ``kind``, or a ``ProtocolError`` naming ``what`` was malformed."""
    try:
        mine: dict[Any, msgspec.msgpack.Decoder[Any]] = _DECODERS.__dict__.setdefault("by_type", {})
        decoder = mine.get(kind) or mine.setdefault(kind, msgspec.msgpack.Decoder(kind))
        decoded: T = decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from exc
    except (RecursionError, MemoryError, OverflowError, ValueError) as exc:
        raise ProtocolError(f"undecodable {what}: {type(exc).__name__}") from exc
    return decoded

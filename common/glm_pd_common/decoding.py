"""Remote msgpack decoded whole before anything acts on it, every failure a ``ProtocolError``.

Beside a wrong shape (msgspec's ``DecodeError``), decoding remote bytes can raise what a caller's loop never
expects: a frame nested 1,000 deep is a ``RecursionError``. Turned into a ``ProtocolError``, it is one refused
message, not a service step thrown away.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from glm_pd_common.errors import ProtocolError

T = TypeVar("T")


def decode_as(data: bytes, kind: type[T], what: str) -> T:
    """``data`` as ``kind``, or a ``ProtocolError`` naming ``what`` was malformed."""
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from exc
    except (RecursionError, MemoryError, OverflowError, ValueError) as exc:
        raise ProtocolError(f"undecodable {what}: {type(exc).__name__}") from exc

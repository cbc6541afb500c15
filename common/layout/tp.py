"""Which prefill rank serves which decode rank, for the replicated caches.

The MLA main KV holds one latent "head" shared by every query head, and the lightning indexer holds one
key head; every attention-TP rank therefore keeps an identical, whole copy of both. Slicing them by head
would be meaningless (there is one head), and reading from several prefill ranks would move the same bytes
N times. So each decode rank reads one whole copy from exactly one prefill rank, and the decode ranks are
spread evenly over the prefill ranks (contiguous groups, as SGLang pairs MLA ranks).
"""

from __future__ import annotations

import numpy as np

from glm_pd_common.errors import ConfigError

SUPPORTED_TP = (1, 2, 4, 8, 16)


def _check_tp(prefill_tp: int, decode_tp: int) -> None:
    for name, value in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp)):
        if value not in SUPPORTED_TP:
            raise ConfigError(f"{name} must be one of {SUPPORTED_TP}, got {value!r}")


def source_rank(decode_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """The prefill rank whose whole copy ``decode_rank`` reads."""
    _check_tp(prefill_tp, decode_tp)
    if not 0 <= decode_rank < decode_tp:
        raise ConfigError(f"decode_rank {decode_rank} is outside 0..{decode_tp - 1}")
    return decode_rank * prefill_tp // decode_tp


def source_ranks(prefill_tp: int, decode_tp: int) -> np.ndarray:
    """``source_ranks(p, d)[r]`` is the prefill rank of decode rank r."""
    _check_tp(prefill_tp, decode_tp)
    return np.arange(decode_tp, dtype=np.int64) * prefill_tp // decode_tp


def decode_ranks_served(prefill_rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """The decode ranks a prefill rank sends to; empty means it only reports success (a dummy)."""
    if not 0 <= prefill_rank < prefill_tp:
        raise ConfigError(f"prefill_rank {prefill_rank} is outside 0..{prefill_tp - 1}")
    return np.flatnonzero(source_ranks(prefill_tp, decode_tp) == prefill_rank).tolist()


def release_group(decode_rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """Prefill ranks whose leases ``decode_rank`` releases: its source, plus, when decode has fewer ranks,
    the dummies of its group (they hold the same blocks and free them only on this release)."""
    first = source_rank(decode_rank, prefill_tp, decode_tp)
    width = max(prefill_tp // decode_tp, 1)
    return list(range(first, first + width))


def expected_releases(prefill_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """How many decode ranks release a lease held by ``prefill_rank`` before it may free the blocks."""
    return sum(prefill_rank in release_group(d, prefill_tp, decode_tp) for d in range(decode_tp))

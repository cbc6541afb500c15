"""How much of the handoff sits on the time to first token, pulled after prefill or streamed during it.

Pull: decode reads only after prefill answered, so the busiest rank's whole time on its link is exposed.
Streamed: prefill runs chunked; each finished chunk's KV (main and indexer, every layer) moves while prefill
computes the next one, so what is exposed is what is still moving when prefill answers: the last chunk's
share, or more when the link is slower than prefill writes KV (the backlog the earlier chunks leave).

The model is deliberately simple:
- prefill computes only the suffix decode lacks (its own prefix cache holding decode's hit), at a constant
  ``prefill_tokens_per_s``; attention cost really grows with position, so late chunks run slower and hide
  more, which only helps streaming;
- a chunk's bytes are the suffix's bytes pro rata to its tokens, and the link moves them at its line rate,
  chunk after chunk, each starting once it is written and the previous one has moved;
- both modes then pay the same sequential side-channel round trips (a claim per source, a release per held
  copy), timed only when ``rtt_s`` is given; first-contact handshakes, digests and HTTP hops are not counted.
"""

from __future__ import annotations

import math

import numpy as np

# The engines' own prefill chunk for a long prompt, by GPU: vLLM serve's max_num_batched_tokens
# (engine/arg_utils.py get_batch_defaults: 8192 from 70 GiB, 16384 from 160 GiB) and SGLang's
# chunked_prefill_size (arg_groups/memory_hook.py: 8192 below 160 GiB from 60 GiB, 16384 above) agree.
DEFAULT_CHUNK_TOKENS = {"h100": 8192, "h200": 8192, "b200": 16384}


def streamed_seconds(suffix_tokens: int, chunk_tokens: int, link_seconds: float, prefill_tokens_per_s: float) -> float:
    """Link time still running when prefill answers: chunk k is written at end_k / rate and its share moves
    once the link has moved every earlier chunk, so the link finishes at max_k(end_k / rate + share of chunks
    k.. on the link), and prefill answers at suffix_tokens / rate."""
    if suffix_tokens == 0:  # decode's prefix hit is the whole prompt: nothing moves
        return 0.0
    chunks = np.arange(1, math.ceil(suffix_tokens / chunk_tokens) + 1, dtype=np.int64)
    ends = np.minimum(chunks * chunk_tokens, suffix_tokens)
    starts = np.concatenate([[0], ends[:-1]])
    per_token_link = link_seconds / suffix_tokens
    finish = ends / prefill_tokens_per_s + (suffix_tokens - starts) * per_token_link
    return float(finish.max()) - suffix_tokens / prefill_tokens_per_s


def exposure(
    *,
    link_bytes: int,
    suffix_tokens: int,
    rank_bytes_per_s: float,
    chunk_tokens: int,
    prefill_tokens_per_s: float | None,
    round_trips: int,
    rtt_s: float | None,
) -> dict[str, object]:
    """Both modes' exposed seconds; the streamed one is None without a prefill throughput (its floor, the last
    chunk's share, is known regardless)."""
    link_seconds = link_bytes / rank_bytes_per_s
    chunks = math.ceil(suffix_tokens / chunk_tokens)
    last_tokens = suffix_tokens - (chunks - 1) * chunk_tokens if chunks else 0
    last_bytes = link_bytes * last_tokens // suffix_tokens if chunks else 0
    last_seconds = last_bytes / rank_bytes_per_s
    round_trip_seconds = round_trips * rtt_s if rtt_s is not None else 0.0
    transfer = (
        None
        if prefill_tokens_per_s is None
        else streamed_seconds(suffix_tokens, chunk_tokens, link_seconds, prefill_tokens_per_s)
    )
    return {
        "round_trips": round_trips,
        "rtt_seconds": rtt_s,
        "pull": {"seconds": link_seconds + round_trip_seconds, "transfer_seconds": link_seconds},
        "streamed": {
            "seconds": None if transfer is None else transfer + round_trip_seconds,
            "transfer_seconds": transfer,
            "backlog_seconds": None if transfer is None else max(transfer - last_seconds, 0.0),
            "chunk_tokens": chunk_tokens,
            "chunks": chunks,
            "last_chunk_tokens": last_tokens,
            "last_chunk_bytes": last_bytes,
            "last_chunk_seconds": last_seconds,
            "prefill_tokens_per_s": prefill_tokens_per_s,
            "prefill_seconds": None if prefill_tokens_per_s is None else suffix_tokens / prefill_tokens_per_s,
        },
    }

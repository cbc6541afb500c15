"""A digest's word sum in one pass over the bytes, with Triton (in the engines' stacks; imported only where present).

torch has no fused integer multiply-and-sum, so ``TorchMemory``'s ops gather a slot, write its words' products and
read them back: about seven bytes of memory traffic per byte digested. This kernel reads each word where it lies
(each program a tile of one run), multiplies it by its key
``K(i) = A[i mod B] · C(i div B)`` (``layout.digest_words``; the small tables stay in cache) and sums a tile of
words per program; the tiles' sums are added on the device (int64 wraps mod 2^64, as the definition needs) and
one number comes to the host. So the bytes are read once and nothing the size of the bytes is written.

Triton runs kernels on CUDA tensors, or on CPU tensors in its interpreter (``TRITON_INTERPRET=1``, read when this
module is imported), which the CPU suites use to check the kernel against numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton
import triton.language as tl
from triton import knobs

from glm_pd_common.layout.digest_words import BLOCK_WORDS, MASK, WORD_BYTES, block_scales

TILE_WORDS = 1024  # words one program sums (4 KiB): a 41,984-byte page is 11 tiles
TILES_PER_LAUNCH = 1 << 20  # bounds the tiles' sums held at once (8 MiB of int64)
KEY_BITS = BLOCK_WORDS.bit_length() - 1
INTERPRETED = knobs.runtime.interpret  # kernels then run on the host, over CPU tensors


@triton.jit
def _tile_sums(
    words,  # int32: the region, as words
    run_starts,  # int64: each run's first word in the region
    run_places,  # int64: each run's first word's place in the part's stream
    run_words,  # int64: each run's length in words
    tile_runs,  # int32: the run each tile is in
    tile_firsts,  # int32: the tile's first word within its run
    keys,  # int64: ``A``, the block keys
    scales,  # int64: ``C`` of the part's blocks, from its first
    out,  # int64: one sum per tile
    first_tile,
    TILE: tl.constexpr,
    KEY_BITS: tl.constexpr,
):
    tile = first_tile + tl.program_id(0)
    run = tl.load(tile_runs + tile)
    j = tl.load(tile_firsts + tile).to(tl.int64) + tl.arange(0, TILE)
    inside = j < tl.load(run_words + run)
    x = tl.load(words + tl.load(run_starts + run) + j, mask=inside, other=0).to(tl.int64)
    i = tl.load(run_places + run) + j  # the part starts at a whole block: ``i`` is its words' place in blocks
    key = tl.load(keys + (i & ((1 << KEY_BITS) - 1))) * tl.load(scales + (i >> KEY_BITS), mask=inside, other=0)
    tl.store(out + tl.program_id(0), tl.sum(x * key, axis=0))


def supports(device: Any) -> bool:
    """Whether the kernel runs on tensors of ``device`` here."""
    return device.type == "cuda" or (INTERPRETED and device.type == "cpu")


def runs_word_sum(torch: Any, words: Any, offsets: np.ndarray, lengths: np.ndarray, first_block: int, keys: Any) -> int:
    """``h`` of the stream made of the runs (``offsets``, ``lengths``: bytes, whole words) of ``words`` (int32, on
    its device), a stream whose first word is the first of block ``first_block``; ``keys`` is ``block_keys()`` as
    int64 on that device. Waits for the device."""
    run_words = np.asarray(lengths, dtype=np.int64) // WORD_BYTES
    num_words = int(run_words.sum())
    if not num_words:
        return 0
    device = words.device
    tiles = -(-run_words // TILE_WORDS)
    tile_runs = np.repeat(np.arange(run_words.size, dtype=np.int32), tiles)
    tile_firsts = (np.arange(tile_runs.size, dtype=np.int64) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * TILE_WORDS
    places = np.cumsum(run_words) - run_words

    def on_device(values: np.ndarray, dtype: Any) -> Any:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=dtype)).to(device)

    tables = (
        on_device(np.asarray(offsets, dtype=np.int64) // WORD_BYTES, np.int64),
        on_device(places, np.int64),
        on_device(run_words, np.int64),
        on_device(tile_runs, np.int32),
        on_device(tile_firsts, np.int32),
        keys,
        on_device(block_scales(first_block, -(-num_words // BLOCK_WORDS)).view(np.int64), np.int64),
    )
    total = torch.zeros((), dtype=torch.int64, device=device)
    for first in range(0, tile_runs.size, TILES_PER_LAUNCH):
        count = min(TILES_PER_LAUNCH, tile_runs.size - first)
        sums = torch.empty(count, dtype=torch.int64, device=device)
        _tile_sums[(count,)](words, *tables, sums, first, TILE=TILE_WORDS, KEY_BITS=KEY_BITS)
        total += sums.sum()
    return int(total.item()) & MASK  # .item() waits for the device's stream

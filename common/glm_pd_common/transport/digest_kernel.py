"""A digest's word sum in one pass over the bytes, with Triton (in the engines' stacks; imported only where present).

torch has no fused integer multiply-and-sum, so ``TorchMemory``'s ops gather a slot, write its words' products and
read them back: about seven bytes of memory traffic per byte digested. This kernel reads each word where it lies
(each program a tile of one run, which it finds by a binary search over the runs: only the runs' table goes
to the device), multiplies it by its key
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


@triton.jit(do_not_specialize=["num_runs", "first_tile"])  # one build, however many runs and tiles
def _tile_sums(
    words,  # int32: the region, as words
    runs,  # int64 [4, num_runs]: each run's first word in the region, its place in the part's stream, its length
    # in words, its first tile
    num_runs,
    keys,  # int64: ``A``, the block keys
    scales,  # int64: ``C`` of the part's blocks, from its first
    out,  # int64: one sum per tile
    first_tile,
    TILE: tl.constexpr,
    KEY_BITS: tl.constexpr,
):
    tile = first_tile + tl.program_id(0)
    # the run holding this tile: the last whose first tile is not past it (a binary search, once per program)
    lo = 0
    hi = num_runs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(runs + 3 * num_runs + mid) <= tile:
            lo = mid
        else:
            hi = mid
    j = (tile - tl.load(runs + 3 * num_runs + lo)) * TILE + tl.arange(0, TILE)
    inside = j < tl.load(runs + 2 * num_runs + lo)
    x = tl.load(words + tl.load(runs + lo) + j, mask=inside, other=0).to(tl.int64)
    i = tl.load(runs + num_runs + lo) + j  # the part starts at a whole block: ``i`` is its words' place in blocks
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
    keep = run_words > 0  # an empty run holds no tile
    run_words = run_words[keep]
    num_words = int(run_words.sum())
    if not num_words:
        return 0
    device = words.device
    tiles = -(-run_words // TILE_WORDS)
    table = np.stack(
        [
            np.asarray(offsets, dtype=np.int64)[keep] // WORD_BYTES,
            np.cumsum(run_words) - run_words,
            run_words,
            np.cumsum(tiles) - tiles,
        ]
    )
    runs = torch.from_numpy(table).to(device)  # one upload; each tile finds its run on the device
    scales = torch.from_numpy(block_scales(first_block, -(-num_words // BLOCK_WORDS)).view(np.int64)).to(device)
    num_tiles = int(tiles.sum())
    total = torch.zeros((), dtype=torch.int64, device=device)
    for first in range(0, num_tiles, TILES_PER_LAUNCH):
        count = min(TILES_PER_LAUNCH, num_tiles - first)
        sums = torch.empty(count, dtype=torch.int64, device=device)
        _tile_sums[(count,)](words, runs, run_words.size, keys, scales, sums, first, TILE=TILE_WORDS, KEY_BITS=KEY_BITS)
        total += sums.sum()
    return int(total.item()) & MASK  # .item() waits for the device's stream

"""A digest's word sum in one pass over the bytes, with Triton (in the engines' stacks; imported only where present).

torch has no fused integer multiply-and-sum, so ``TorchMemory``'s ops gather a slot, write its words' products and
read them back: about seven bytes of memory traffic per byte digested. This kernel reads each word where it lies
(each program a piece of one run, at most 64 KiB, a tile at a time), multiplies it by its key
``K(i) = A[i mod B] · C(i div B)`` (``layout.digest_words``; the small tables stay in cache) and sums the piece;
the pieces' sums are added on the device (int64 wraps mod 2^64, as the definition needs) and
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
from glm_pd_common.layout.slots import pack_runs

TILE_WORDS = 1024  # words a program loads at once (4 KiB)
PIECE_WORDS = 16 * TILE_WORDS  # at most this many words per program (64 KiB of the stream)
PIECES_PER_LAUNCH = 1 << 20  # bounds the pieces' sums held at once (8 MiB of int64)
KEY_BITS = BLOCK_WORDS.bit_length() - 1
INTERPRETED = knobs.runtime.interpret  # kernels then run on the host, over CPU tensors


@triton.jit(do_not_specialize=["num_pieces", "first_piece"])  # one build, however many pieces
def _piece_sums(
    words,  # int32: the region, as words
    pieces,  # int64 [3, num_pieces]: each piece's first word in the region, its place in the stream, its words
    num_pieces,
    keys,  # int64: ``A``, the block keys
    scales,  # int64: ``C`` of the part's blocks, from its first
    out,  # int64: one sum per piece
    first_piece,
    TILE: tl.constexpr,
    KEY_BITS: tl.constexpr,
):
    piece = first_piece + tl.program_id(0)
    start = tl.load(pieces + piece)
    place = tl.load(pieces + num_pieces + piece)  # the part starts at a whole block: places count in blocks
    count = tl.load(pieces + 2 * num_pieces + piece)
    acc = tl.zeros((TILE,), dtype=tl.int64)
    for at in range(0, count, TILE):
        j = at + tl.arange(0, TILE)
        inside = j < count
        x = tl.load(words + start + j, mask=inside, other=0).to(tl.int64)
        i = place + j
        key = tl.load(keys + (i & ((1 << KEY_BITS) - 1))) * tl.load(scales + (i >> KEY_BITS), mask=inside, other=0)
        acc += x * key
    tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))


def supports(device: Any) -> bool:
    """Whether the kernel runs on tensors of ``device`` here."""
    return device.type == "cuda" or (INTERPRETED and device.type == "cpu")


def runs_word_sum(torch: Any, words: Any, offsets: np.ndarray, lengths: np.ndarray, first_block: int, keys: Any) -> int:
    """``h`` of the stream made of the runs (``offsets``, ``lengths``: bytes, whole words) of ``words`` (int32, on
    its device), a stream whose first word is the first of block ``first_block``; ``keys`` is ``block_keys()`` as
    int64 on that device. Waits for the device."""
    offsets, lengths = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    num_words = int(lengths.sum()) // WORD_BYTES
    if not num_words:
        return 0
    device = words.device
    # the runs cut where the stream crosses a multiple of PIECE_WORDS (an empty run has no piece)
    packed = pack_runs(offsets, lengths, PIECE_WORDS * WORD_BYTES)
    places = (np.cumsum(lengths) - lengths)[packed.run] + packed.offsets - offsets[packed.run]
    table = np.stack([packed.offsets, places, packed.lengths]) // WORD_BYTES
    num_pieces = packed.run.size
    table_t = torch.from_numpy(table).to(device)  # one upload
    scales = torch.from_numpy(block_scales(first_block, -(-num_words // BLOCK_WORDS)).view(np.int64)).to(device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for first in range(0, num_pieces, PIECES_PER_LAUNCH):
        count = min(PIECES_PER_LAUNCH, num_pieces - first)
        sums = torch.empty(count, dtype=torch.int64, device=device)
        _piece_sums[(count,)](words, table_t, num_pieces, keys, scales, sums, first, TILE=TILE_WORDS, KEY_BITS=KEY_BITS)
        total += sums.sum()
    return int(total.item()) & MASK  # .item() waits for the device's stream

"""How a digest turns the bytes it covers into a number, so that numpy on the host and torch on a GPU agree.

The bytes (a region's runs concatenated in ``digest_order``) are read as little-endian signed 32-bit words
``x_i``, the tail zero-padded to a whole word, and summed with a key per position::

    h = Σ_i x_i · K(i)  mod 2^64,      K(i) = A[i mod B] · C(i div B)   (A, C odd: splitmix64 of the index, | 1)
    digest = splitmix64(h XOR splitmix64(num_bytes + LENGTH_SEED))

A key is a precomputed block key ``A`` times one scale per block of ``B`` words, so a block's share is a dot
product with a fixed table: numpy and torch (CPU or CUDA, int64 arithmetic wraps mod 2^64 in both) compute the
per-block sums of a slot with one multiply and one sum, and the scales are applied to those few sums on the host
(``fold``). The position index runs over the whole stream, however it is cut into chunks; chunks are cut at
whole words.

What it detects, for two streams of equal length (the final mix is a bijection of ``h``, so ``h`` decides):
- any change within one word: ``δ · K(i) ≠ 0 mod 2^64`` for ``0 < |δ| < 2^32`` and ``K(i)`` odd (so any single
  changed byte, or a run of up to 4 changed bytes in one word, always changes the digest);
- any other change (swapped or misplaced words, a stale or misplaced page): it goes unseen only if
  ``Σ δ_i K(i) ≡ 0 mod 2^64``. Each ``δ_i`` is below 2^32 in size, so the lowest set bit of the smallest-valued
  one is below bit 32, and with the keys behaving as random odd numbers that happens with probability
  ≤ 2^-32 per corrupted stream; a changed length always changes the digest through the final mix.
  64-bit words were twice as fast with numpy, but there two flips of bit 63 in two words always cancel.

Why not xxh3 (the library's, used before): it cannot be computed with torch ops on a device, and a Triton port
bit-identical to the library is a large piece of code to keep; the bytes would have to come to the host (a
device-to-host copy and a CPU hash at ~3 GB/s, seconds per long request). This sum needs only tensor ops.
"""

from __future__ import annotations

import functools

import numpy as np

WORD_BYTES = 4
BLOCK_WORDS = 1 << 15  # words per block key table (256 KiB of int64 keys: stays in cache)
BLOCK_BYTES = BLOCK_WORDS * WORD_BYTES
MASK = (1 << 64) - 1
SCALE_SEED = 1 << 63  # the block scales' splitmix64 inputs start here, far from the block keys' 0..B-1
LENGTH_SEED = 0x6C656E67746821  # the byte count's splitmix64 input offset
Bytes = bytes | bytearray | memoryview | np.ndarray  # host bytes, contiguous


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vigna's splitmix64 output function over uint64 (a bijection: distinct inputs, distinct outputs)."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.cache
def block_keys() -> np.ndarray:
    """``A``: the odd key of each word position within a block, uint64 (read-only, shared)."""
    keys = splitmix64(np.arange(BLOCK_WORDS, dtype=np.uint64)) | np.uint64(1)
    keys.flags.writeable = False
    return keys


def block_scales(first_block: int, count: int) -> np.ndarray:
    """``C``: the odd scale of blocks ``first_block .. first_block + count - 1``, uint64."""
    return splitmix64(np.arange(first_block, first_block + count, dtype=np.uint64) + np.uint64(SCALE_SEED)) | 1


def fold(block_sums: np.ndarray, first_block: int = 0) -> int:
    """``Σ_j C(first_block + j) · block_sums[j] mod 2^64``: consecutive blocks' sums (``Σ x · A``) into ``h``."""
    sums = np.asarray(block_sums).view(np.uint64)
    return int(np.dot(sums, block_scales(first_block, sums.size))) if sums.size else 0


def finish(h: int, num_bytes: int) -> int:
    """The digest of ``num_bytes`` bytes whose word sum is ``h``."""
    length_key = splitmix64(np.array([num_bytes + LENGTH_SEED], dtype=np.uint64))
    return int(splitmix64(np.array([h], dtype=np.uint64) ^ length_key)[0])


def words_sum(words: np.ndarray, first_word: int) -> int:
    """``Σ x_i · K(first_word + i) mod 2^64`` over int32 ``words``: one dot product per block they touch, through
    one cache-sized uint64 buffer (the words sign-extended), and the blocks' scales applied together."""
    keys = block_keys()
    wide = np.empty(min(words.size, BLOCK_WORDS), dtype=np.uint64)
    first_block = first_word // BLOCK_WORDS
    sums = np.zeros(-(-(first_word % BLOCK_WORDS + words.size) // BLOCK_WORDS), dtype=np.uint64)
    at = 0
    while at < words.size:
        within = (first_word + at) % BLOCK_WORDS
        take = min(words.size - at, BLOCK_WORDS - within)
        np.copyto(wide[:take].view(np.int64), words[at : at + take])
        sums[(first_word + at) // BLOCK_WORDS - first_block] = np.dot(wide[:take], keys[within : within + take])
        at += take
    return fold(sums, first_block)


class WordSum:
    """The word sum ``h`` of a stream fed in pieces of any length (host bytes), in stream order, from its byte
    ``first_byte`` on (a whole word: the sums of consecutive parts of a stream add up to the whole's)."""

    def __init__(self, first_byte: int = 0) -> None:
        if first_byte % WORD_BYTES:
            raise ValueError(f"a word sum starts at a whole word, not at byte {first_byte}")
        self._h = 0
        self._num_bytes = 0
        self._num_words = first_byte // WORD_BYTES  # the position of the next whole word
        self._carry = b""  # the 0-3 bytes of a word the next piece completes

    def update(self, data: Bytes) -> None:
        piece = np.frombuffer(data, dtype=np.uint8)
        self._num_bytes += piece.size
        if self._carry:
            need = WORD_BYTES - len(self._carry)
            self._carry += piece[:need].tobytes()
            piece = piece[need:]
            if len(self._carry) < WORD_BYTES:
                return
            self._add(np.frombuffer(self._carry, dtype="<i4"))
        whole = piece.size - piece.size % WORD_BYTES
        self._add(piece[:whole].view("<i4"))
        self._carry = piece[whole:].tobytes()

    def _add(self, words: np.ndarray) -> None:
        self._h = (self._h + words_sum(words, self._num_words)) & MASK
        self._num_words += words.size

    def h(self) -> int:
        """The sum so far, a last partial word zero-padded (so it ends its stream)."""
        if not self._carry:
            return self._h
        tail = np.frombuffer(self._carry.ljust(WORD_BYTES, b"\0"), dtype="<i4")
        return (self._h + words_sum(tail, self._num_words)) & MASK

    def digest(self) -> int:
        """The digest of a stream fed from its first byte."""
        return finish(self.h(), self._num_bytes)


def digest_bytes(data: Bytes) -> int:
    """The digest of one contiguous buffer (what any reader computes for the same bytes)."""
    total = WordSum()
    total.update(data)
    return total.digest()

"""The digest definition (issue 28 item 2): what ``layout.digest_words`` computes is the sum its docstring states,
whatever the chunking, and a changed byte or length always changes it. A plain-integer reference states the sum
independently of numpy; tests/vllm/test_device_digest.py checks torch against it, tests/gpu on CUDA."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pd_common.layout.digest_words import BLOCK_BYTES, BLOCK_WORDS, LENGTH_SEED, SCALE_SEED, WordSum, digest_bytes
from glm_pd_common.tools.flat import flat_span
from glm_pd_common.transport.memory import HOST, HOST_SLOT_BYTES, SHORT_RUN_BYTES

MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference(data: bytes) -> int:
    """The docstring's sum, word by word, in Python integers."""
    padded = data + bytes(-len(data) % 4)
    h = 0
    for i in range(len(padded) // 4):
        x = int.from_bytes(padded[4 * i : 4 * i + 4], "little", signed=True)
        block, within = divmod(i, BLOCK_WORDS)
        key = (_splitmix64(within) | 1) * (_splitmix64(block + SCALE_SEED) | 1)
        h = (h + x * key) & MASK
    return _splitmix64(h ^ _splitmix64(len(data) + LENGTH_SEED))


@settings(max_examples=30, deadline=None)
@given(st.binary(max_size=64))
def test_short_streams_equal_the_reference(data: bytes) -> None:
    assert digest_bytes(data) == reference(data)


def test_streams_across_block_boundaries_equal_the_reference() -> None:
    data = np.random.default_rng(3).integers(0, 256, 2 * BLOCK_BYTES + 7, dtype=np.uint8).tobytes()
    assert digest_bytes(data) == reference(data)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_chunking_gives_the_same_digest(data: st.DataObject) -> None:
    """Pieces of any length (words and blocks cut anywhere) continue the stream's word positions."""
    size = data.draw(st.integers(0, 3 * BLOCK_BYTES))
    stream = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=12)))
    total = WordSum()
    for a, b in zip([0, *cuts], [*cuts, size], strict=True):
        total.update(stream[a:b])
    assert total.digest() == digest_bytes(stream)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_changed_byte_or_length_always_changes_the_digest(data: st.DataObject) -> None:
    size = data.draw(st.integers(1, BLOCK_BYTES + 64))
    stream = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    before = digest_bytes(stream)
    at = data.draw(st.integers(0, size - 1))
    changed = stream.copy()
    changed[at] ^= data.draw(st.integers(1, 255))
    assert digest_bytes(changed) != before
    assert digest_bytes(np.append(stream, np.uint8(0))) != before  # a zero more: the length tells it
    assert digest_bytes(stream[:-1]) != before


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_host_reader_digests_the_runs_concatenated(data: st.DataObject) -> None:
    """Runs short (packed through the thread's slot) and long (summed in place), in any order, overlapping or
    not: the host reader's digest is that of their bytes concatenated."""
    memory = np.random.default_rng(7).integers(0, 256, 3 * HOST_SLOT_BYTES, dtype=np.uint8)
    region = flat_span(memory.ctypes.data, memory.size)
    length = st.one_of(st.integers(0, 300), st.integers(SHORT_RUN_BYTES - 3, SHORT_RUN_BYTES + 5))
    lengths = np.array(data.draw(st.lists(length, max_size=40)) or [0], dtype=np.int64)
    offsets = np.array([data.draw(st.integers(0, memory.size - int(n))) for n in lengths], dtype=np.int64)
    want = digest_bytes(b"".join(memory[o : o + n].tobytes() for o, n in zip(offsets, lengths, strict=True)))
    assert HOST.digest(region, offsets, lengths) == want

"""``layout.slots.pack_runs``: runs packed in order into bounded slots (staged digests and moves use it).

The oracle is a byte-level model written here: the runs' bytes laid end to end and cut every ``slot_bytes``;
each slot's pieces, read back from a buffer, must give exactly that slot's bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pd_common.layout.slots import pack_runs


def slots_by_bytes(memory: bytes, offsets: list[int], lengths: list[int], slot_bytes: int) -> list[bytes]:
    stream = b"".join(memory[o : o + n] for o, n in zip(offsets, lengths, strict=True))
    return [stream[i : i + slot_bytes] for i in range(0, len(stream), slot_bytes)]


def slots_by_pieces(memory: bytes, offsets: list[int], lengths: list[int], slot_bytes: int) -> list[bytes]:
    packed = pack_runs(np.array(offsets, dtype=np.int64), np.array(lengths, dtype=np.int64), slot_bytes)
    out = []
    for k in range(packed.num_slots):
        part = packed.slot(k)
        slot = bytearray(slot_bytes)
        for off, n, at, run in zip(packed.offsets[part], packed.lengths[part], packed.slot_offsets[part],
                                   packed.run[part], strict=True):  # fmt: skip
            assert offsets[run] <= off and off + n <= offsets[run] + lengths[run], "a piece left its run"
            slot[at : at + n] = memory[off : off + n]
        used = int(packed.lengths[part].sum())
        assert sorted(packed.slot_offsets[part]) == list(packed.slot_offsets[part])  # in order, no gaps
        out.append(bytes(slot[:used]))
    return out


@settings(max_examples=300, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 700)), max_size=40),
    slot_bytes=st.integers(1, 1500),
)
def test_each_slot_holds_the_next_slot_bytes_of_the_runs(runs, slot_bytes) -> None:
    memory = np.random.default_rng(len(runs)).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    offsets, lengths = [o for o, _ in runs], [n for _, n in runs]
    assert slots_by_pieces(memory, offsets, lengths, slot_bytes) == slots_by_bytes(memory, offsets, lengths,
                                                                                    slot_bytes)  # fmt: skip


def test_page_runs_of_a_fragmented_table() -> None:
    """41,984-byte pages (GLM-5.3's main page of 64 tokens) scattered over a pool, in 1 MiB slots: every slot
    but the last is full, a page cut by a slot's end goes on at the start of the next."""
    page = 41_984
    offsets = np.random.default_rng(1).permutation(500)[:300].astype(np.int64) * page
    packed = pack_runs(offsets, np.full(300, page, dtype=np.int64), 1 << 20)
    assert packed.num_slots == -(-300 * page // (1 << 20))
    sizes = [int(packed.lengths[packed.slot(k)].sum()) for k in range(packed.num_slots)]
    assert sizes[:-1] == [1 << 20] * (packed.num_slots - 1) and sum(sizes) == 300 * page
    cut = packed.slot(1).start
    assert packed.run[cut] == packed.run[cut - 1] and packed.slot_offsets[cut] == 0


def test_no_runs_no_slots_and_a_bad_size_is_refused() -> None:
    packed = pack_runs(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 64)
    assert packed.num_slots == 0 and packed.run.size == 0
    with pytest.raises(ValueError, match="slot_bytes must be positive, got 0"):
        pack_runs(np.array([0]), np.array([1]), 0)

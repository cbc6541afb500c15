"""The one-pass digest kernel (issue 28 item 2) in Triton's interpreter, over CPU tensors (tests/gpu runs it on
CUDA): its word sums equal numpy's over random runs of whole words, for parts starting at any block; the torch
reader digests whole-word runs with it and every other run with its ops, equal to the host reader either way;
a kernel that fails is named once and the ops take over. (Threads digesting at once: tests/gpu, as Triton's
interpreter keeps the running kernel's state in globals.)

Run by `make test-vllm` in a pytest process of its own with ``TRITON_INTERPRET=1`` (Triton reads it when it is
first imported, and the vLLM suite's process imports it through vLLM); skipped elsewhere."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pd_common.layout.digest_words import BLOCK_BYTES, BLOCK_WORDS, MASK, block_keys, words_sum
from glm_pd_common.tools.flat import flat_span
from glm_pd_common.transport.memory import HOST
from glm_pd_common.transport.torch_memory import TorchMemory

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

MEMORY = np.random.default_rng(17).integers(0, 256, 4 * BLOCK_BYTES + 8, dtype=np.uint8)


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    from glm_pd_common.transport import digest_kernel

    if not (digest_kernel.INTERPRETED and digest_kernel.supports(torch.device("cpu"))):
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before Triton is imported turns it on)")
    return digest_kernel


def whole_word_runs(data: st.DataObject, max_words: int) -> tuple[np.ndarray, np.ndarray]:
    """Random runs of whole words in ``MEMORY``: within a tile, across tiles and pieces, across blocks, empty."""
    words = st.one_of(st.integers(0, 40), st.integers(0, max_words))
    lengths = np.array(data.draw(st.lists(words, max_size=8)), dtype=np.int64) * 4
    offsets = np.array([data.draw(st.integers(0, (MEMORY.size - int(n)) // 4)) * 4 for n in lengths], dtype=np.int64)
    return offsets, lengths


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_kernel_word_sums_equal_numpy(kernel: ModuleType, data: st.DataObject) -> None:
    offsets, lengths = whole_word_runs(data, 2 * kernel.PIECE_WORDS + kernel.TILE_WORDS + 3)  # cut into pieces
    first_block = data.draw(st.integers(0, 3))
    words = torch.from_numpy(MEMORY).view(torch.int32)
    keys = torch.from_numpy(block_keys().view(np.int64).copy())
    stream = np.concatenate([MEMORY[o : o + n] for o, n in zip(offsets, lengths, strict=True)] + [MEMORY[:0]])
    want = words_sum(stream.view("<i4"), first_block * BLOCK_WORDS)
    assert kernel.runs_word_sum(torch, words, offsets, lengths, first_block, keys) == want


class Counted:
    """A test double around the kernel module: counts its calls, or fails each one when told to, or (``skew``)
    returns sums off by that much, as a kernel miscompiled for some GPU would."""

    def __init__(self, module: ModuleType, *, fail: bool = False, skew: int = 0) -> None:
        self.module, self.fail, self.skew, self.calls = module, fail, skew, 0

    def supports(self, device: Any) -> bool:
        return self.module.supports(device)

    def runs_word_sum(self, *args: Any) -> int:
        self.calls += 1
        if self.fail:
            raise RuntimeError("no compiler here")
        return (self.module.runs_word_sum(*args) + self.skew) & MASK


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_the_torch_reader_digests_whole_words_with_the_kernel_and_other_runs_with_its_ops(
    kernel: ModuleType, data: st.DataObject
) -> None:
    region = flat_span(MEMORY.ctypes.data, MEMORY.size)
    counted = Counted(kernel)
    reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES, kernel=counted)
    offsets, lengths = whole_word_runs(data, 2 * kernel.TILE_WORDS)
    assert reader.digest(region, offsets, lengths) == HOST.digest(region, offsets, lengths)
    assert counted.calls == 1
    offsets, lengths = np.append(offsets, 4), np.append(lengths, 4)
    odd = data.draw(st.sampled_from(np.flatnonzero(lengths).tolist()))  # a run made to start or end mid-word
    offsets[odd] += data.draw(st.booleans())
    lengths[odd] -= 1
    assert reader.digest(region, offsets, lengths) == HOST.digest(region, offsets, lengths)
    assert counted.calls == 1 and reader.kernel is counted


def test_a_kernel_that_fails_is_named_once_and_the_ops_digest(kernel: ModuleType, caplog) -> None:
    region = flat_span(MEMORY.ctypes.data, MEMORY.size)
    failing = Counted(kernel, fail=True)
    reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES, kernel=failing)
    offsets, lengths = np.array([BLOCK_BYTES + 8, 0]), np.array([2 * BLOCK_BYTES, 4096])
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert reader.digest(region, offsets, lengths) == HOST.digest(region, offsets, lengths)
    assert failing.calls == 1 and reader.kernel is None
    assert [r.getMessage() for r in caplog.records if "digest kernel failed" in r.getMessage()] != []


def test_the_start_up_check_keeps_a_right_kernel_and_leaves_a_wrong_or_failing_one(kernel: ModuleType, caplog) -> None:
    """``check_kernel`` (what ``reader_for`` runs on each GPU of a rank at start-up) against the numpy definition:
    a kernel that disagrees by a single unit, or raises, is named with the device and never digests a request."""
    cpu = torch.device("cpu")
    right = TorchMemory(torch, kernel=Counted(kernel))
    right.check_kernel(cpu)
    assert right.kernel is not None and right.kernel.calls == 1
    region = flat_span(MEMORY.ctypes.data, MEMORY.size)
    offsets, lengths = np.array([0, 4 * BLOCK_BYTES]), np.array([BLOCK_BYTES, 8])
    for double in (Counted(kernel, skew=1), Counted(kernel, fail=True)):
        reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES, kernel=double)
        with caplog.at_level(logging.WARNING):
            reader.check_kernel(cpu)
        assert reader.kernel is None and double.calls == 1
        assert any("digest kernel" in r.getMessage() and "cpu" in r.getMessage() for r in caplog.records)
        caplog.clear()
        assert reader.digest(region, offsets, lengths) == HOST.digest(region, offsets, lengths)
        assert double.calls == 1

"""The torch mover (what a GPU rank stages with) on CPU tensors: gather and scatter byte-exact against slicing,
over runs in several allocations, shuffled, of odd lengths (one-byte rows) and of page-sized ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pd_common.transport.base import Span
from glm_pd_common.transport.staging import TorchMover


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """A run length unit, and runs (buffer, start, length) that do not overlap, in a random order."""
    unit = draw(st.sampled_from([1, 4, 656, 8448]))
    runs = []
    for buf in range(2):
        count = draw(st.integers(1, 12))
        lengths = [unit * draw(st.integers(1, 3)) for _ in range(count)]
        gaps = [unit * draw(st.integers(0, 2)) for _ in range(count)]
        at = 0
        for n, gap in zip(lengths, gaps, strict=True):
            runs.append((buf, at + gap, n))
            at += gap + n
    return unit, draw(st.permutations(runs))


@settings(max_examples=40, deadline=None)
@given(cases())
def test_runs_of_several_allocations_are_gathered_and_scattered_in_order(case) -> None:
    _, runs = case
    size = max(s + n for _, s, n in runs) + 64
    gen = torch.Generator().manual_seed(len(runs))
    src = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(2)]
    dst = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]
    total = sum(n for _, _, n in runs)
    slot = torch.zeros(total, dtype=torch.uint8)
    spans = [Span(f"t{i}", t.data_ptr(), t.numel()) for i, t in enumerate([*src, *dst, slot])]
    mover = TorchMover(torch, spans)
    lengths = np.array([n for _, _, n in runs], dtype=np.int64)
    mover.gather(np.array([src[b].data_ptr() + s for b, s, _ in runs], dtype=np.int64), lengths, slot.data_ptr())
    assert torch.equal(slot, torch.cat([src[b][s : s + n] for b, s, n in runs]))
    mover.scatter(slot.data_ptr(), np.array([dst[b].data_ptr() + s for b, s, _ in runs], dtype=np.int64), lengths)
    for b, s, n in runs:
        assert torch.equal(dst[b][s : s + n], src[b][s : s + n])
    written = sum(int(t.count_nonzero()) for t in dst)
    assert written <= total  # nothing outside the runs was touched


def test_a_mover_refuses_spans_in_two_memories() -> None:
    from glm_pd_common.errors import ConfigError

    with pytest.raises(ConfigError, match="within one memory"):
        TorchMover(torch, [Span("a", 4096, 64), Span("b", 1 << 20, 64, "VRAM", 0)])

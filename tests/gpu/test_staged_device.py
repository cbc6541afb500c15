"""Staging on the GPU (issue 28 item 1): the torch mover gathers runs of several CUDA allocations into a slot with
one indexed copy and scatters them back, byte-exact against torch's own slicing, on the device the regions are on
(the last visible GPU: device ids > 0 where there are several); ``torch_staging`` allocates the buffer there and
registers it as GPU memory of that device.

Skipped without CUDA (run by scripts/gpu_smoke.sh).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_torch_mover_gathers_and_scatters_runs_of_vram_byte_exact() -> None:
    from glm_pd_common.transport.base import Span
    from glm_pd_common.transport.staging import TorchMover

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    gen = torch.Generator(device=device).manual_seed(7)
    a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=device, generator=gen)
    b = torch.randint(0, 256, (1 << 19,), dtype=torch.uint8, device=device, generator=gen)
    out_a, out_b = torch.zeros_like(a), torch.zeros_like(b)
    slot = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    spans = [Span(n, t.data_ptr(), t.numel(), "VRAM", device.index) for n, t in
             (("a", a), ("b", b), ("out_a", out_a), ("out_b", out_b), ("slot", slot))]  # fmt: skip
    rng = np.random.default_rng(3)
    starts = rng.permutation(np.arange(0, 1 << 20, 8448))[:40]  # indexer-page-sized runs, shuffled
    runs = [(a, int(s), 8448) for s in starts if s + 8448 <= a.numel()]
    runs += [(b, int(s), 656 * 4) for s in rng.permutation(np.arange(0, (1 << 19) - 2624, 2624))[:50]]
    addrs = np.array([t.data_ptr() + s for t, s, _ in runs], dtype=np.int64)
    lengths = np.array([n for _, _, n in runs], dtype=np.int64)
    mover = TorchMover(torch, spans)
    mover.gather(addrs, lengths, slot.data_ptr())
    expected = torch.cat([t[s : s + n] for t, s, n in runs])
    assert torch.equal(slot[: expected.numel()], expected)
    mirror = {a.data_ptr(): out_a, b.data_ptr(): out_b}
    back = np.array([mirror[t.data_ptr()].data_ptr() + s for t, s, _ in runs], dtype=np.int64)
    mover.scatter(slot.data_ptr(), back, lengths)
    for t, s, n in runs:
        assert torch.equal(mirror[t.data_ptr()][s : s + n], t[s : s + n])


def test_the_staging_buffer_lives_on_the_caches_device_and_is_registered_there() -> None:
    from glm_pd_common.transport.base import TransportConfig
    from glm_pd_common.transport.factory import create_transport
    from glm_pd_common.transport.staging import torch_staging
    from tests.gpu.vram import VramCaches, glm53_spec

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    regions = VramCaches(glm53_spec(), page_tokens=64, num_pages=2, device=device).regions
    transport = create_transport("staging-probe", TransportConfig(allow_tcp=True))
    try:
        staging = torch_staging(torch, transport, regions, size_bytes=8 << 20, slot_bytes=1 << 20, mode="auto")
        assert staging is not None and staging.backing.device == device
        assert (staging.span.mem_kind, staging.span.device_id, staging.pairs.count) == ("VRAM", device.index, 4)
    finally:
        transport.close()

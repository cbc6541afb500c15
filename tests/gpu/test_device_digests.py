"""Digests of CUDA memory are computed on the device, never read through a host pointer (issue 15 item 3, issue 28
item 2).

Skipped without CUDA. Regions on the last visible GPU (device id > 0 where there are several): the device digest of
a region's pages must equal the host definition (numpy) over the same bytes copied by torch itself, with a scratch
smaller than the pages so runs are cut into several slots; random runs on the device equal numpy's over the same
bytes; and two threads digesting through one reader get their own bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _kernel(name: str):
    """The digest kernel's module for "triton" (skipped where Triton is absent), None for torch's ops."""
    if name == "ops":
        return None
    pytest.importorskip("triton")
    from glm_pd_common.transport import digest_kernel

    return digest_kernel


def _vram_regions(device, pages: int, template):
    tensors = [torch.randint(0, 256, (pages * r.page_stride,), dtype=torch.uint8, device=device) for r in template]
    regions = [
        dataclasses.replace(r, base_addr=t.data_ptr(), mem_kind="VRAM", device_id=device.index)
        for r, t in zip(template, tensors, strict=True)
    ]
    return regions, tensors


def test_device_digest_of_vram_equals_the_bytes_digest() -> None:
    from glm_pd_common.layout.digest_words import BLOCK_BYTES, digest_bytes
    from glm_pd_common.layout.geometry import ModelGeometry
    from glm_pd_common.layout.spec import CacheSpec
    from glm_pd_common.tools.hostmem import HostCaches
    from glm_pd_common.transport.digests import region_pages_digest
    from glm_pd_common.transport.torch_memory import TorchMemory, digest_kernel, reader_for

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    pages = 8
    template = HostCaches(spec, page_tokens=64, num_pages=pages).regions[-2:]  # the MTP layer's main and indexer
    regions, tensors = _vram_regions(device, pages, template)
    adapters = reader_for(regions, torch)  # checks the kernel on this GPU, where Triton is installed
    assert isinstance(adapters, TorchMemory)
    assert (adapters.kernel is None) == (digest_kernel() is None), "the kernel's start-up check failed on this GPU"
    reader = TorchMemory(torch, scratch_bytes=BLOCK_BYTES)
    chosen = np.array([7, 3, 4, 5, 0])
    for region, tensor in zip(regions, tensors, strict=True):
        host = tensor.view(pages, region.page_stride)[torch.as_tensor(chosen, device=device)].cpu().numpy()
        want = digest_bytes(np.ascontiguousarray(host[:, : region.page_bytes]))
        assert region_pages_digest(region, chosen, reader) == want


@pytest.mark.parametrize("digester", ["ops", "triton"])
def test_random_runs_on_cuda_equal_numpy(digester: str) -> None:
    """Runs of any length and offset (tails mid-word, runs across slots) over one device buffer; with the kernel,
    half the rounds are runs of whole words (its own), and it must not have failed over to the ops."""
    from glm_pd_common.layout.digest_words import BLOCK_BYTES, digest_bytes
    from glm_pd_common.tools.flat import flat_span
    from glm_pd_common.transport.torch_memory import TorchMemory

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    size = 5 * BLOCK_BYTES + 3
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    host = tensor.cpu().numpy()
    region = flat_span(tensor.data_ptr(), size, "VRAM", device.index)
    rng = np.random.default_rng(5)
    kernel = _kernel(digester)
    for scratch_blocks in (1, 2, 3):
        reader = TorchMemory(torch, scratch_bytes=scratch_blocks * BLOCK_BYTES, kernel=kernel)
        for round_ in range(20):
            lengths = rng.integers(0, 2 * BLOCK_BYTES, rng.integers(1, 10))
            lengths[rng.random(lengths.size) < 0.3] %= 97
            offsets = np.array([rng.integers(0, size - n + 1) for n in lengths])
            if round_ % 2:
                offsets, lengths = offsets // 4 * 4, lengths // 4 * 4
            want = digest_bytes(b"".join(host[o : o + n].tobytes() for o, n in zip(offsets, lengths, strict=True)))
            assert reader.digest(region, offsets, lengths) == want
        assert reader.kernel is kernel


def test_the_injected_corruption_lands_in_vram_and_the_device_digest_sees_it() -> None:
    """The fault injector's byte flip works on device memory (the fault matrices' corruption case on a GPU): one
    byte of a VRAM page inverted changes that page's device digest, and flipping it back restores it."""
    from glm_pd_common.layout.geometry import ModelGeometry
    from glm_pd_common.layout.spec import CacheSpec
    from glm_pd_common.tools.hostmem import HostCaches
    from glm_pd_common.transport.digests import region_pages_digest
    from glm_pd_common.transport.torch_memory import TorchMemory
    from tests.support.faults import flip

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    template = HostCaches(spec, page_tokens=64, num_pages=4).regions[-1]  # the MTP layer's indexer
    tensor = torch.randint(0, 256, (4 * template.page_stride,), dtype=torch.uint8, device=device)
    region = dataclasses.replace(template, base_addr=tensor.data_ptr(), mem_kind="VRAM", device_id=device.index)
    reader = TorchMemory(torch)
    pages = np.array([2])
    before = region_pages_digest(region, pages, reader)
    offset = 2 * region.page_stride + 17
    old = int(tensor[offset])
    flip(region, offset)
    assert int(tensor[offset]) == old ^ 0xFF
    assert region_pages_digest(region, pages, reader) != before
    flip(region, offset)
    assert region_pages_digest(region, pages, reader) == before


@pytest.mark.parametrize("digester", ["ops", "triton"])
def test_lanes_digesting_at_once_through_one_reader_get_their_own_bytes(digester: str) -> None:
    """Two threads digest two VRAM regions through one reader (as decode lanes reading two prefills, or two SGLang
    transfer lanes, do), over and over: every digest equals the one torch's ops compute alone. With one pinned
    buffer shared by the threads, 70 of 80 were wrong on an H200; each thread now gathers into a device scratch of
    its own (the kernel needs none)."""
    from glm_pd_common.layout.digest_words import BLOCK_BYTES
    from glm_pd_common.layout.geometry import ModelGeometry
    from glm_pd_common.layout.spec import CacheSpec
    from glm_pd_common.tools.hostmem import HostCaches
    from glm_pd_common.transport.digests import region_pages_digest
    from glm_pd_common.transport.torch_memory import TorchMemory
    from tests.support.device_double import concurrent_misses

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    pages = 64
    template = HostCaches(spec, page_tokens=64, num_pages=pages).regions[:2]
    regions, _tensors = _vram_regions(device, pages, template)
    kernel = _kernel(digester)
    reader = TorchMemory(torch, scratch_bytes=8 * BLOCK_BYTES, kernel=kernel)
    chosen = np.arange(pages)[::-1].copy()
    alone = [region_pages_digest(r, chosen, TorchMemory(torch)) for r in regions]

    def digest(i: int) -> int:
        with torch.cuda.device(device):
            return region_pages_digest(regions[i], chosen, reader)

    wrong = concurrent_misses(digest, alone)
    assert wrong == [], f"{len(wrong)} of 80 digests differed from the region's own"
    assert reader.kernel is kernel

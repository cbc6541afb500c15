"""Digests of CUDA memory are staged to the host, never read through a host pointer (issue 15 item 3).

Skipped without CUDA. Regions on the last visible GPU (device id > 0 where there are several): the staged digest
of a region's pages must equal xxh3 over the same bytes copied by torch itself, with a staging buffer smaller
than the pages so runs are cut and batched.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import xxhash

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_staged_digest_of_vram_equals_the_bytes_digest() -> None:
    from glm_pd_common.layout.geometry import ModelGeometry
    from glm_pd_common.layout.spec import CacheSpec
    from glm_pd_common.tools.hostmem import HostCaches
    from glm_pd_common.transport.digests import region_pages_digest
    from glm_pd_common.transport.memory import StagedMemory, cuda_copier, reader_for

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    pages = 8
    template = HostCaches(spec, page_tokens=64, num_pages=pages).regions[-2:]  # the MTP layer's main and indexer
    tensors = [torch.randint(0, 256, (pages * r.page_stride,), dtype=torch.uint8, device=device) for r in template]
    regions = [
        dataclasses.replace(r, base_addr=t.data_ptr(), mem_kind="VRAM", device_id=device.index)
        for r, t in zip(template, tensors, strict=True)
    ]
    assert isinstance(reader_for([r.mem_kind for r in regions], torch), StagedMemory)
    staged = StagedMemory(cuda_copier(torch), staging_bytes=10_000)
    chosen = np.array([7, 3, 4, 5, 0])
    for region, tensor in zip(regions, tensors, strict=True):
        host = tensor.view(pages, region.page_stride)[torch.as_tensor(chosen, device=device)].cpu().numpy()
        want = xxhash.xxh3_64_intdigest(host[:, : region.page_bytes].tobytes())
        assert region_pages_digest(region, chosen, staged) == want


def test_the_injected_corruption_lands_in_vram_and_the_staged_digest_sees_it() -> None:
    """The fault injector's byte flip works on device memory (the fault matrices' corruption case on a GPU): one
    byte of a VRAM page inverted changes that page's staged digest, and flipping it back restores it."""
    from glm_pd_common.layout.geometry import ModelGeometry
    from glm_pd_common.layout.spec import CacheSpec
    from glm_pd_common.tools.hostmem import HostCaches
    from glm_pd_common.transport.digests import region_pages_digest
    from glm_pd_common.transport.memory import StagedMemory, cuda_copier
    from tests.support.faults import flip

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    template = HostCaches(spec, page_tokens=64, num_pages=4).regions[-1]  # the MTP layer's indexer
    tensor = torch.randint(0, 256, (4 * template.page_stride,), dtype=torch.uint8, device=device)
    region = dataclasses.replace(template, base_addr=tensor.data_ptr(), mem_kind="VRAM", device_id=device.index)
    staged = StagedMemory(cuda_copier(torch))
    pages = np.array([2])
    before = region_pages_digest(region, pages, staged)
    offset = 2 * region.page_stride + 17
    old = int(tensor[offset])
    flip(region, offset)
    assert int(tensor[offset]) == old ^ 0xFF
    assert region_pages_digest(region, pages, staged) != before
    flip(region, offset)
    assert region_pages_digest(region, pages, staged) == before


def test_lanes_digesting_at_once_through_one_reader_get_their_own_bytes() -> None:
    """Two threads digest two VRAM regions through one staged reader (as decode lanes reading two prefills, or two
    SGLang transfer lanes, do), over and over: every digest equals the one computed alone. With one pinned buffer
    shared by the threads, 70 of 80 were wrong on an H200."""
    from glm_pd_common.layout.geometry import ModelGeometry
    from glm_pd_common.layout.spec import CacheSpec
    from glm_pd_common.tools.hostmem import HostCaches
    from glm_pd_common.transport.digests import region_pages_digest
    from glm_pd_common.transport.memory import StagedMemory, cuda_copier
    from tests.support.device_double import concurrent_misses

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    spec = CacheSpec.create(ModelGeometry.preset("glm-5.3"))
    pages = 64
    template = HostCaches(spec, page_tokens=64, num_pages=pages).regions[:2]
    tensors = [torch.randint(0, 256, (pages * r.page_stride,), dtype=torch.uint8, device=device) for r in template]
    regions = [
        dataclasses.replace(r, base_addr=t.data_ptr(), mem_kind="VRAM", device_id=device.index)
        for r, t in zip(template, tensors, strict=True)
    ]
    staged = StagedMemory(cuda_copier(torch), staging_bytes=1 << 20)
    chosen = np.arange(pages)[::-1].copy()
    alone = [region_pages_digest(r, chosen, staged) for r in regions]

    def digest(i: int) -> int:
        with torch.cuda.device(device):
            return region_pages_digest(regions[i], chosen, staged)

    wrong = concurrent_misses(digest, alone)
    assert wrong == [], f"{len(wrong)} of 80 digests differed from the region's own"

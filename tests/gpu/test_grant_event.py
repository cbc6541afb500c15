"""On a GPU: a grant's ready event recorded before the step's forward is queued does not wait for that forward.

vLLM's worker grants at bind, before the forward of the step that carries the grant. ``torch.cuda._sleep``
stands in for that forward (a kernel queued after the event, on the same stream): decode's claim is answered
and its load completes while the kernel still runs. The control records the event after the kernel, as a grant
in ``start_load_kv`` did, and the load completes only once the kernel has. Real services on NIXL over loopback.
Skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_pd_common.handoff.decode.service import LoadJob
from tests.support.services import PAGE_TOKENS, Decode, Prefill, wait_for

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORWARD_CYCLES = 6_000_000_000  # about 3-4 s of GPU time: far longer than a loopback load (handshake included)


def _load_during_forward(spec, event_before_forward: bool) -> tuple[bool, bool]:
    """(load ok, the forward still running when the load completed)."""
    prefill, decode = Prefill(spec), Decode(spec)
    try:
        stream = torch.cuda.current_stream()
        before = torch.cuda.Event()
        before.record(stream)
        torch.cuda._sleep(FORWARD_CYCLES)
        after = torch.cuda.Event()
        after.record(stream)
        pages = 3
        table = prefill.table[:pages]
        prefill.service.grant("r", table, ready=before if event_before_forward else after)
        decode.service.submit(LoadJob("r", prefill.remote, table, np.arange(pages), pages * PAGE_TOKENS, 0))
        results = wait_for(decode.service.results, bool, 30.0)
        running = not after.query()
        after.synchronize()
        return bool(results and results[0].ok), running
    finally:
        decode.close()
        prefill.close()


def test_a_grant_recorded_before_the_forward_is_served_while_it_runs(small_spec) -> None:
    ok, running = _load_during_forward(small_spec, event_before_forward=True)
    assert ok and running, "the load waited for the forward queued after the grant's event"


def test_control_a_grant_recorded_after_the_forward_waits_for_it(small_spec) -> None:
    ok, running = _load_during_forward(small_spec, event_before_forward=False)
    assert ok and not running, "the load completed before the GPU work its event follows"

"""GPU completion on prefill: the event the service waits on before anyone reads what the GPU wrote (a lease
waits for it in the UNREADY state, ``lease``)."""

from __future__ import annotations

from typing import Protocol


class ReadyEvent(Protocol):
    """Completes once the GPU work that wrote a grant's pages has finished: a ``torch.cuda.Event`` recorded on
    the writing stream after the forward (with MTP, after the drafter's last step) satisfies it. The service
    only polls ``query``, on its own thread: an event tied to a device should make that device current for
    the call itself. ``synchronize`` is part of the shape so any CUDA event type fits."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

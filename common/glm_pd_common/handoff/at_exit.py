"""Every service is closed before the interpreter finalizes, whoever forgot to close it.

A daemon thread that is inside a NIXL call (pybind11, the GIL released) when Python finalizes is ended as it
takes the GIL back, by an unwind through C++ frames that may not throw: std::terminate aborts the process
("terminate called without an active exception"). An engine whose start-up is refused after its workers started
their services (vLLM runs the scheduler's checks once the caches are registered) would abort instead of exiting
with the refusal. ``atexit`` runs before daemon threads are cut off, so a service still open is closed there.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable


def close_at_exit(close: Callable[[], None]) -> Callable[[], None]:
    """Run ``close`` at interpreter exit; the returned call withdraws it (call it from ``close``, so a closed
    service is neither closed twice nor kept alive by the registry)."""
    atexit.register(close)
    return lambda: atexit.unregister(close)

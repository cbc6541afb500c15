"""Prefill's digests of what a claim reads: computed on threads of their own, never the service thread (a long
request's digest reads gigabytes: tens of ms on a GPU, seconds on the host), and handed back to it to answer the claim;
and, on the same threads, the per-page digests decode asks for after a mismatch, to name the first bad page (one
query of a request at a time per decode rank: a decode cannot queue up reads)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from glm_pd_common.errors import GlmPdError
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from glm_pd_common.layout.plan import TransferPlan
from glm_pd_common.transport.devices import ThreadSetup
from glm_pd_common.transport.digests import MAX_PAGE_QUERIES, page_digests, plan_digests
from glm_pd_common.transport.memory import MemoryReader

DIGEST_THREADS = 2  # claims digested at once (each reads its plan's source runs)


@dataclass(frozen=True)
class Digested:
    """A claim's digests on their way back to the service thread: ``SourceDigests``, or ``Failed`` naming why
    there are none."""

    ident: bytes
    answer: protocol.SourceDigests | protocol.Failed


@dataclass(frozen=True)
class PagesDigested:
    """The answer to a decode's page-digest query, on its way back to the service thread."""

    ident: bytes
    answer: protocol.PageDigests | protocol.Failed


class ClaimDigests:
    """Digest threads of one prefill rank; each result goes to ``deliver`` (the service's inbox). ``query`` and
    ``answered`` run on the service thread only."""

    def __init__(
        self,
        memory: MemoryReader,
        name: str,
        on_thread: ThreadSetup,
        deliver: Callable[[Digested | PagesDigested], None],
    ) -> None:
        self._memory, self._deliver = memory, deliver
        self._queries: set[tuple[bytes, str]] = set()  # page queries being answered: (decode rank, request)
        self._pool = ThreadPoolExecutor(
            DIGEST_THREADS, thread_name_prefix=f"glm-pd-digest-{name}", initializer=on_thread
        )

    def submit(self, ident: bytes, request_id: str, plan: TransferPlan) -> None:
        self._pool.submit(self._digest, ident, request_id, plan)

    def query(self, ident: bytes, msg: protocol.DigestQuery, plan: TransferPlan | None) -> bool:
        """Answer a page-digest query of the plan this decode rank claimed; False while one of that request is
        still being answered."""
        key = (ident, msg.request_id)
        if key in self._queries:
            return False
        self._queries.add(key)
        self._pool.submit(self._pages, ident, msg, plan)
        return True

    def answered(self, done: PagesDigested) -> None:
        """The service thread took a query's answer: that decode may ask again."""
        self._queries.discard((done.ident, done.answer.request_id))

    def _pages(self, ident: bytes, msg: protocol.DigestQuery, plan: TransferPlan | None) -> None:
        answer: protocol.PageDigests | protocol.Failed
        try:
            answer = page_answer(plan, msg, self._memory)
        except Exception as exc:  # as a claim's digests: that decode's query fails, nothing else
            why = protocol.clip(f"per-page digests failed: {exc if isinstance(exc, GlmPdError) else repr(exc)}")
            answer = protocol.Failed(v=PROTOCOL_VERSION, request_id=msg.request_id, reason=why, code="digest")
        self._deliver(PagesDigested(ident, answer))

    def _digest(self, ident: bytes, request_id: str, plan: TransferPlan) -> None:
        try:
            digests = plan_digests(plan, "src", self._memory)
            answer: protocol.SourceDigests | protocol.Failed = protocol.SourceDigests(
                v=PROTOCOL_VERSION, request_id=request_id, digests=digests
            )
        except Exception as exc:  # memory this rank cannot read (or a bug): decode's verification cannot be served
            why = protocol.clip(str(exc) if isinstance(exc, GlmPdError) else repr(exc))
            answer = protocol.Failed(v=PROTOCOL_VERSION, request_id=request_id, reason=why, code="digest")
        done = Digested(ident, answer)
        self._deliver(done)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def page_answer(plan: TransferPlan | None, msg: protocol.DigestQuery, memory: MemoryReader) -> protocol.PageDigests:
    """Per-page digests of the regions decode named (at most ``MAX_PAGE_QUERIES``, of the plan it claimed)."""
    known = len(plan.entries) if plan is not None else 0
    wanted = [i for i in msg.region_indices if 0 <= i < known][:MAX_PAGE_QUERIES]
    pages = {i: page_digests(plan, i, "src", memory) for i in wanted} if plan is not None else {}
    return protocol.PageDigests(v=PROTOCOL_VERSION, request_id=msg.request_id, pages=pages)

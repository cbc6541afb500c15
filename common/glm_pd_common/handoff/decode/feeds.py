"""What decode has heard of a streamed transfer from one prefill rank, and which tokens it may read next.

Pure state, no I/O: the decode service feeds it prefill's ``Progress`` messages and posts the reads it names.
Every message is checked before it counts: the prompt must be decode's, pages arrive in order with none
skipped, and the final table (with the lease) must extend the pages already read from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from glm_pd_common.errors import PlanError, ProtocolError
from glm_pd_common.handoff.wire import protocol


@dataclass
class Feed:
    rank: int  # the prefill rank
    reads: bool  # a source of this decode rank (else it only holds a copy this rank releases)
    read_to: int  # tokens read so far: the reads start at decode's own prefix hit
    table: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    ready_tokens: int = 0
    lease_id: str = ""

    def take(self, msg: protocol.Progress, num_tokens: int) -> None:
        """Apply one ``Progress`` of a transfer of ``num_tokens`` (decode's prompt)."""
        if msg.num_tokens and msg.num_tokens != num_tokens:
            raise PlanError(f"prefill rank {self.rank}'s prompt has {msg.num_tokens} tokens; decode's has {num_tokens}")
        if msg.ready_tokens > num_tokens:
            raise ProtocolError(f"prefill rank {self.rank} says {msg.ready_tokens} of {num_tokens} tokens are ready")
        pages = np.asarray(msg.pages, dtype=np.int64)
        if msg.lease_id and msg.first_page == 0:  # the whole final table
            if not np.array_equal(pages[: self.table.size], self.table):
                raise PlanError(f"prefill rank {self.rank}'s final page table does not extend the pages it streamed")
            self.table = pages
        elif msg.first_page != self.table.size:
            raise ProtocolError(
                f"prefill rank {self.rank} sent pages from index {msg.first_page}; {self.table.size} arrived before"
            )
        else:
            self.table = np.concatenate([self.table, pages])
        if msg.lease_id:
            if self.lease_id and msg.lease_id != self.lease_id:
                raise ProtocolError(f"prefill rank {self.rank} named lease {msg.lease_id}, then {self.lease_id}")
            self.lease_id, self.ready_tokens = msg.lease_id, num_tokens
        else:
            self.ready_tokens = max(self.ready_tokens, msg.ready_tokens)

    def next_read(self, align_tokens: int, num_tokens: int) -> tuple[int, int] | None:
        """Tokens ``[start, end)`` to read now, or None. Before the lease, only whole decode pages
        (``align_tokens``): a page read now is never read again; the lease brings the rest."""
        end = num_tokens if self.lease_id else self.ready_tokens // align_tokens * align_tokens
        if not self.reads or end <= self.read_to:
            return None
        return self.read_to, end

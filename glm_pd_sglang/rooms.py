"""Pure checks and page math for one SGLang room, shared by the prefill and decode sides of the backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from glm_pd_common.errors import PageOutOfRange, PlanError, ProtocolError
from glm_pd_common.layout.pages import INT64_MAX, as_page_ids, suffix_page_span
from glm_pd_common.transport.base import Span


@dataclass
class Target:
    """One decode rank's destination for a room, as its room message described it."""

    agent_name: str
    endpoint: str
    dst_port: int
    is_dummy: bool
    required_dst_info_num: int
    dst_pages: np.ndarray
    aux_index: int | None
    decode_prefix_len: int


def check_suffix(
    prefix_tokens: int, pages: np.ndarray, state_pages: np.ndarray | None, page_tokens: int, *, side: str
) -> None:
    """The rule both sides apply to decode's numbers: a page-aligned prefix, and DSA state pages that are
    the main KV's suffix pages (SGLang indexes the indexer by the KV page ids)."""
    if prefix_tokens < 0:
        raise PlanError(f"{side}: decode prefix length {prefix_tokens} is negative")
    if prefix_tokens + max(pages.size, 1) * page_tokens > INT64_MAX:  # the plan's token math is int64
        raise PlanError(f"{side}: decode prefix length {prefix_tokens} with {pages.size} pages reaches past int64")
    # The same core rule the plan applies; any positive token count past the prefix checks the alignment.
    suffix_page_span(
        prefix_tokens + max(pages.size, 1) * page_tokens, prefix_tokens, page_tokens, align_tokens=page_tokens
    )
    if state_pages is None:
        raise PlanError(f"{side}: no DSA state (indexer) pages for the suffix; the indexer must travel with the KV")
    if state_pages.shape != pages.shape or not np.array_equal(state_pages, pages):
        raise PlanError(
            f"{side}: DSA state pages ({state_pages.size}) are not the main KV suffix pages ({pages.size}); "
            "the indexer would land on other tokens' pages"
        )


@overload
def int_pages(values: Sequence[int] | np.ndarray, *, what: str) -> np.ndarray: ...
@overload
def int_pages(values: Sequence[int] | np.ndarray | None, *, what: str) -> np.ndarray | None: ...
def int_pages(values: Sequence[int] | np.ndarray | None, *, what: str) -> np.ndarray | None:
    """Remote or engine page lists as flat int64 through the core's one hostile-id parser, refusing the rest."""
    if values is None:
        return None
    try:
        arr = as_page_ids(values, side=what)  # an id past int64 is refused there, as sent
    except (ValueError, OverflowError, TypeError) as exc:  # ragged
        raise ProtocolError(f"{what} are not a flat list of 64-bit integers: {exc}") from exc
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ProtocolError(f"{what} are not integers (dtype {arr.dtype})")
    return arr.astype(np.int64, copy=False).reshape(-1)  # an empty list arrives as float64


def check_aux(local_items: list[int], remote: Sequence[tuple[int, int, int]], *, peer: str) -> list[Span]:
    """Decode's metadata buffers pair positionally with prefill's: same count and item lengths, or refuse."""
    theirs = [item for _, _, item in remote]
    if theirs != local_items:
        raise ProtocolError(
            f"metadata buffers differ: prefill item lengths {local_items}, decode {peer} {theirs}. An optional "
            "metadata buffer is enabled on one side only (--disaggregation-enable-kv-checksum, "
            "SGLANG_ENABLE_DISAGG_SAMPLING_MASK, or the DSA top-k output buffer)"
        )
    spans = []
    for i, (ptr, data_len, item) in enumerate(remote):
        if ptr <= 0 or data_len < item or item < 0 or ptr + data_len > INT64_MAX:
            raise ProtocolError(f"decode {peer} metadata buffer {i}: pointer {ptr:#x}, {data_len} B, item {item} B")
        spans.append(Span(f"decode aux[{i}]", ptr, data_len))
    return spans


def aux_runs(
    src: list[Span], dst: list[Span], items: list[int], src_index: int, dst_index: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The metadata row of a request: one run per buffer, bounds-checked on both sides (zero-width skipped)."""
    out_src, out_dst, lengths = [], [], []
    for s, d, item in zip(src, dst, items, strict=True):
        if item == 0:
            continue
        for span, index, side in ((s, src_index, "prefill"), (d, dst_index, "decode")):
            if index < 0 or (index + 1) * item > span.size_bytes:
                raise PageOutOfRange(
                    f"{side} metadata slot {index} is outside {span.name} ({span.size_bytes // item} slots)"
                )
        out_src.append(s.base_addr + src_index * item)
        out_dst.append(d.base_addr + dst_index * item)
        lengths.append(item)
    return (np.array(out_src, dtype=np.int64), np.array(out_dst, dtype=np.int64), np.array(lengths, dtype=np.int64))

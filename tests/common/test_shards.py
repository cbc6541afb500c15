"""Context-parallel (token- and layer-sharded) caches: every decode rank ends up with exactly the tokens and
layers it holds, each byte from one prefill rank, suffix only, whatever the two sides' shards and pages."""

from __future__ import annotations

import ctypes
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.capacity import AccountInputs, traffic
from glm_pd_common.layout.fingerprint import PeerShape, check_shape
from glm_pd_common.layout.pages import suffix_pages
from glm_pd_common.layout.plan import build_plan
from glm_pd_common.layout.shards import Sharding, TokenShard, owned_layers, token_shard
from glm_pd_common.layout.tp import SUPPORTED_TP, SideLayout, expected_releases, release_set, sources
from glm_pd_common.tools.hostmem import HostCaches

SEED = 11


def enumerated_slots(count: int, interleave: int, num_tokens: int) -> dict[int, tuple[int, int]]:
    """Token -> (shard, slot), by dealing tokens out in turns of ``interleave`` and counting each shard's."""
    out, filled = {}, [0] * count
    for start in range(0, num_tokens, interleave):
        shard = (start // interleave) % count
        for t in range(start, min(start + interleave, num_tokens)):
            out[t] = (shard, filled[shard])
            filled[shard] += 1
    return out


@pytest.mark.parametrize(("count", "interleave"), list(itertools.product([1, 2, 4, 8], [1, 2, 16, 64])))
def test_token_slots_deal_tokens_out_in_turns(count: int, interleave: int) -> None:
    n = 3 * count * interleave + 5
    slots = enumerated_slots(count, interleave, n)
    tokens = np.arange(n)
    for k in range(count):
        shard = TokenShard(count, k, interleave) if count > 1 else TokenShard()
        mine = tokens[shard.owns(tokens)]
        assert mine.tolist() == [t for t in range(n) if slots[t][0] == k]
        assert shard.local(mine).tolist() == [slots[t][1] for t in mine]


def layouts(spec, p_tp, p_sharding, d_tp, d_sharding):
    g = spec.geometry
    return SideLayout.of(p_tp, p_sharding, g), SideLayout.of(d_tp, d_sharding, g)


@st.composite
def sides(draw, *, decode: bool):
    tp = draw(st.sampled_from([1, 2, 4]))
    page = draw(st.sampled_from([16, 32, 64]))
    kind = draw(st.sampled_from(["replicated", "tokens"] + ([] if decode else ["layers"])))
    divisors = [n for n in (2, 4) if tp % n == 0]
    if kind == "tokens" and divisors:
        n = draw(st.sampled_from(divisors))
        sharding = Sharding(n, draw(st.sampled_from([i for i in (1, 2, 16, 64) if page % i == 0])))
    elif kind == "layers" and divisors:
        sharding = Sharding(layer_shards=draw(st.sampled_from(divisors)))
    else:
        sharding = Sharding()
    return tp, page, sharding


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefill=sides(decode=False), decode=sides(decode=True), data=st.data())
def test_every_decode_rank_gets_its_share_byte_exact_from_one_source(small_spec, prefill, decode, data) -> None:
    (p_tp, p_pt, p_sh), (d_tp, d_pt, d_sh) = prefill, decode
    p_layout, d_layout = layouts(small_spec, p_tp, p_sh, d_tp, d_sh)
    p_span, d_span = p_pt * p_sh.token_shards, d_pt * d_sh.token_shards
    num_tokens = data.draw(st.integers(1, 900))
    prefix = data.draw(st.integers(0, (num_tokens - 1) // d_span)) * d_span
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # one page table per side, shared by its ranks (one scheduler block table), each entry spanning the
    # page times the token shards
    p_pages, d_pages = math.ceil(num_tokens / p_span), math.ceil(num_tokens / d_span)
    p_table, d_table = rng.permutation(p_pages + 3)[:p_pages], rng.permutation(d_pages + 3)[:d_pages]

    src = {
        r: HostCaches(
            small_spec,
            page_tokens=p_pt,
            num_pages=p_pages + 3,
            shard=token_shard(r, p_sh),
            held=p_layout.layers(r),
        )
        for r in range(p_tp)
    }
    for caches in src.values():
        caches.write_tokens(p_table, 0, num_tokens, seed=SEED)
    for d in range(d_tp):
        dst = HostCaches(small_spec, page_tokens=d_pt, num_pages=d_pages + 3, shard=token_shard(d, d_sh))
        dst.write_tokens(d_table, 0, prefix, seed=SEED)  # decode's prefix hit: already there
        written = {r.key: np.zeros(r.size_bytes, dtype=np.int64) for r in dst.regions}
        mine = token_shard(d, d_sh)
        for source in sources(d, p_layout, d_layout):
            plan = build_plan(
                src[source.rank].regions,
                dst.regions,
                suffix_pages(p_table, num_tokens, prefix, source.shard.table_tokens(p_pt), align_tokens=d_span),
                suffix_pages(d_table, num_tokens, prefix, d_span, align_tokens=d_span),
                num_tokens=num_tokens,
                prefix_tokens=prefix,
                src_shard=source.shard,
                dst_shard=mine,
                layers=source.layers,
            )
            for entry in plan.entries:
                for off, n in zip(entry.dst_offsets.tolist(), entry.lengths.tolist(), strict=True):
                    written[entry.dst.key][off : off + n] += 1
            for s, t, n in zip(*plan.absolute_runs(), strict=True):
                ctypes.memmove(int(t), int(s), int(n))
        assert dst.mismatched_tokens(d_table, 0, num_tokens, seed=SEED) == [], f"decode rank {d}"
        overlap = {k: int(w.max()) for k, w in written.items() if w.size and w.max() > 1}
        assert not overlap, f"decode rank {d}: bytes written by two runs or sources: {overlap}"


@pytest.mark.parametrize(("p", "d"), list(itertools.product(SUPPORTED_TP, SUPPORTED_TP)))
def test_replicated_pairing_is_contiguous_groups_and_every_copy_is_released(small_spec, p, d) -> None:
    """Without context parallelism a decode rank reads one whole copy: decode rank r of D reads prefill rank
    r·P // D (SGLang's MLA pairing); prefill ranks nobody reads are released by the decode rank r·D // P."""
    prefill, decode = layouts(small_spec, p, Sharding(), d, Sharding())
    for r in range(d):
        (only,) = sources(r, prefill, decode)
        assert only.rank == r * p // d and only.layers == small_spec.geometry.all_layers
    released = [rank for r in range(d) for rank in release_set(r, prefill, decode)]
    assert sorted(set(released)) == list(range(p))
    for rank in range(p):
        assert expected_releases(rank, prefill, decode) == released.count(rank) >= 1


def test_token_sharded_pairs_read_only_overlapping_shards(small_spec) -> None:
    """Prefill DCP 2 (interleave 1) to decode DCP 4: decode shard k holds tokens k mod 4, which all live on
    prefill shard k mod 2; TP 4 prefill has two copies of each shard, spread over the decode ranks."""
    prefill, decode = layouts(small_spec, 4, Sharding(2, 1), 4, Sharding(4, 1))
    assert [[s.rank for s in sources(r, prefill, decode)] for r in range(4)] == [[0], [1], [2], [3]]
    prefill, decode = layouts(small_spec, 4, Sharding(2, 1), 2, Sharding())
    # a replicated decode rank holds every token: it reads both prefill shards, from different copies
    assert [[s.rank for s in sources(r, prefill, decode)] for r in range(2)] == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("layers", "shards", "tp", "want"),
    [
        (10, 4, 4, [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9, 10)]),  # SGLang's rule; the MTP layer 10 goes last
        (6, 2, 4, [(0, 1, 2), (0, 1, 2), (3, 4, 5, 6), (3, 4, 5, 6)]),  # CP outside attention TP
        (78, 8, 8, None),
    ],
)
def test_a_layer_split_gives_contiguous_shares_mtp_to_the_last(layers, shards, tp, want) -> None:
    held = [owned_layers(layers, 1, Sharding(layer_shards=shards), r, tp) for r in range(tp)]
    if want is not None:
        assert held == want
    per_shard = {h for h in held}
    assert sorted(x for h in per_shard for x in h) == list(range(layers + 1))
    sizes = sorted(len(set(h) - {layers}) for h in per_shard)
    assert sizes[-1] - sizes[0] <= 1


def test_a_layer_split_prefill_serves_each_layer_from_its_owner(small_spec) -> None:
    split = Sharding(layer_shards=2)
    prefill, decode = layouts(small_spec, 2, split, 2, Sharding(2, 1))
    held = {r: prefill.layers(r) for r in range(2)}
    assert sorted(held[0] + held[1]) == list(small_spec.geometry.all_layers)
    for r in range(2):
        got = {s.rank: s.layers for s in sources(r, prefill, decode)}
        assert got == held


@pytest.mark.parametrize(
    ("sharding", "tp", "page", "message"),
    [
        (Sharding(3, 1), 4, 64, "token_shards 3 must divide its TP size 4"),
        (Sharding(2, 48), 2, 64, "interleave 48 must divide its page of 64 tokens"),
        (Sharding(layer_shards=8), 4, 64, "layer_shards 8 must divide its TP size 4"),
        (Sharding(2, 1, 2), 4, 64, "shards both tokens (2) and layers (2)"),
    ],
)
def test_a_sharding_the_plan_cannot_convert_is_refused_naming_it(sharding, tp, page, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_shape(PeerShape(page, tp, 0, sharding=sharding), side="decode")


def test_decode_dcp_8_moves_one_copy_in_all(small_spec) -> None:
    """Replicated, each of eight decode ranks pulls a whole copy; with DCP 8 the eight pull one copy together."""
    g = small_spec.geometry
    per_token = len(g.all_layers) * small_spec.row.row_bytes + len(g.indexer_layers) * small_spec.indexer.row_bytes
    n = 64 * 8 * 10
    base = AccountInputs(small_spec.geometry, small_spec.row, small_spec.indexer, n, prefill_tp=8, decode_tp=8)
    replicated = traffic(base)
    assert sum(sum(k.values()) for k in replicated.received.values()) == 8 * per_token * n
    sharded = traffic(
        AccountInputs(
            small_spec.geometry,
            small_spec.row,
            small_spec.indexer,
            n,
            prefill_tp=8,
            decode_tp=8,
            prefill_sharding=Sharding(8, 1),
            decode_sharding=Sharding(8, 1),
        )
    )
    assert [sum(k.values()) for k in sharded.received.values()] == [per_token * n // 8] * 8
    assert list(sharded.sent.values()) == [per_token * n // 8] * 8


def test_a_tp_size_or_rank_outside_the_supported_shapes_is_refused(small_spec) -> None:
    with pytest.raises(ConfigError, match="tp_size must be one of"):
        layouts(small_spec, 3, Sharding(), 2, Sharding())
    prefill, decode = layouts(small_spec, 2, Sharding(), 4, Sharding())
    with pytest.raises(ConfigError, match=r"decode_rank 4 is outside 0\.\.3"):
        sources(4, prefill, decode)
    with pytest.raises(ConfigError, match=r"prefill_rank 2 is outside 0\.\.1"):
        expected_releases(2, prefill, decode)


def test_a_layer_split_account_counts_every_region_decode_reads(small_spec) -> None:
    """Decode rank 0 reads its layers from several prefill ranks: the account's regions span all of them, and
    each of its round trips (a claim and a release per prefill rank) is counted."""
    from glm_pd_common.layout.capacity import account

    g = small_spec.geometry
    inputs = AccountInputs(
        g, small_spec.row, small_spec.indexer, 640, prefill_tp=2, decode_tp=2, prefill_sharding=Sharding(layer_shards=2)
    )
    a = account(inputs)
    assert a["regions_per_rank"] == len(g.all_layers) + len(g.indexer_layers)
    assert a["exposed"]["round_trips"] == 2 + 2

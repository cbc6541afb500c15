import itertools
from collections import Counter

import pytest

from glm_pd_common.errors import ConfigError
from glm_pd_common.layout.tp import (
    SUPPORTED_TP,
    decode_ranks_served,
    expected_releases,
    release_group,
    source_rank,
    source_ranks,
)


@pytest.mark.parametrize(("p", "d"), list(itertools.product(SUPPORTED_TP, SUPPORTED_TP)))
def test_each_decode_rank_has_one_source_spread_evenly(p, d):
    sources = source_ranks(p, d)
    assert len(sources) == d
    assert all(0 <= s < p for s in sources)
    load = Counter(sources.tolist())
    # used prefill ranks: all of them when decode has at least as many ranks, else one per decode rank
    assert len(load) == min(p, d)
    assert max(load.values()) - min(load.values()) == 0
    for r in range(d):
        assert source_rank(r, p, d) == sources[r]
    served = [x for rank in range(p) for x in decode_ranks_served(rank, p, d)]
    assert sorted(served) == list(range(d))


def test_dummies_when_decode_smaller():
    assert decode_ranks_served(0, 8, 2) == [0]
    assert decode_ranks_served(4, 8, 2) == [1]
    assert decode_ranks_served(1, 8, 2) == []


def test_bad_tp_is_refused():
    with pytest.raises(ConfigError, match="prefill_tp"):
        source_ranks(3, 2)
    with pytest.raises(ConfigError, match="decode_rank"):
        source_rank(4, 2, 4)


@pytest.mark.parametrize(("p", "d"), list(itertools.product(SUPPORTED_TP, SUPPORTED_TP)))
def test_release_groups_cover_every_prefill_rank(p, d):
    groups = [release_group(r, p, d) for r in range(d)]
    assert all(source_rank(r, p, d) == g[0] for r, g in enumerate(groups))
    counts = Counter(x for g in groups for x in g)
    assert sorted(counts) == list(range(p))  # every prefill rank is released by someone
    for rank in range(p):
        assert expected_releases(rank, p, d) == counts[rank] >= 1

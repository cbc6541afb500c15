import numpy as np
import pytest

from glm_pd_common.errors import ConfigError, LeaseExpired
from glm_pd_common.handoff.decode.states import Handoff, HandoffState
from glm_pd_common.handoff.prefill.lease import LeaseTable
from glm_pd_common.handoff.wire.protocol import RENEWALS_PER_LEASE, renew_interval


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_release_before_expiry_frees_pages():
    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    table.grant("r1", np.array([3, 4]))
    clock.now += 29
    assert table.release("r1").tolist() == [3, 4]
    assert len(table) == 0


def test_claim_extends_and_expired_release_fails_but_pages_are_returned_by_expire():
    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    table.grant("r1", np.array([1]))
    clock.now += 20
    table.claim("r1")
    clock.now += 50  # past the grant ttl, inside the claim's transfer ttl
    assert table.release("r1").tolist() == [1]
    table.grant("r2", np.array([2]))
    clock.now += 31
    with pytest.raises(LeaseExpired, match="r2"):
        table.release("r2")
    with pytest.raises(LeaseExpired):
        table.claim("r2")
    assert [lease.request_id for lease in table.expire()] == ["r2"]
    assert len(table) == 0


def test_duplicate_grant_refused_and_drop_is_idempotent():
    table = LeaseTable(ttl_s=1, transfer_ttl_s=1)
    table.grant("r", np.array([1]))
    with pytest.raises(ValueError, match="already holds"):
        table.grant("r", np.array([2]))
    assert table.drop("r").tolist() == [1]
    assert table.drop("r") is None


def test_handoff_transitions():
    h = Handoff("r")
    h.advance(HandoffState.WAITING_FOR_INPUT)
    with pytest.raises(RuntimeError, match="illegal"):
        h.advance(HandoffState.SUCCESS)
    h.advance(HandoffState.TRANSFERRING)
    h.advance(HandoffState.SUCCESS)
    h.fail("late")
    assert h.state is HandoffState.SUCCESS and h.reason is None
    assert h.states == ["BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING", "SUCCESS"]
    assert int(HandoffState.TRANSFERRING) == 3


def test_lease_waits_for_every_expected_release():
    table = LeaseTable(ttl_s=30, transfer_ttl_s=30)
    table.grant("r", np.array([7]), releases=2)
    assert table.release("r") is None
    assert "r" in table
    assert table.release("r").tolist() == [7]
    assert "r" not in table


def test_renewal_holds_an_unclaimed_lease_one_more_ttl_from_now():
    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    table.grant("r", np.array([5]))
    for _ in range(4):  # 100 s in all, more than three leases: each renewal inside the last one's ttl
        clock.now += 25
        assert table.renew("r") is True
        assert table.expire() == []
    clock.now += 29
    assert table.release("r").tolist() == [5]


def test_renewal_never_shortens_a_claim_nor_revives_an_expired_lease():
    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    table.grant("claimed", np.array([1]))
    table.grant("late", np.array([2]))
    table.claim("claimed")  # held 60 s for the read
    clock.now += 10
    assert table.renew("claimed") is False  # the claim's hold governs
    clock.now += 40  # 50 s after the claim: a renewal that had re-based it to 30 s from then would still hold
    assert table.release("claimed").tolist() == [1]
    # "late" expired at 130, unclaimed and unrenewed; it is 150 now
    with pytest.raises(LeaseExpired, match="late: lease expired"):
        table.renew("late")
    with pytest.raises(LeaseExpired, match="late: lease expired"):
        table.claim("late")  # still expired: the renewal did not bring it back
    assert [lease.request_id for lease in table.expire()] == ["late"]
    with pytest.raises(LeaseExpired, match="no lease held"):
        table.renew("late")


@pytest.mark.parametrize("lease_s", [30.0, 0.6, 1e-3])
def test_renew_interval_gives_six_chances_per_lease(lease_s):
    assert renew_interval(lease_s) * RENEWALS_PER_LEASE == pytest.approx(lease_s)
    assert RENEWALS_PER_LEASE == 6  # vLLM's NIXL heartbeats at lease / 6: the same margin


@pytest.mark.parametrize("lease_s", [0.0, -1.0, float("nan")])
def test_renew_interval_refuses_a_lease_that_is_not_positive(lease_s):
    with pytest.raises(ConfigError, match="lease_s must be positive"):
        renew_interval(lease_s)

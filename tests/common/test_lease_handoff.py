import numpy as np
import pytest

from glm_pd_common.errors import ConfigError, LeaseExpired
from glm_pd_common.handoff.decode.states import Handoff, HandoffState
from glm_pd_common.handoff.prefill.lease import IllegalTransition, Lease, LeaseState, LeaseTable
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
    assert table.release("r1").pages.tolist() == [3, 4]
    assert len(table) == 0


def test_claim_extends_and_expired_release_fails_but_pages_are_returned_by_expire():
    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    table.grant("r1", np.array([1]))
    clock.now += 20
    table.claim("r1")
    clock.now += 50  # past the grant ttl, inside the claim's transfer ttl
    assert table.release("r1").pages.tolist() == [1]
    table.grant("r2", np.array([2]))
    clock.now += 31
    with pytest.raises(LeaseExpired, match="r2"):
        table.release("r2")
    with pytest.raises(LeaseExpired):
        table.claim("r2")
    assert [lease.request_id for lease in table.expire()] == ["r2"]
    assert len(table) == 0


def test_duplicate_grant_refused_and_end_is_idempotent():
    table = LeaseTable(ttl_s=1, transfer_ttl_s=1)
    table.grant("r", np.array([1]))
    with pytest.raises(ValueError, match="already holds"):
        table.grant("r", np.array([2]))
    assert table.end("r", "aborted").pages.tolist() == [1]
    assert table.end("r", "aborted") is None
    assert table.ended.get("r") == "aborted"


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
    assert table.release("r").pages.tolist() == [7]
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
    assert table.release("r").pages.tolist() == [5]


def test_renewal_never_shortens_a_claim_nor_revives_an_expired_lease():
    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    table.grant("claimed", np.array([1]))
    table.grant("late", np.array([2]))
    table.claim("claimed")  # held 60 s for the read
    clock.now += 10
    assert table.renew("claimed") is False  # the claim's hold governs
    clock.now += 40  # 50 s after the claim: a renewal that had re-based it to 30 s from then would still hold
    assert table.release("claimed").pages.tolist() == [1]
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


class Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_lease_walks_its_states_and_an_illegal_move_names_both():
    """AWAITED (a claim came first) -> UNREADY (granted, GPU writing) -> HELD -> CLAIMED -> ENDED, and nothing
    else: the table refuses a move its transition table does not list, naming the lease and both states."""
    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    claim = object()
    table.wait("r", b"decode-0", claim, bound_s=5)  # type: ignore[arg-type]
    lease = table.get("r")
    assert lease is not None and lease.state is LeaseState.AWAITED and table.held("r") is None
    event = Event()
    table.grant("r", np.array([4, 5]), ready=event)
    assert lease.state is LeaseState.UNREADY and table.poll_ready() == ([], [])
    clock.now += 100  # an unready grant has no lease clock: only its own ttl (30 s) to become ready
    event.done = True
    ready, ended = table.poll_ready()
    assert ready == [lease] and ended == []
    table.hold(lease)
    assert lease.state is LeaseState.HELD and lease.expires_at == clock.now + 30
    assert table.take_waiting(lease) == [(b"decode-0", claim)] and not lease.waiting
    table.claim("r", by=b"decode-0")
    assert lease.state is LeaseState.CLAIMED
    with pytest.raises(IllegalTransition, match=r"lease r: illegal transition CLAIMED -> HELD"):
        lease.move(LeaseState.HELD)
    assert table.release("r") is lease and lease.state is LeaseState.ENDED and table.ended.get("r") == "released"
    with pytest.raises(IllegalTransition, match="ENDED -> CLAIMED"):
        lease.move(LeaseState.CLAIMED)


def test_waiting_messages_end_at_their_bound_and_a_never_granted_id_is_not_remembered():
    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    table.wait("early", b"d0", object(), bound_s=5)  # type: ignore[arg-type]
    table.wait("early", b"d1", object(), bound_s=10)  # type: ignore[arg-type]
    table.grant("unready", np.array([1]), ready=Event())
    table.wait("unready", b"d0", object(), bound_s=5)  # type: ignore[arg-type]
    clock.now += 6
    assert table.expire_waiting() == [("early", b"d0")]  # an unready grant's claims wait for it
    clock.now += 5
    assert table.expire_waiting() == [("early", b"d1")]
    assert "early" not in table and table.ended.get("early") is None
    assert table.awaiting_answer() == {b"d0"}
    table.forget_peer(b"d0")
    assert table.leftovers() == {"leases": 0, "unready": 1, "early_claims": 0, "plans": 0}


def test_unready_grants_end_when_their_event_fails_or_never_completes():
    class Broken(Event):
        def query(self) -> bool:
            raise RuntimeError("device lost")

    clock = Clock()
    table = LeaseTable(ttl_s=30, transfer_ttl_s=60, clock=clock)
    table.grant("hung", np.array([1]), ready=Event())
    table.grant("broken", np.array([2]), ready=Broken())
    clock.now += 31
    ready, ended = table.poll_ready()
    assert ready == [] and sorted((lease.request_id, outcome) for lease, outcome, _ in ended) == [
        ("broken", "aborted"),
        ("hung", "expired"),
    ]
    assert isinstance(ended[0][0], Lease)

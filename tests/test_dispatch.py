"""Dispatch and lease rules (PROTOCOL.md §6.3, §1.3): enqueue, claim, delivery
results with backoff, exhaustion, reclaim after a lapse, release, and lease
currency for every lease-carrying mutation."""

import dataclasses
import json
import random
from typing import Any

import pytest
from _support import (
    AGENT_ID,
    DISPATCH_ID,
    EXEC_ID,
    LEASE,
    T0,
    Ids,
    Kernel,
    dispatch,
    event_types,
    execution,
    no_ids,
    payload,
    reply,
    submission,
    with_dispatch,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from rebuno_proto import (
    NO_SESSION,
    Decision,
    Delivery,
    DeliveryResult,
    DispatchSettings,
    DispatchStatus,
    ErrorCode,
    Execution,
    ExecutionCompletion,
    ExecutionFailure,
    ExecutionStatus,
    Lease,
    LeaseStatus,
    Outcome,
    Refusal,
    StepStatus,
    args_hash,
    backoff_delay,
    check_owner,
    claim_dispatch,
    delivery_result,
    end_execution,
    heartbeat,
    holds_lease,
    lease_lapsed,
    lease_refusal,
    lease_status,
    needs_lease_owner,
    parse_step_submission,
    reclaim_lease,
    record_delivery,
    retire_lease_after_restart,
    step_id,
)
from rebuno_proto._dispatch import RENEW_EVERY_S, new_dispatch, renew_lease, retire

SETTINGS = DispatchSettings()


# -- settings and backoff ----------------------------------------------------------------


def test_settings_defaults() -> None:
    assert (SETTINGS.lease_timeout_s, SETTINGS.max_attempts) == (120.0, 5)
    assert (SETTINGS.backoff_base_s, SETTINGS.backoff_max_s) == (1.0, 30.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lease_timeout_s": 0}, "lease_timeout_s must be positive"),
        ({"lease_timeout_s": -1}, "lease_timeout_s must be positive"),
        ({"max_attempts": 0}, "max_attempts must be at least 1"),
        ({"backoff_base_s": -1}, "need 0 <= backoff_base_s <= backoff_max_s"),
        ({"backoff_base_s": 5, "backoff_max_s": 4}, "need 0 <= backoff_base_s <= backoff_max_s"),
    ],
)
def test_settings_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DispatchSettings(**kwargs)


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [
        (0, 1.0),
        (1, 1.0),
        (2, 2.0),
        (3, 4.0),
        (4, 8.0),
        (5, 16.0),
        (6, 30.0),
        (7, 30.0),
        (10**6, 30.0),
    ],
)
def test_backoff_without_jitter(attempt: int, expected: float) -> None:
    assert backoff_delay(attempt, 0.0, SETTINGS) == expected


def test_backoff_jitter_adds_up_to_a_quarter() -> None:
    assert backoff_delay(3, 0.5, SETTINGS) == 4.0 * 1.125
    assert backoff_delay(3, -1.0, SETTINGS) == 4.0
    assert 4.0 * 1.2499 < backoff_delay(3, 1.0, SETTINGS) < 4.0 * 1.25
    assert backoff_delay(3, 7.0, SETTINGS) == backoff_delay(3, 1.0, SETTINGS)


def test_new_dispatch() -> None:
    d = new_dispatch("d1", T0, DispatchSettings(max_attempts=3))
    assert (d.id, d.status, d.attempt, d.max_attempts, d.next_attempt_at, d.locked_at) == (
        "d1",
        DispatchStatus.PENDING,
        0,
        3,
        T0,
        None,
    )


# -- lease classification -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ex", "lease", "owner", "expected"),
    [
        (execution(), LEASE, None, LeaseStatus.CURRENT),
        (execution(), Lease(dispatch_id=DISPATCH_ID, attempt=2), None, LeaseStatus.SUPERSEDED),
        (execution(), Lease(dispatch_id="old", attempt=1), EXEC_ID, LeaseStatus.SUPERSEDED),
        (execution(), Lease(dispatch_id="x", attempt=1), None, LeaseStatus.UNKNOWN),
        (execution(), Lease(dispatch_id="x", attempt=1), "other", LeaseStatus.FOREIGN),
        (
            execution(ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED)),
            LEASE,
            None,
            LeaseStatus.RETIRED_BY_BLOCK,
        ),
        (
            execution(
                ExecutionStatus.COMPLETED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED)
            ),
            LEASE,
            None,
            LeaseStatus.SUPERSEDED,
        ),
        (
            execution(dispatch_record=dispatch(DispatchStatus.PENDING)),
            LEASE,
            None,
            LeaseStatus.SUPERSEDED,
        ),
        (
            execution(dispatch_record=dispatch(DispatchStatus.FAILED)),
            LEASE,
            None,
            LeaseStatus.SUPERSEDED,
        ),
    ],
)
def test_lease_status(ex: Any, lease: Lease, owner: str | None, expected: LeaseStatus) -> None:
    assert lease_status(ex, lease, owner) is expected


def test_needs_lease_owner() -> None:
    assert not needs_lease_owner(execution(), LEASE)
    assert needs_lease_owner(execution(), Lease(dispatch_id="other", attempt=1))
    assert needs_lease_owner(dataclasses.replace(execution(), dispatch=None), LEASE)


def test_lease_refusal_retired_only_when_allowed() -> None:
    ex = execution(ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED))
    assert lease_refusal(ex, LEASE, None, allow_retired=True) is None
    refusal = lease_refusal(ex, LEASE, None, allow_retired=False)
    assert refusal == Refusal(ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded")
    assert lease_refusal(execution(), LEASE, None, allow_retired=False) is None


def test_check_owner() -> None:
    ex = execution()
    assert check_owner(ex, None) is None
    assert check_owner(ex, AGENT_ID) is None
    refusal = check_owner(ex, "agent-2")
    assert refusal is not None
    assert refusal.code is ErrorCode.FORBIDDEN
    assert refusal.status == 403


def test_renew_and_retire_leave_other_states_alone() -> None:
    for d in (dispatch(DispatchStatus.PENDING), dispatch(DispatchStatus.EXHAUSTED)):
        ex = execution(dispatch_record=d)
        assert renew_lease(ex, T0 + 100, always=True) is ex
    bare = dataclasses.replace(execution(), dispatch=None)
    assert renew_lease(bare, T0 + 100) is bare
    assert retire(bare) is bare
    done = execution(dispatch_record=dispatch(DispatchStatus.EXHAUSTED))
    assert retire(done) is done
    for status in (DispatchStatus.PENDING, DispatchStatus.IN_FLIGHT, DispatchStatus.FAILED):
        released = retire(execution(dispatch_record=dispatch(status)))
        assert released.dispatch is not None
        assert released.dispatch.status is DispatchStatus.EXHAUSTED


def test_renew_throttle() -> None:
    ex = execution(dispatch_record=dispatch(locked_at=T0))
    assert renew_lease(ex, T0 + RENEW_EVERY_S / 2) is ex
    renewed = renew_lease(ex, T0 + RENEW_EVERY_S)
    assert renewed.dispatch is not None
    assert renewed.dispatch.locked_at == T0 + RENEW_EVERY_S
    forced = renew_lease(ex, T0 + 0.1, always=True)
    assert forced.dispatch is not None
    assert forced.dispatch.locked_at == T0 + 0.1
    unlocked = execution(dispatch_record=dispatch(locked_at=None))
    assert renew_lease(unlocked, T0).dispatch.locked_at == T0  # type: ignore[union-attr]


# -- enqueue and claim --------------------------------------------------------------------------


def test_create_enqueues_a_pending_dispatch() -> None:
    k = Kernel()
    ex = k.create(input_={"x": 1})
    assert ex.dispatch is not None
    assert (ex.dispatch.status, ex.dispatch.attempt, ex.dispatch.next_attempt_at) == (
        DispatchStatus.PENDING,
        0,
        T0,
    )
    assert k.store.dispatch_owner == {ex.dispatch.id: ex.id}
    queued = k.store.events_of(ex.id)[-1]
    assert queued.type == "dispatch.queued"
    assert payload(queued) == {
        "dispatch_id": ex.dispatch.id,
        "execution_id": ex.id,
        "status": "pending",
        "attempt": 0,
    }


def test_claim_takes_the_lease() -> None:
    ex = execution(dispatch_record=dispatch(DispatchStatus.PENDING, attempt=0, locked_at=None))
    outcome = claim_dispatch(
        execution=ex, session=NO_SESSION, new_id=no_ids, now=T0 + 1, settings=SETTINGS
    )
    assert reply(outcome) == Delivery(
        execution_id=EXEC_ID, agent_id=AGENT_ID, dispatch_id=DISPATCH_ID, attempt=1
    )
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    assert (written.dispatch.status, written.dispatch.attempt, written.dispatch.locked_at) == (
        DispatchStatus.IN_FLIGHT,
        1,
        T0 + 1,
    )
    assert outcome.change.cleared_counters == (EXEC_ID,)
    assert not outcome.change.events
    delivery = reply(outcome)
    assert delivery is not None
    assert delivery.lease() == Lease(dispatch_id=DISPATCH_ID, attempt=1)


@pytest.mark.parametrize(
    "d",
    [
        dispatch(DispatchStatus.IN_FLIGHT),
        dispatch(DispatchStatus.EXHAUSTED),
        dispatch(DispatchStatus.PENDING, next_attempt_at=T0 + 5),
        dispatch(DispatchStatus.FAILED, next_attempt_at=T0 + 5),
    ],
    ids=["in-flight", "exhausted", "pending-not-due", "failed-not-due"],
)
def test_claim_nothing_due(d: Any) -> None:
    outcome = claim_dispatch(
        execution=execution(dispatch_record=d),
        session=NO_SESSION,
        new_id=no_ids,
        now=T0,
        settings=SETTINGS,
    )
    assert outcome.reply is None
    assert outcome.change.is_empty


def test_claim_without_dispatch() -> None:
    ex = dataclasses.replace(execution(ExecutionStatus.PENDING), dispatch=None)
    outcome = claim_dispatch(
        execution=ex, session=NO_SESSION, new_id=no_ids, now=T0, settings=SETTINGS
    )
    assert outcome.reply is None
    assert outcome.change.is_empty


def test_claim_of_terminal_execution_discards() -> None:
    ex = execution(
        ExecutionStatus.CANCELLED, dispatch_record=dispatch(DispatchStatus.PENDING, attempt=2)
    )
    outcome = claim_dispatch(
        execution=ex, session=NO_SESSION, new_id=no_ids, now=T0, settings=SETTINGS
    )
    assert outcome.reply is None
    assert event_types(outcome.change) == ["dispatch.discarded"]
    assert payload(outcome.change.events[0]) == {
        "dispatch_id": DISPATCH_ID,
        "execution_id": EXEC_ID,
        "status": "exhausted",
        "attempt": 2,
    }
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    assert written.dispatch.status is DispatchStatus.EXHAUSTED
    assert written.status is ExecutionStatus.CANCELLED
    assert not outcome.change.cleared_counters


def test_claim_past_max_attempts_fails_the_execution() -> None:
    ex = execution(dispatch_record=dispatch(DispatchStatus.PENDING, attempt=5, max_attempts=5))
    outcome = claim_dispatch(
        execution=ex, session=NO_SESSION, new_id=no_ids, now=T0, settings=SETTINGS
    )
    assert outcome.reply is None
    (written,) = outcome.change.executions
    assert written.status is ExecutionStatus.FAILED
    assert written.failure_reason == "dispatch_exhausted"
    assert written.dispatch is not None
    assert written.dispatch.status is DispatchStatus.EXHAUSTED
    assert event_types(outcome.change) == ["execution.failed"]
    assert payload(outcome.change.events[0]) == {
        "execution_id": EXEC_ID,
        "status": "failed",
        "reason": "dispatch_exhausted",
    }


# -- delivery results ---------------------------------------------------------------------------


def deliver(
    ex: Any, *, acked: bool, lease: Lease = LEASE, jitter: float = 0.0, now: float = T0 + 1
) -> Any:
    return record_delivery(
        execution=ex,
        lease=lease,
        result=DeliveryResult.ACKED if acked else DeliveryResult.REFUSED,
        jitter=jitter,
        session=NO_SESSION,
        new_id=no_ids,
        now=now,
        settings=SETTINGS,
    )


def test_acked_keeps_the_lease() -> None:
    outcome = deliver(execution(dispatch_record=dispatch(locked_at=T0)), acked=True)
    (written,) = outcome.change.executions
    assert written.dispatch.status is DispatchStatus.IN_FLIGHT
    assert written.dispatch.locked_at == T0 + 1
    assert event_types(outcome.change) == ["dispatch.acked"]
    assert payload(outcome.change.events[0]) == {
        "dispatch_id": DISPATCH_ID,
        "execution_id": EXEC_ID,
        "status": "acked",
        "attempt": 1,
    }
    assert outcome.dispatch_due_at is None


def test_failed_delivery_backs_off_with_jitter() -> None:
    ex = execution(dispatch_record=dispatch(attempt=3))
    outcome = deliver(ex, acked=False, lease=Lease(dispatch_id=DISPATCH_ID, attempt=3), jitter=0.5)
    (written,) = outcome.change.executions
    assert written.dispatch.status is DispatchStatus.FAILED
    assert written.dispatch.next_attempt_at == T0 + 1 + 4.0 * 1.125
    assert written.dispatch.locked_at is None
    assert written.status is ExecutionStatus.RUNNING
    assert outcome.dispatch_due_at == T0 + 1 + 4.5
    assert event_types(outcome.change) == ["dispatch.failed"]
    assert payload(outcome.change.events[0])["status"] == "failed"
    assert payload(outcome.change.events[0])["attempt"] == 3


def test_failed_last_attempt_exhausts() -> None:
    ex = execution(dispatch_record=dispatch(attempt=5))
    outcome = deliver(ex, acked=False, lease=Lease(dispatch_id=DISPATCH_ID, attempt=5))
    (written,) = outcome.change.executions
    assert written.status is ExecutionStatus.FAILED
    assert written.failure_reason == "dispatch_exhausted"
    assert written.dispatch.status is DispatchStatus.EXHAUSTED
    assert event_types(outcome.change) == ["dispatch.failed", "execution.failed"]
    assert [e.seq for e in outcome.change.events] == [4, 5]
    assert written.last_event_seq == 5
    assert outcome.dispatch_due_at is None


@pytest.mark.parametrize(
    ("ex", "lease"),
    [
        (execution(), Lease(dispatch_id=DISPATCH_ID, attempt=2)),
        (execution(), Lease(dispatch_id="other", attempt=1)),
        (execution(dispatch_record=dispatch(DispatchStatus.PENDING)), LEASE),
        (execution(ExecutionStatus.CANCELLED), LEASE),
        (dataclasses.replace(execution(), dispatch=None), LEASE),
    ],
    ids=["old-attempt", "other-dispatch", "not-in-flight", "terminal", "no-dispatch"],
)
@pytest.mark.parametrize("acked", [True, False])
def test_delivery_result_for_a_stale_lease_changes_nothing(
    ex: Any, lease: Lease, acked: bool
) -> None:
    outcome = deliver(ex, acked=acked, lease=lease)
    assert outcome.reply is None
    assert outcome.change.is_empty


def test_retry_then_success_through_the_kernel() -> None:
    k = Kernel()
    ex = k.create()
    first = k.claim(ex.id)
    assert first is not None
    assert first.attempt == 1
    k.deliver(ex.id, first.lease(), acked=False, jitter=0.0)
    assert k.claim(ex.id) is None  # not due yet
    k.now += 1.0
    second = k.claim(ex.id)
    assert second is not None
    assert (second.dispatch_id, second.attempt) == (first.dispatch_id, 2)
    k.deliver(ex.id, second.lease(), acked=True)
    assert [e.type for e in k.store.events_of(ex.id)] == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
        "dispatch.failed",
        "dispatch.acked",
    ]


def test_exhaustion_after_max_attempts_through_the_kernel() -> None:
    k = Kernel(DispatchSettings(max_attempts=3, backoff_base_s=0.0, backoff_max_s=0.0))
    ex = k.create()
    for attempt in (1, 2, 3):
        delivery = k.claim(ex.id)
        assert delivery is not None
        assert delivery.attempt == attempt
        k.deliver(ex.id, delivery.lease(), acked=False)
    assert k.ex(ex.id).status is ExecutionStatus.FAILED
    assert k.ex(ex.id).failure_reason == "dispatch_exhausted"
    assert k.claim(ex.id) is None


# -- reclaim ----------------------------------------------------------------------------------


def test_lease_lapsed() -> None:
    ex = execution(dispatch_record=dispatch(locked_at=T0))
    assert not lease_lapsed(ex, T0 + 119.9, SETTINGS)
    assert lease_lapsed(ex, T0 + 120.0, SETTINGS)
    assert not lease_lapsed(execution(dispatch_record=dispatch(locked_at=None)), T0 + 1e6, SETTINGS)
    assert not lease_lapsed(
        execution(dispatch_record=dispatch(DispatchStatus.PENDING)), T0 + 1e6, SETTINGS
    )
    assert not lease_lapsed(dataclasses.replace(ex, dispatch=None), T0 + 1e6, SETTINGS)


def test_reclaim_requeues_the_same_dispatch() -> None:
    ex = execution(dispatch_record=dispatch(attempt=2, locked_at=T0))
    outcome = reclaim_lease(execution=ex, now=T0 + 200, settings=SETTINGS)
    assert outcome.reply is True
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    assert (written.dispatch.id, written.dispatch.status, written.dispatch.attempt) == (
        DISPATCH_ID,
        DispatchStatus.PENDING,
        2,
    )
    assert written.dispatch.next_attempt_at == T0 + 200
    assert written.dispatch.locked_at is None
    assert event_types(outcome.change) == ["dispatch.queued"]
    assert payload(outcome.change.events[0]) == {
        "dispatch_id": DISPATCH_ID,
        "execution_id": EXEC_ID,
        "status": "pending",
        "attempt": 2,
    }
    assert outcome.dispatch_due_at == T0 + 200
    # The next claim re-delivers the same dispatch id with attempt + 1.
    again = claim_dispatch(
        execution=written, session=NO_SESSION, new_id=no_ids, now=T0 + 200, settings=SETTINGS
    )
    delivery = reply(again)
    assert delivery is not None
    assert (delivery.dispatch_id, delivery.attempt) == (DISPATCH_ID, 3)
    assert again.change.cleared_counters == (EXEC_ID,)


@pytest.mark.parametrize(
    "ex",
    [
        execution(dispatch_record=dispatch(locked_at=T0 + 100)),
        execution(ExecutionStatus.COMPLETED, dispatch_record=dispatch(locked_at=T0)),
        execution(dispatch_record=dispatch(DispatchStatus.FAILED, locked_at=T0)),
    ],
    ids=["fresh", "terminal", "not-in-flight"],
)
def test_reclaim_not_due(ex: Any) -> None:
    outcome = reclaim_lease(execution=ex, now=T0 + 150, settings=SETTINGS)
    assert outcome.reply is False
    assert outcome.change.is_empty


def test_reclaim_past_max_attempts_then_claim_fails_execution() -> None:
    k = Kernel(DispatchSettings(max_attempts=2))
    ex = k.create()
    for _ in range(2):
        k.start(ex.id)
        k.now += 120
        assert reply(k.reclaim(ex.id)) is True
    assert k.claim(ex.id) is None
    assert k.ex(ex.id).status is ExecutionStatus.FAILED
    assert k.ex(ex.id).failure_reason == "dispatch_exhausted"


def test_heartbeat_keeps_the_lease_from_lapsing() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    for _ in range(5):
        k.now += 100
        assert k.heartbeat(ex.id, lease).reply is None
        assert reply(k.reclaim(ex.id)) is False
    k.now += 120
    assert reply(k.reclaim(ex.id)) is True


# -- lease currency for every mutation ------------------------------------------------------------


def _mutations(k: Kernel, eid: str, lease: Lease, step_id: str) -> dict[str, Any]:
    return {
        "submit": lambda: k.submit(eid, lease, submission(target="other")),
        "complete_step": lambda: k.complete_step(eid, lease, step_id),
        "fail_step": lambda: k.fail_step(eid, lease, step_id),
        "heartbeat": lambda: k.heartbeat(eid, lease),
        "complete": lambda: k.complete(eid, lease),
        "fail": lambda: k.fail(eid, lease),
    }


@pytest.mark.parametrize(
    "name", ["submit", "complete_step", "fail_step", "heartbeat", "complete", "fail"]
)
@pytest.mark.parametrize("how", ["reclaimed", "requeued", "wrong-attempt"])
def test_superseded_lease_is_409_with_an_empty_change(name: str, how: str) -> None:
    k = Kernel()
    ex = k.create()
    old = k.start(ex.id)
    running = reply(k.submit(ex.id, old, submission()))
    k.now += 120
    assert reply(k.reclaim(ex.id)) is True
    if how == "reclaimed":
        k.start(ex.id)
        stale = old
    elif how == "requeued":
        stale = old
    else:
        stale = Lease(dispatch_id=old.dispatch_id, attempt=old.attempt + 5)
    before_events = len(k.store.events)
    before = dict(k.store.executions), dict(k.store.steps), dict(k.store.counters)
    outcome = _mutations(k, ex.id, stale, running.step_id)[name]()
    assert isinstance(outcome.reply, Refusal)
    assert outcome.reply.code is ErrorCode.LEASE_SUPERSEDED
    assert outcome.reply.message == "dispatch lease superseded"
    assert outcome.change.is_empty
    assert len(k.store.events) == before_events
    assert (dict(k.store.executions), dict(k.store.steps), dict(k.store.counters)) == before


@pytest.mark.parametrize(
    "name", ["submit", "complete_step", "fail_step", "heartbeat", "complete", "fail"]
)
def test_unknown_and_foreign_dispatch_are_400(name: str) -> None:
    k = Kernel()
    a = k.create()
    b = k.create()
    lease_a = k.start(a.id)
    lease_b = k.start(b.id)
    running = reply(k.submit(a.id, lease_a, submission()))
    unknown = Lease(dispatch_id="0192f1a0-ffff-7000-8000-000000000000", attempt=1)
    for lease, message in (
        (unknown, "unknown dispatch_id"),
        (lease_b, "dispatch_id belongs to another execution"),
    ):
        outcome = _mutations(k, a.id, lease, running.step_id)[name]()
        assert outcome.reply == Refusal(ErrorCode.VALIDATION_ERROR, message)
        assert outcome.change.is_empty


def test_other_agent_is_403_everywhere() -> None:
    k = Kernel(agents=(AGENT_ID, "agent-2"))
    ex = k.create()
    lease = k.start(ex.id)
    current = k.ex(ex.id)
    common: dict[str, Any] = {
        "execution": current,
        "caller": "agent-2",
        "lease": lease,
        "lease_owner": None,
        "now": k.now,
    }
    forbidden = Refusal(ErrorCode.FORBIDDEN, f"execution {ex.id} belongs to another agent")
    outcomes: list[Outcome[Any]] = [
        heartbeat(**common),
        end_execution(
            ending=ExecutionCompletion(output="1", state=None),
            session=NO_SESSION,
            pending=(),
            new_id=no_ids,
            settings=SETTINGS,
            **common,
        ),
        end_execution(
            ending=ExecutionFailure(error="x"),
            session=NO_SESSION,
            pending=(),
            new_id=no_ids,
            settings=SETTINGS,
            **common,
        ),
        k.submit(ex.id, lease, submission(), caller="agent-2"),
    ]
    for outcome in outcomes:
        assert outcome.reply == forbidden
        assert outcome.change.is_empty


# -- heartbeat -------------------------------------------------------------------------------------


def test_heartbeat_renews_always() -> None:
    ex = execution(dispatch_record=dispatch(locked_at=T0))
    outcome = heartbeat(execution=ex, caller=AGENT_ID, lease=LEASE, lease_owner=None, now=T0 + 0.1)
    assert outcome.reply is None
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    assert written.dispatch.locked_at == T0 + 0.1
    assert not outcome.change.events


@pytest.mark.parametrize(
    "ex",
    [
        execution(ExecutionStatus.COMPLETED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED)),
        execution(ExecutionStatus.CANCELLED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED)),
        execution(ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED)),
    ],
    ids=["completed", "cancelled", "retired-by-block"],
)
def test_heartbeat_after_release_is_superseded(ex: Any) -> None:
    outcome = heartbeat(execution=ex, caller=AGENT_ID, lease=LEASE, lease_owner=None, now=T0)
    assert outcome.reply == Refusal(ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded")
    assert outcome.change.is_empty


# -- release ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["complete", "fail", "cancel", "block"])
def test_release_on_block_and_terminal(how: str) -> None:
    from rebuno_proto import Action, Verdict

    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    if how == "complete":
        k.complete(ex.id, lease)
    elif how == "fail":
        k.fail(ex.id, lease)
    elif how == "cancel":
        k.cancel(ex.id)
    else:
        decision = reply(
            k.submit(ex.id, lease, submission(), verdict=Verdict(action=Action.REQUIRE_APPROVAL))
        )
        assert decision.decision is Decision.BLOCKED
    released = k.ex(ex.id).dispatch
    assert released is not None
    assert released.status is DispatchStatus.EXHAUSTED
    assert released.attempt == lease.attempt
    assert k.claim(ex.id) is None
    assert reply(k.reclaim(ex.id)) is False


# -- occurrences across attempts (§1.3) ------------------------------------------------------------


def test_identical_calls_get_occurrences_in_order_and_restart_each_attempt() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    sub = submission(args={"q": "same"})
    first = reply(k.submit(ex.id, lease, sub))
    second = reply(k.submit(ex.id, lease, sub))
    assert first.step_id != second.step_id
    occurrences = [k.store.steps[d.step_id].occurrence for d in (first, second)]
    assert occurrences == [0, 1]
    k.complete_step(ex.id, lease, first.step_id, '"r0"')
    # The lease lapses; the next attempt replays from occurrence 0.
    k.now += 120
    assert reply(k.reclaim(ex.id)) is True
    lease2 = k.start(ex.id)
    assert lease2 == Lease(dispatch_id=lease.dispatch_id, attempt=2)
    assert not k.store.counters
    replayed = reply(k.submit(ex.id, lease2, sub))
    assert replayed == dataclasses.replace(
        replayed, decision=Decision.REPLAY, step_id=first.step_id
    )
    assert replayed.result == '"r0"'
    orphan = reply(k.submit(ex.id, lease2, sub))
    assert (orphan.decision, orphan.step_id) == (Decision.PROCEED, second.step_id)
    third = reply(k.submit(ex.id, lease2, sub))
    assert k.store.steps[third.step_id].occurrence == 2


def test_counter_untouched_by_refusals_and_non_recording_decisions() -> None:
    from rebuno_proto import Verdict

    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    sub = submission()
    k.submit(ex.id, lease, sub, verdict=Verdict(rate_limited="rate_limit_exceeded"))
    k.submit(ex.id, Lease(dispatch_id=lease.dispatch_id, attempt=9), sub)
    k.submit(ex.id, lease, sub, caller="agent-x")
    assert not k.store.counters
    decision = reply(k.submit(ex.id, lease, sub))
    assert k.store.steps[decision.step_id].occurrence == 0
    assert list(k.store.counters.values()) == [0]


def test_a_new_dispatch_starts_with_no_counters() -> None:
    from rebuno_proto import Action, ApprovalChoice, Verdict

    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    k.submit(ex.id, lease, submission(target="free"))
    blocked = reply(
        k.submit(ex.id, lease, submission(), verdict=Verdict(action=Action.REQUIRE_APPROVAL))
    )
    assert blocked.approval_id is not None
    assert len(k.store.counters) == 2
    k.decide(blocked.approval_id, ApprovalChoice.GRANT)
    new_lease = k.start(ex.id)
    assert new_lease.dispatch_id != lease.dispatch_id
    assert new_lease.attempt == 1
    assert not k.store.counters
    assert reply(k.submit(ex.id, new_lease, submission(target="free"))).decision is Decision.PROCEED
    granted = reply(k.submit(ex.id, new_lease, submission()))
    assert (granted.decision, granted.step_id) == (Decision.PROCEED, blocked.step_id)
    assert k.store.steps[granted.step_id].status is StepStatus.EXECUTING


def test_with_dispatch_helper() -> None:
    ex = with_dispatch(execution(), attempt=4)
    assert ex.dispatch is not None
    assert ex.dispatch.attempt == 4
    assert Ids()() == "0192f1a0-0000-7000-9000-000000000001"
    assert json.loads(submission().args) == {"q": "x"}


# -- properties of identity through the kernel ------------------------------------------------

_args = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=6),
    ),
    lambda c: st.one_of(
        st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(_args, st.integers(min_value=1, max_value=5), st.randoms(use_true_random=False))
def test_repeated_identical_calls_differ_only_in_occurrence(
    args: Any, repeats: int, rnd: random.Random
) -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    digest = args_hash(json.dumps(args).encode())
    ids = []
    for _ in range(repeats):
        # Each call spells the same arguments differently.
        spelled = json.dumps(args, indent=rnd.choice([None, 1]), ensure_ascii=rnd.random() < 0.5)
        sub = parse_step_submission(
            b'{"kind": "tool_call", "target": "t", "args": ' + spelled.encode() + b"}"
        )
        ids.append(reply(k.submit(ex.id, lease, sub)).step_id)
    assert ids == [step_id(ex.id, "tool_call", "t", digest, i) for i in range(repeats)]
    assert len(set(ids)) == repeats
    # A new attempt meets the same ids again, in the same order.
    k.now += 120
    k.reclaim(ex.id)
    lease2 = k.start(ex.id)
    again = [
        reply(
            k.submit(
                ex.id,
                lease2,
                parse_step_submission(
                    b'{"kind": "tool_call", "target": "t", "args": '
                    + json.dumps(args).encode()
                    + b"}"
                ),
            )
        ).step_id
        for _ in range(repeats)
    ]
    assert again == ids


# -- a kernel restart retires every lease ----------------------------------------------


def test_restart_requeues_an_in_flight_dispatch_without_spending_an_attempt() -> None:
    """Due when the old lease would have lapsed: the old handler may still act
    on a `proceed` until then (simulator seed 61258)."""
    ex = execution(dispatch_record=dispatch(attempt=3, locked_at=T0))
    assert holds_lease(ex)
    outcome = retire_lease_after_restart(execution=ex, now=T0 + 1, lease_timeout_s=30.0)
    assert outcome.reply is True
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    assert (
        written.dispatch.status,
        written.dispatch.attempt,
        written.dispatch.max_attempts,
        written.dispatch.next_attempt_at,
    ) == (DispatchStatus.PENDING, 3, 6, T0 + 30)
    assert event_types(outcome.change) == ["dispatch.queued"]
    assert outcome.dispatch_due_at == T0 + 30
    # The old lease is superseded; the next claim re-delivers with attempt + 1.
    assert lease_status(written, Lease(dispatch_id=DISPATCH_ID, attempt=3), None) is (
        LeaseStatus.SUPERSEDED
    )
    early = claim_dispatch(
        execution=written, session=NO_SESSION, new_id=no_ids, now=T0 + 29, settings=SETTINGS
    )
    assert reply(early) is None
    delivery = reply(
        claim_dispatch(
            execution=written, session=NO_SESSION, new_id=no_ids, now=T0 + 30, settings=SETTINGS
        )
    )
    assert delivery is not None
    assert delivery.attempt == 4


def test_restart_requeues_a_long_lapsed_lease_at_once() -> None:
    ex = execution(dispatch_record=dispatch(attempt=3, locked_at=T0))
    outcome = retire_lease_after_restart(execution=ex, now=T0 + 500, lease_timeout_s=30.0)
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    assert written.dispatch.next_attempt_at == T0 + 500
    assert outcome.dispatch_due_at == T0 + 500


def test_restarts_never_exhaust_a_healthy_execution() -> None:
    k = Kernel(DispatchSettings(max_attempts=2))
    ex = k.create()
    for _ in range(6):
        k.start(ex.id)
        k.commit(retire_lease_after_restart(execution=k.ex(ex.id), now=k.now, lease_timeout_s=0.0))
    assert k.ex(ex.id).status is ExecutionStatus.RUNNING
    assert k.claim(ex.id) is not None


@pytest.mark.parametrize("status", [DispatchStatus.PENDING, DispatchStatus.FAILED])
def test_restart_moves_a_queued_dispatch_past_any_lease_a_lost_claim_handed_out(
    status: DispatchStatus,
) -> None:
    # A claim (attempt 2) whose commit a crash lost: the store still says attempt 1.
    ex = execution(dispatch_record=dispatch(attempt=1, status=status, locked_at=None))
    lost = Lease(dispatch_id=DISPATCH_ID, attempt=2)
    outcome = retire_lease_after_restart(execution=ex, now=T0, lease_timeout_s=30.0)
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    assert (written.dispatch.status, written.dispatch.attempt, written.dispatch.max_attempts) == (
        status,
        2,
        6,
    )
    assert outcome.change.events == ()
    delivery = reply(
        claim_dispatch(
            execution=dataclasses.replace(
                written, dispatch=dataclasses.replace(written.dispatch, next_attempt_at=T0)
            ),
            session=NO_SESSION,
            new_id=no_ids,
            now=T0,
            settings=SETTINGS,
        )
    )
    assert delivery is not None
    assert delivery.lease() != lost  # never the same lease twice
    assert delivery.attempt == 3


def test_restart_moves_a_block_retired_dispatch_to_a_new_attempt() -> None:
    ex = execution(
        status=ExecutionStatus.BLOCKED,
        dispatch_record=dispatch(attempt=2, status=DispatchStatus.EXHAUSTED),
    )
    old = Lease(dispatch_id=DISPATCH_ID, attempt=2)
    assert holds_lease(ex)
    assert lease_status(ex, old, None) is LeaseStatus.RETIRED_BY_BLOCK
    outcome = retire_lease_after_restart(execution=ex, now=T0, lease_timeout_s=30.0)
    assert outcome.reply is True
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    assert (written.dispatch.status, written.dispatch.attempt) == (DispatchStatus.EXHAUSTED, 3)
    assert outcome.change.events == ()
    assert outcome.dispatch_due_at is None
    assert lease_status(written, old, None) is LeaseStatus.SUPERSEDED


@pytest.mark.parametrize(
    "ex",
    [
        dataclasses.replace(execution(), dispatch=None),
        execution(
            status=ExecutionStatus.COMPLETED,
            dispatch_record=dispatch(status=DispatchStatus.EXHAUSTED),
        ),
        execution(
            status=ExecutionStatus.RUNNING,
            dispatch_record=dispatch(status=DispatchStatus.EXHAUSTED),
        ),
    ],
)
def test_restart_leaves_executions_without_a_lease_alone(ex: Execution) -> None:
    assert not holds_lease(ex)
    outcome = retire_lease_after_restart(execution=ex, now=T0, lease_timeout_s=30.0)
    assert outcome.reply is False
    assert outcome.change.is_empty


def _record_failure(
    ex: Execution, result: DeliveryResult, settings: DispatchSettings
) -> Outcome[None]:
    assert ex.dispatch is not None
    return record_delivery(
        execution=ex,
        lease=ex.dispatch.lease(),
        result=result,
        jitter=0.0,
        session=NO_SESSION,
        new_id=no_ids,
        now=T0 + 10,
        settings=settings,
    )


@pytest.mark.parametrize("result", [DeliveryResult.REFUSED, DeliveryResult.UNANSWERED])
def test_a_failed_delivery_that_may_have_arrived_waits_out_the_lease(
    result: DeliveryResult,
) -> None:
    settings = DispatchSettings(lease_timeout_s=30.0, backoff_base_s=1.0, backoff_max_s=2.0)
    ex = execution(dispatch_record=dispatch(attempt=1, locked_at=T0))
    outcome = _record_failure(ex, result, settings)
    (written,) = outcome.change.executions
    assert written.dispatch is not None
    due = T0 + 30 if result is DeliveryResult.UNANSWERED else T0 + 10 + 1.0
    assert written.dispatch.next_attempt_at == due
    assert outcome.dispatch_due_at == due


def test_an_unanswered_last_attempt_waits_out_the_lease_before_exhausting() -> None:
    """A handler may still be running under it: the execution is not failed
    (nor its session's next admitted) until no handler of it can act."""
    settings = DispatchSettings(lease_timeout_s=30.0, max_attempts=2)
    ex = execution(dispatch_record=dispatch(attempt=2, max_attempts=2, locked_at=T0))
    refused = _record_failure(ex, DeliveryResult.REFUSED, settings)
    assert refused.change.executions[0].status is ExecutionStatus.FAILED
    (waiting,) = _record_failure(ex, DeliveryResult.UNANSWERED, settings).change.executions
    assert waiting.status is ExecutionStatus.RUNNING
    assert waiting.dispatch is not None
    assert waiting.dispatch.next_attempt_at == T0 + 30
    exhausted = claim_dispatch(
        execution=waiting, session=NO_SESSION, new_id=no_ids, now=T0 + 30, settings=settings
    )
    assert reply(exhausted) is None
    (ended,) = exhausted.change.executions
    assert (ended.status, ended.failure_reason) == (ExecutionStatus.FAILED, "dispatch_exhausted")


@pytest.mark.parametrize(
    ("status", "result"),
    [
        (200, DeliveryResult.ACKED),
        (204, DeliveryResult.ACKED),
        (401, DeliveryResult.REFUSED),
        (500, DeliveryResult.REFUSED),
        (503, DeliveryResult.REFUSED),
        (502, DeliveryResult.UNANSWERED),  # a proxy: the agent behind it may have got it
        (504, DeliveryResult.UNANSWERED),
    ],
)
def test_delivery_result_of_an_http_status(status: int, result: DeliveryResult) -> None:
    assert delivery_result(status) is result

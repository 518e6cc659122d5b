"""The step-submission decision and step completion (PROTOCOL.md §5.1, §5.2,
§1.3, §6.2), driven directly with hand-built records, fixed ids and `now`."""

import dataclasses
import json
from typing import Any

import pytest
from _support import (
    AGENT_ID,
    DISPATCH_ID,
    EXEC_ID,
    LEASE,
    T0,
    Ids,
    dispatch,
    event_types,
    execution,
    no_ids,
    payload,
    reply,
    step,
    submission,
)

from rebuno_proto import (
    ALLOW,
    INDETERMINATE_ERROR,
    Action,
    ApprovalStatus,
    CounterWrite,
    Decision,
    DispatchStatus,
    ErrorCode,
    Execution,
    ExecutionStatus,
    Lease,
    Outcome,
    RateBucket,
    Refusal,
    Step,
    StepDecision,
    StepStatus,
    StepSubmission,
    Verdict,
    complete_step,
    decide_submission,
    fail_step,
    needs_indeterminate_check,
    step_key,
)

SUB = submission()
AT_MOST_ONCE = submission(idempotency="at_most_once")
NOW = T0 + 10.0


def decide(
    *,
    ex: Execution | None = None,
    sub: StepSubmission = SUB,
    counter: int | None = None,
    existing: Step | None = None,
    verdict: Verdict = ALLOW,
    lease: Lease = LEASE,
    lease_owner: str | None = None,
    caller: str | None = AGENT_ID,
    indeterminate: bool = False,
    buckets: tuple[RateBucket, ...] = (),
    new_id: Any = no_ids,
    now: float = NOW,
) -> Outcome[StepDecision]:
    return decide_submission(
        execution=execution() if ex is None else ex,
        caller=caller,
        lease=lease,
        lease_owner=lease_owner,
        submission=sub,
        key=step_key(EXEC_ID, sub, counter),
        existing=existing,
        has_indeterminate_failure=indeterminate,
        verdict=verdict,
        rate_buckets=buckets,
        new_id=new_id,
        now=now,
    )


def refused(outcome: Outcome[Any], code: ErrorCode, message: str) -> None:
    assert isinstance(outcome.reply, Refusal)
    assert outcome.reply.code is code
    assert outcome.reply.message == message
    assert outcome.change.is_empty
    assert outcome.dispatch_due_at is None
    assert outcome.timer_due_at is None


def counter_of(outcome: Outcome[Any], sub: StepSubmission = SUB) -> tuple[CounterWrite, ...]:
    counters = outcome.change.counters
    for cw in counters:
        assert (cw.execution_id, cw.kind, cw.target) == (EXEC_ID, sub.kind, sub.target)
    return counters


# -- order of checks -------------------------------------------------------------------


@pytest.mark.parametrize(
    "status", [ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.CANCELLED]
)
def test_terminal_execution_answers_execution_terminal(status: ExecutionStatus) -> None:
    ex = execution(status, dispatch_record=dispatch(DispatchStatus.EXHAUSTED))
    # Checked before the lease: even a stale lease gets the decision, not a 409.
    for lease in (LEASE, Lease(dispatch_id=DISPATCH_ID, attempt=9)):
        outcome = decide(ex=ex, lease=lease, existing=step(SUB, StepStatus.SUCCEEDED))
        assert reply(outcome) == StepDecision(decision=Decision.EXECUTION_TERMINAL)
        assert outcome.change.is_empty


def test_other_agent_is_forbidden_before_anything() -> None:
    ex = execution(ExecutionStatus.COMPLETED)
    refused(
        decide(ex=ex, caller="intruder"),
        ErrorCode.FORBIDDEN,
        f"execution {EXEC_ID} belongs to another agent",
    )
    refused(
        decide(caller="intruder"),
        ErrorCode.FORBIDDEN,
        f"execution {EXEC_ID} belongs to another agent",
    )


def test_bearer_caller_is_not_an_agent() -> None:
    assert reply(decide(caller=None)).decision is Decision.PROCEED


def test_unknown_dispatch_is_400() -> None:
    lease = Lease(dispatch_id="0192f1a0-dead-7000-8000-000000000000", attempt=1)
    refused(
        decide(lease=lease, lease_owner=None), ErrorCode.VALIDATION_ERROR, "unknown dispatch_id"
    )
    assert ErrorCode.VALIDATION_ERROR.status == 400


def test_foreign_dispatch_is_400() -> None:
    lease = Lease(dispatch_id="0192f1a0-2222-7000-8000-000000000000", attempt=1)
    refused(
        decide(lease=lease, lease_owner="0192f1a0-0000-7000-8000-0000000000ff"),
        ErrorCode.VALIDATION_ERROR,
        "dispatch_id belongs to another execution",
    )


def test_no_dispatch_at_all_is_unknown() -> None:
    ex = dataclasses.replace(execution(), dispatch=None)
    refused(decide(ex=ex), ErrorCode.VALIDATION_ERROR, "unknown dispatch_id")


@pytest.mark.parametrize(
    ("ex", "lease", "owner"),
    [
        # re-claimed: the attempt moved on
        (execution(dispatch_record=dispatch(attempt=2)), LEASE, None),
        # a newer dispatch of the same execution exists
        (
            execution(dispatch_record=dispatch(dispatch_id="0192f1a0-3333-7000-8000-000000000000")),
            LEASE,
            EXEC_ID,
        ),
        # back in the queue after the lease lapsed, awaiting re-claim
        (execution(dispatch_record=dispatch(DispatchStatus.PENDING, locked_at=None)), LEASE, None),
        # delivery failed, waiting for a retry
        (execution(dispatch_record=dispatch(DispatchStatus.FAILED)), LEASE, None),
        # released while running (not by a block)
        (execution(dispatch_record=dispatch(DispatchStatus.EXHAUSTED)), LEASE, None),
    ],
    ids=["reclaimed", "newer-dispatch", "requeued", "failed-delivery", "released"],
)
def test_superseded_lease_changes_nothing(ex: Execution, lease: Lease, owner: str | None) -> None:
    for existing in (None, step(SUB, StepStatus.SUCCEEDED), step(SUB, StepStatus.EXECUTING)):
        outcome = decide(ex=ex, lease=lease, lease_owner=owner, existing=existing)
        refused(outcome, ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded")
        assert outcome.reply.status == 409  # type: ignore[union-attr]


# -- existing steps (§5.2 "existing") ----------------------------------------------------


def test_existing_succeeded_replays_result() -> None:
    existing = step(SUB, StepStatus.SUCCEEDED, result='{"hits":[1]}')
    outcome = decide(existing=existing)
    assert reply(outcome) == StepDecision(
        decision=Decision.REPLAY, step_id=existing.step_id, result='{"hits":[1]}'
    )
    assert counter_of(outcome)[0].value == 0
    assert not outcome.change.steps
    assert not outcome.change.events


def test_existing_failed_replays_error() -> None:
    existing = step(SUB, StepStatus.FAILED, error='{"message":"boom"}')
    assert reply(decide(existing=existing)) == StepDecision(
        decision=Decision.REPLAY, step_id=existing.step_id, error='{"message":"boom"}'
    )


def test_existing_failed_without_error_replays_an_object() -> None:
    existing = step(SUB, StepStatus.FAILED)
    decision = reply(decide(existing=existing))
    assert decision.error is not None
    assert json.loads(decision.error) == {"reason": "failed"}


def test_existing_cancelled_replays_its_error() -> None:
    existing = step(SUB, StepStatus.CANCELLED, error='{"reason":"execution_cancelled"}')
    decision = reply(decide(existing=existing))
    assert decision.decision is Decision.REPLAY
    assert decision.error == '{"reason":"execution_cancelled"}'
    assert decision.result is None


@pytest.mark.parametrize(
    ("error", "rule_id", "reason"),
    [
        ('{"reason":"approval_denied"}', "", "approval_denied"),
        ('{"reason":"approval_timeout"}', "r1", "approval_timeout"),
        ('{"reason":"not on weekends","rule_id":"r2"}', "r2", "not on weekends"),
        ('{"reason":""}', "r3", "policy_denied"),
        ('{"message":"x"}', "", "policy_denied"),
        ('"just text"', "", "policy_denied"),
        (None, "", "policy_denied"),
    ],
)
def test_existing_denied_keeps_reason_and_rule(
    error: str | None, rule_id: str, reason: str
) -> None:
    existing = step(SUB, StepStatus.DENIED, error=error, rule_id=rule_id)
    outcome = decide(existing=existing)
    assert reply(outcome) == StepDecision(
        decision=Decision.DENIED, step_id=existing.step_id, reason=reason, rule_id=rule_id
    )
    assert len(counter_of(outcome)) == 1


def test_existing_awaiting_approval_is_blocked_with_approval_id() -> None:
    existing = step(SUB, StepStatus.AWAITING_APPROVAL, approval_id="ap-1")
    ex = execution(ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED))
    outcome = decide(ex=ex, existing=existing)
    assert reply(outcome) == StepDecision(
        decision=Decision.BLOCKED, step_id=existing.step_id, approval_id="ap-1"
    )
    assert len(counter_of(outcome)) == 1


@pytest.mark.parametrize("sub", [SUB, AT_MOST_ONCE], ids=["safe_to_retry", "at_most_once"])
def test_existing_allowed_proceeds_once(sub: StepSubmission) -> None:
    existing = step(sub, StepStatus.ALLOWED, approval_id="ap-1", rule_id="r")
    outcome = decide(sub=sub, existing=existing)
    assert reply(outcome) == StepDecision(decision=Decision.PROCEED, step_id=existing.step_id)
    (written,) = outcome.change.steps
    assert written.status is StepStatus.EXECUTING
    assert written.started_at == NOW
    assert event_types(outcome.change) == ["step.executing"]
    assert len(counter_of(outcome, sub)) == 1


@pytest.mark.parametrize(
    ("first", "then", "kept"),
    [
        (SUB, SUB, "safe_to_retry"),
        (SUB, AT_MOST_ONCE, "at_most_once"),
        (AT_MOST_ONCE, SUB, "at_most_once"),
    ],
    ids=["safe-safe", "safe-then-at_most_once", "at_most_once-then-safe"],
)
def test_an_approved_step_starts_under_the_stricter_idempotency(
    first: StepSubmission, then: StepSubmission, kept: str
) -> None:
    """An approved step first submitted safe_to_retry and run as at_most_once
    must not be re-run as an orphan later (found in review of the seed 5737
    fix): the run stores the stricter idempotency of the two."""
    existing = step(first, StepStatus.ALLOWED, approval_id="ap-1", rule_id="r")
    (written,) = decide(sub=then, existing=existing).change.steps
    assert written.idempotency.value == kept
    orphan = decide(sub=SUB, existing=written)
    assert reply(orphan).decision is (
        Decision.PROCEED if kept == "safe_to_retry" else Decision.REPLAY
    )


def test_existing_executing_safe_to_retry_proceeds_without_writes() -> None:
    existing = step(SUB, StepStatus.EXECUTING)
    outcome = decide(existing=existing, ex=execution(dispatch_record=dispatch(locked_at=NOW)))
    assert reply(outcome) == StepDecision(decision=Decision.PROCEED, step_id=existing.step_id)
    assert not outcome.change.steps
    assert not outcome.change.events
    assert len(counter_of(outcome)) == 1


def test_existing_executing_at_most_once_fails_indeterminate() -> None:
    existing = step(AT_MOST_ONCE, StepStatus.EXECUTING)
    outcome = decide(sub=AT_MOST_ONCE, existing=existing)
    decision = reply(outcome)
    assert decision == StepDecision(
        decision=Decision.REPLAY, step_id=existing.step_id, error=INDETERMINATE_ERROR
    )
    assert json.loads(INDETERMINATE_ERROR) == {
        "reason": "indeterminate",
        "message": "outcome unknown: this may already have taken effect. "
        "Check the state before continuing.",
    }
    (written,) = outcome.change.steps
    assert written.status is StepStatus.FAILED
    assert written.error == INDETERMINATE_ERROR
    assert written.completed_at == NOW
    assert event_types(outcome.change) == ["step.failed"]
    assert payload(outcome.change.events[0])["error"]["reason"] == "indeterminate"


def test_orphan_resolution_follows_the_current_submission() -> None:
    """A step recorded safe_to_retry re-runs when resubmitted safe_to_retry, and
    fails indeterminate when this submission says at_most_once."""
    recorded_safe = dataclasses.replace(
        step(AT_MOST_ONCE, StepStatus.EXECUTING), idempotency=SUB.idempotency
    )
    assert reply(decide(existing=recorded_safe)).decision is Decision.PROCEED
    strict = reply(decide(sub=AT_MOST_ONCE, existing=recorded_safe))
    assert strict.decision is Decision.REPLAY
    assert strict.error == INDETERMINATE_ERROR


def test_seed_5737_an_at_most_once_body_never_reruns_under_a_safe_resubmission() -> None:
    """Simulator seed 5737 (harsh profile): a body that started as at_most_once
    ran again when a later attempt submitted the same call as safe_to_retry.
    The promise made when the effect started is kept."""
    existing = step(AT_MOST_ONCE, StepStatus.EXECUTING)
    outcome = decide(sub=SUB, existing=existing)
    decision = reply(outcome)
    assert decision.decision is Decision.REPLAY
    assert decision.error == INDETERMINATE_ERROR
    (written,) = outcome.change.steps
    assert written.status is StepStatus.FAILED


def test_existing_step_decided_even_while_blocked() -> None:
    ex = execution(ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED))
    existing = step(SUB, StepStatus.SUCCEEDED, result="1")
    assert reply(decide(ex=ex, existing=existing)).decision is Decision.REPLAY


def test_proposed_is_never_stored() -> None:
    """`proposed` is transient; a stored one is a broken invariant, not a decision."""
    from rebuno_proto import LocalProtocolError

    with pytest.raises(LocalProtocolError):
        decide(existing=step(SUB, StepStatus.PROPOSED))


# -- new steps --------------------------------------------------------------------


def test_new_step_while_blocked_is_execution_blocked() -> None:
    ex = execution(ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED))
    outcome = decide(ex=ex, verdict=Verdict(action=Action.DENY))
    assert reply(outcome) == StepDecision(decision=Decision.EXECUTION_BLOCKED)
    assert not outcome.change.steps
    assert not outcome.change.counters
    assert not outcome.change.events


def test_blocked_execution_with_superseded_lease_is_409() -> None:
    ex = execution(
        ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED, attempt=2)
    )
    refused(decide(ex=ex), ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded")


def test_allow_writes_executing_step() -> None:
    outcome = decide()
    key = step_key(EXEC_ID, SUB, None)
    assert reply(outcome) == StepDecision(decision=Decision.PROCEED, step_id=key.step_id)
    (written,) = outcome.change.steps
    assert written.status is StepStatus.EXECUTING
    assert (written.step_id, written.occurrence, written.args_hash) == (
        key.step_id,
        0,
        key.args_hash,
    )
    assert written.args == '{"q":"x"}'
    assert written.started_at == NOW
    assert event_types(outcome.change) == ["step.proposed", "step.allowed", "step.executing"]
    assert [e.seq for e in outcome.change.events] == [4, 5, 6]
    assert payload(outcome.change.events[0]) == {
        "step_id": key.step_id,
        "step_type": "tool_call",
        "target": "search",
    }
    assert counter_of(outcome) == (
        CounterWrite(
            execution_id=EXEC_ID, kind=SUB.kind, target="search", args_hash=key.args_hash, value=0
        ),
    )
    (ex,) = outcome.change.executions
    assert ex.last_event_seq == 6


def test_allow_with_rule_id_names_the_rule() -> None:
    outcome = decide(verdict=Verdict(action=Action.ALLOW, rule_id="allow-search"))
    assert outcome.change.steps[0].rule_id == "allow-search"
    assert payload(outcome.change.events[1])["rule_id"] == "allow-search"
    assert "rule_id" not in payload(outcome.change.events[2])


def test_deny_defaults_reason_to_policy_denied() -> None:
    outcome = decide(verdict=Verdict(action=Action.DENY, rule_id="no-search"))
    key = step_key(EXEC_ID, SUB, None)
    assert reply(outcome) == StepDecision(
        decision=Decision.DENIED, step_id=key.step_id, reason="policy_denied", rule_id="no-search"
    )
    (written,) = outcome.change.steps
    assert written.status is StepStatus.DENIED
    assert json.loads(written.error or "") == {"reason": "policy_denied", "rule_id": "no-search"}
    assert written.rule_id == "no-search"
    assert written.completed_at == NOW
    assert event_types(outcome.change) == ["step.proposed", "step.denied"]
    assert payload(outcome.change.events[1])["error"] == {
        "reason": "policy_denied",
        "rule_id": "no-search",
    }
    assert counter_of(outcome)[0].value == 0


def test_deny_with_reason() -> None:
    decision = reply(decide(verdict=Verdict(action=Action.DENY, reason="budget", rule_id="r9")))
    assert (decision.reason, decision.rule_id) == ("budget", "r9")


def test_require_approval_blocks_and_releases() -> None:
    verdict = Verdict(
        action=Action.REQUIRE_APPROVAL,
        rule_id="needs-human",
        approvers=("alice", "bob"),
        approval_timeout_s=60.0,
        approval_message="ok to search?",
    )
    ids = Ids()
    outcome = decide(verdict=verdict, new_id=ids)
    key = step_key(EXEC_ID, SUB, None)
    approval_id = "0192f1a0-0000-7000-9000-000000000001"
    assert reply(outcome) == StepDecision(
        decision=Decision.BLOCKED, step_id=key.step_id, approval_id=approval_id
    )
    (written,) = outcome.change.steps
    assert written.status is StepStatus.AWAITING_APPROVAL
    assert written.approval_id == approval_id
    assert written.rule_id == "needs-human"
    (approval,) = outcome.change.approvals
    assert approval.status is ApprovalStatus.PENDING
    assert (approval.step_id, approval.execution_id) == (key.step_id, EXEC_ID)
    assert approval.timeout_at == NOW + 60.0
    assert approval.approvers == ("alice", "bob")
    assert approval.message == "ok to search?"
    (ex,) = outcome.change.executions
    assert ex.status is ExecutionStatus.BLOCKED
    assert ex.dispatch is not None
    assert ex.dispatch.status is DispatchStatus.EXHAUSTED
    assert ex.updated_at == NOW
    assert event_types(outcome.change) == [
        "step.proposed",
        "step.awaiting_approval",
        "approval.requested",
        "execution.blocked",
    ]
    assert payload(outcome.change.events[2]) == {
        "approval_id": approval_id,
        "step_id": key.step_id,
        "execution_id": EXEC_ID,
        "status": "pending",
    }
    assert payload(outcome.change.events[3]) == {"execution_id": EXEC_ID, "status": "blocked"}
    assert outcome.timer_due_at == NOW + 60.0
    assert counter_of(outcome)[0].value == 0
    assert ids.n == 1


def test_rate_limited_records_nothing_but_the_event() -> None:
    verdict = Verdict(rate_limited="rate_limit_exceeded", rule_id="rl")
    bucket = RateBucket(key="rl", window_start=T0, count=3)
    outcome = decide(verdict=verdict, buckets=(bucket,))
    assert reply(outcome) == StepDecision(
        decision=Decision.RATE_LIMITED, reason="rate_limit_exceeded"
    )
    assert not outcome.change.steps
    assert not outcome.change.counters
    assert not outcome.change.rate_buckets
    assert event_types(outcome.change) == ["step.rate_limited"]
    assert payload(outcome.change.events[0])["error"] == {
        "reason": "rate_limit_exceeded",
        "rule_id": "rl",
    }


def test_rate_limiter_unavailable_reason() -> None:
    decision = reply(decide(verdict=Verdict(rate_limited="rate_limiter_unavailable")))
    assert decision.reason == "rate_limiter_unavailable"
    assert decision.step_id == ""


def test_counted_call_stores_its_rate_buckets() -> None:
    bucket = RateBucket(key="rl", window_start=T0, count=1)
    outcome = decide(buckets=(bucket,))
    assert outcome.change.rate_buckets == (bucket,)


def test_indeterminate_retry_is_denied() -> None:
    outcome = decide(sub=AT_MOST_ONCE, indeterminate=True, verdict=ALLOW, counter=0)
    key = step_key(EXEC_ID, AT_MOST_ONCE, 0)
    assert reply(outcome) == StepDecision(
        decision=Decision.DENIED,
        step_id=key.step_id,
        reason="prior attempt outcome unknown; retry refused",
        rule_id="__indeterminate_retry",
    )
    assert key.occurrence == 1
    (written,) = outcome.change.steps
    assert written.status is StepStatus.DENIED
    assert counter_of(outcome, AT_MOST_ONCE)[0].value == 1


def test_indeterminate_retry_wins_over_rate_limit() -> None:
    verdict = Verdict(rate_limited="rate_limit_exceeded")
    decision = reply(decide(sub=AT_MOST_ONCE, indeterminate=True, verdict=verdict))
    assert decision.decision is Decision.DENIED
    assert decision.rule_id == "__indeterminate_retry"


def test_indeterminate_flag_ignored_for_safe_to_retry() -> None:
    assert reply(decide(sub=SUB, indeterminate=True)).decision is Decision.PROCEED


def test_needs_indeterminate_check() -> None:
    running = execution()
    blocked = execution(ExecutionStatus.BLOCKED)
    assert needs_indeterminate_check(running, AT_MOST_ONCE, None)
    assert not needs_indeterminate_check(running, SUB, None)
    assert not needs_indeterminate_check(
        running, AT_MOST_ONCE, step(AT_MOST_ONCE, StepStatus.EXECUTING)
    )
    assert not needs_indeterminate_check(blocked, AT_MOST_ONCE, None)


# -- occurrences (§1.3) ----------------------------------------------------------------


def test_occurrence_follows_the_counter() -> None:
    for counter, occurrence in ((None, 0), (0, 1), (4, 5)):
        key = step_key(EXEC_ID, SUB, counter)
        assert key.occurrence == occurrence
        outcome = decide(counter=counter)
        assert reply(outcome).step_id == key.step_id
        assert outcome.change.counters[0].value == occurrence


def test_step_key_args_hash_is_the_canonical_hash() -> None:
    from rebuno_proto import args_hash

    key = step_key(EXEC_ID, SUB, None)
    assert key.args_hash == args_hash(b'{"q": "x"}')


@pytest.mark.parametrize(
    ("kwargs", "advances"),
    [
        ({}, True),  # proceed
        ({"existing": step(SUB, StepStatus.SUCCEEDED)}, True),  # replay
        ({"verdict": Verdict(action=Action.DENY)}, True),  # denied
        ({"verdict": Verdict(action=Action.REQUIRE_APPROVAL), "new_id": Ids()}, True),  # blocked
        ({"verdict": Verdict(rate_limited="rate_limit_exceeded")}, False),
        (
            {
                "ex": execution(
                    ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED)
                )
            },
            False,
        ),  # execution_blocked
        ({"ex": execution(ExecutionStatus.COMPLETED)}, False),  # execution_terminal
        ({"lease": Lease(dispatch_id=DISPATCH_ID, attempt=7)}, False),  # superseded
        ({"caller": "other"}, False),  # forbidden
    ],
)
def test_counter_advances_exactly_when_a_step_is_recorded_or_found(
    kwargs: dict[str, Any], advances: bool
) -> None:
    assert bool(decide(**kwargs).change.counters) is advances


# -- lease renewal on submit -----------------------------------------------------------


def test_submit_renews_a_stale_lock() -> None:
    outcome = decide(ex=execution(dispatch_record=dispatch(locked_at=T0)), now=T0 + 5)
    (ex,) = outcome.change.executions
    assert ex.dispatch is not None
    assert ex.dispatch.locked_at == T0 + 5


def test_submit_skips_renewal_within_a_second() -> None:
    existing = step(SUB, StepStatus.SUCCEEDED)
    outcome = decide(
        ex=execution(dispatch_record=dispatch(locked_at=T0)), now=T0 + 0.5, existing=existing
    )
    assert not outcome.change.executions
    assert len(outcome.change.counters) == 1


@pytest.mark.parametrize(
    "existing",
    [None, step(SUB, StepStatus.EXECUTING), step(SUB, StepStatus.ALLOWED)],
    ids=["new", "orphan", "approved"],
)
def test_a_proceed_always_renews_the_lease(existing: Step | None) -> None:
    """The agent may act on a `proceed` for a lease timeout from when it asked
    (`may_start_body`), so every `proceed` renews, even within a second."""
    outcome = decide(
        ex=execution(dispatch_record=dispatch(locked_at=T0)), now=T0 + 0.5, existing=existing
    )
    assert reply(outcome).decision is Decision.PROCEED
    (ex,) = outcome.change.executions
    assert ex.dispatch is not None
    assert ex.dispatch.locked_at == T0 + 0.5


# -- complete / fail step ----------------------------------------------------------------

EXECUTING = step(SUB, StepStatus.EXECUTING)


def finish(
    kind: str,
    *,
    ex: Execution | None = None,
    st: Step | None = EXECUTING,
    lease: Lease = LEASE,
    caller: str | None = AGENT_ID,
    owner: str | None = None,
) -> Outcome[StepDecision]:
    common: dict[str, Any] = {
        "execution": execution() if ex is None else ex,
        "caller": caller,
        "lease": lease,
        "lease_owner": owner,
        "step": st,
        "now": NOW,
    }
    if kind == "complete":
        return complete_step(result='{"hits":2}', **common)
    return fail_step(error='{"message":"boom"}', **common)


def test_complete_step_records_result() -> None:
    outcome = finish("complete")
    assert reply(outcome) == StepDecision(decision=Decision.RECORDED)
    (written,) = outcome.change.steps
    assert written.status is StepStatus.SUCCEEDED
    assert written.result == '{"hits":2}'
    assert written.error is None
    assert written.completed_at == NOW
    assert event_types(outcome.change) == ["step.succeeded"]
    assert payload(outcome.change.events[0]) == {
        "step_id": EXECUTING.step_id,
        "step_type": "tool_call",
        "target": "search",
    }


def test_fail_step_records_error() -> None:
    outcome = finish("fail")
    assert reply(outcome) == StepDecision(decision=Decision.RECORDED)
    (written,) = outcome.change.steps
    assert written.status is StepStatus.FAILED
    assert written.error == '{"message":"boom"}'
    assert written.result is None
    assert event_types(outcome.change) == ["step.failed"]
    assert payload(outcome.change.events[0])["error"] == {"message": "boom"}


@pytest.mark.parametrize("kind", ["complete", "fail"])
def test_finish_on_terminal_step_replays_what_stands(kind: str) -> None:
    done = step(SUB, StepStatus.SUCCEEDED, result='"first"')
    outcome = finish(kind, st=done)
    assert reply(outcome) == StepDecision(
        decision=Decision.REPLAY, step_id=done.step_id, result='"first"'
    )
    assert outcome.change.is_empty
    failed = step(SUB, StepStatus.FAILED, error='{"m":1}')
    assert reply(finish(kind, st=failed)).error == '{"m":1}'


@pytest.mark.parametrize("kind", ["complete", "fail"])
def test_finish_on_step_not_executing_is_409(kind: str) -> None:
    waiting = step(SUB, StepStatus.AWAITING_APPROVAL, approval_id="a")
    refused(
        finish(kind, st=waiting), ErrorCode.CONFLICT, "step is awaiting_approval, not executing"
    )
    allowed = step(SUB, StepStatus.ALLOWED)
    refused(finish(kind, st=allowed), ErrorCode.CONFLICT, "step is allowed, not executing")


@pytest.mark.parametrize("kind", ["complete", "fail"])
def test_finish_unknown_or_foreign_step_is_404(kind: str) -> None:
    refused(finish(kind, st=None), ErrorCode.NOT_FOUND, "step not found")
    foreign = step(SUB, StepStatus.EXECUTING, exec_id="0192f1a0-0000-7000-8000-0000000000ff")
    refused(finish(kind, st=foreign), ErrorCode.NOT_FOUND, "step not found")


@pytest.mark.parametrize("kind", ["complete", "fail"])
def test_finish_on_terminal_execution(kind: str) -> None:
    ex = execution(ExecutionStatus.CANCELLED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED))
    outcome = finish(kind, ex=ex)
    assert reply(outcome) == StepDecision(decision=Decision.EXECUTION_TERMINAL)
    assert outcome.change.is_empty


@pytest.mark.parametrize("kind", ["complete", "fail"])
def test_finish_refusals(kind: str) -> None:
    refused(
        finish(kind, caller="other"),
        ErrorCode.FORBIDDEN,
        f"execution {EXEC_ID} belongs to another agent",
    )
    refused(
        finish(kind, lease=Lease(dispatch_id=DISPATCH_ID, attempt=2)),
        ErrorCode.LEASE_SUPERSEDED,
        "dispatch lease superseded",
    )
    refused(
        finish(kind, lease=Lease(dispatch_id="x", attempt=1)),
        ErrorCode.VALIDATION_ERROR,
        "unknown dispatch_id",
    )


@pytest.mark.parametrize("kind", ["complete", "fail"])
def test_lease_retired_by_block_may_finish_its_steps(kind: str) -> None:
    ex = execution(ExecutionStatus.BLOCKED, dispatch_record=dispatch(DispatchStatus.EXHAUSTED))
    outcome = finish(kind, ex=ex)
    assert reply(outcome) == StepDecision(decision=Decision.RECORDED)
    assert outcome.change.steps[0].status in (StepStatus.SUCCEEDED, StepStatus.FAILED)
    # The retired dispatch is not renewed.
    for written in outcome.change.executions:
        assert written.dispatch == ex.dispatch


def test_policy_is_consulted_only_for_a_new_step_of_a_running_execution() -> None:
    from rebuno_proto import may_hold_approvals, needs_verdict

    running, blocked = execution(), execution(ExecutionStatus.BLOCKED)
    assert needs_verdict(running, None)
    assert not needs_verdict(blocked, None)
    assert not needs_verdict(running, step(submission(), StepStatus.SUCCEEDED))
    assert may_hold_approvals(blocked)
    assert not may_hold_approvals(running)

"""The step-submission decision and step completion (PROTOCOL.md §5, §6.2).

`decide_submission` is §5.1 in order: terminal execution, lease, existing step
by status, blocked execution, refused `at_most_once` retry, policy verdict. The
occurrence counter advances exactly when the decision records or finds a step
(`proceed`, `replay`, `denied`, approval `blocked`), never for
`execution_blocked`, `rate_limited`, `execution_terminal` or a refusal (§1.3).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Final

from ._canonical import parse_document
from ._dispatch import lease_refusal, renew_lease, retire
from ._events import EventType
from ._outcome import CounterWrite, Decision, ErrorCode, Outcome, RateBucket, Refusal, StepDecision
from ._records import Approval, Execution, Idempotency, Lease, Step
from ._state import (
    EXECUTION_TRANSITIONS,
    STEP_TRANSITIONS,
    ApprovalStatus,
    ExecutionStatus,
    ExecutionTrigger,
    StepStatus,
    StepTrigger,
    advance,
)
from ._step_id import step_id
from ._tx import NewId, Tx, check_owner, error_json
from ._verdict import Action, Verdict
from ._wire import StepSubmission

__all__ = [
    "INDETERMINATE_ERROR",
    "StepKey",
    "complete_step",
    "decide_submission",
    "fail_step",
    "needs_indeterminate_check",
    "needs_verdict",
    "step_key",
    "submission_hash",
]

_T: Final = EventType
INDETERMINATE_MESSAGE: Final = (
    "outcome unknown: this may already have taken effect. Check the state before continuing."
)
#: The error an orphaned `at_most_once` step is failed with.
INDETERMINATE_ERROR: Final = error_json("indeterminate", message=INDETERMINATE_MESSAGE)
INDETERMINATE_RETRY_REASON: Final = "prior attempt outcome unknown; retry refused"
INDETERMINATE_RETRY_RULE: Final = "__indeterminate_retry"
_TERMINAL_DECISION: Final = StepDecision(decision=Decision.EXECUTION_TERMINAL)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepKey:
    """Where a submission lands: its occurrence and step id."""

    args_hash: str
    occurrence: int
    step_id: str


def submission_hash(submission: StepSubmission) -> str:
    """The `args_hash` of a submission (its arguments are already canonical)."""
    return hashlib.sha256(submission.args.encode("utf-8")).hexdigest()


def step_key(
    execution_id: str,
    submission: StepSubmission,
    counter: int | None,
    *,
    args_hash: str | None = None,
) -> StepKey:
    """The occurrence and step id of a submission.

    Args:
        counter: the highest occurrence of this (kind, target, args_hash) already
            consumed in the current dispatch attempt, or `None` for none.
        args_hash: `submission_hash(submission)` if the caller has it already.
    """
    digest = args_hash or submission_hash(submission)
    occurrence = 0 if counter is None else counter + 1
    return StepKey(
        args_hash=digest,
        occurrence=occurrence,
        step_id=step_id(execution_id, submission.kind.value, submission.target, digest, occurrence),
    )


def needs_indeterminate_check(
    execution: Execution, submission: StepSubmission, existing: Step | None
) -> bool:
    """Whether the decision depends on an earlier indeterminate failure of the
    same effect (§5.1 step 6); the caller then looks it up."""
    return (
        existing is None
        and submission.idempotency is Idempotency.AT_MOST_ONCE
        and execution.status is ExecutionStatus.RUNNING
    )


def needs_verdict(execution: Execution, existing: Step | None) -> bool:
    """Whether the decision may depend on policy: a new step of a running
    execution (the caller then evaluates the agent's bundle)."""
    return existing is None and execution.status is ExecutionStatus.RUNNING


def _error_reason(error: str | None, default: str) -> str:
    if error is None:
        return default
    value = parse_document(error.encode("utf-8")).value
    reason = value.get("reason") if isinstance(value, dict) else None
    return reason if isinstance(reason, str) and reason else default


def _replay(step: Step) -> StepDecision:
    if step.status is StepStatus.SUCCEEDED:
        return StepDecision(decision=Decision.REPLAY, step_id=step.step_id, result=step.result)
    return StepDecision(
        decision=Decision.REPLAY,
        step_id=step.step_id,
        error=step.error or error_json(step.status.value),
    )


def decide_submission(
    *,
    execution: Execution,
    caller: str | None,
    lease: Lease,
    lease_owner: str | None,
    submission: StepSubmission,
    key: StepKey,
    existing: Step | None,
    has_indeterminate_failure: bool,
    verdict: Verdict,
    rate_buckets: tuple[RateBucket, ...] = (),
    new_id: NewId,
    now: float,
) -> Outcome[StepDecision]:
    """Decide one step submission (PROTOCOL.md §5.1).

    Args:
        execution: the execution, read under its lock.
        caller: the authenticated agent id.
        lease: the lease the request carries.
        lease_owner: owner of `lease.dispatch_id` when `needs_lease_owner`.
        submission: the parsed submission.
        key: `step_key(...)` of the submission under the current counter.
        existing: the stored step with `key.step_id`, if any.
        has_indeterminate_failure: an earlier attempt of this exact effect
            failed as indeterminate (only read when `needs_indeterminate_check`).
        verdict: what policy says about a new step.
        rate_buckets: rate-limit counters to store if the new step is counted.
        new_id: source of new ids (for an approval).
        now: the kernel's clock.
    """
    refusal = check_owner(execution, caller)
    if refusal is not None:
        return Outcome(reply=refusal)
    if execution.status.is_terminal:
        return Outcome(reply=_TERMINAL_DECISION)
    refusal = lease_refusal(execution, lease, lease_owner, allow_retired=True)
    if refusal is not None:
        return Outcome(reply=refusal)

    tx = Tx(now)
    execution = tx.put(renew_lease(tx.track(execution), now))

    def advance_counter() -> None:
        tx.counters.append(
            CounterWrite(
                execution_id=execution.id,
                kind=submission.kind,
                target=submission.target,
                args_hash=key.args_hash,
                value=key.occurrence,
            )
        )

    if existing is not None:
        advance_counter()
        return tx.outcome(_decide_existing(tx, execution, existing, submission))

    if execution.status is ExecutionStatus.BLOCKED:
        return tx.outcome(StepDecision(decision=Decision.EXECUTION_BLOCKED))

    step = Step(
        step_id=key.step_id,
        execution_id=execution.id,
        kind=submission.kind,
        target=submission.target,
        args_hash=key.args_hash,
        occurrence=key.occurrence,
        status=StepStatus.PROPOSED,
        idempotency=submission.idempotency,
        args=submission.args,
        started_at=now,
    )
    log = tx.log(execution)

    if has_indeterminate_failure and submission.idempotency is Idempotency.AT_MOST_ONCE:
        verdict = Verdict(
            action=Action.DENY,
            rule_id=INDETERMINATE_RETRY_RULE,
            reason=INDETERMINATE_RETRY_REASON,
        )
    elif verdict.rate_limited:
        log.step(
            _T.STEP_RATE_LIMITED,
            step,
            rule_id=verdict.rule_id,
            error=error_json(verdict.rate_limited, rule_id=verdict.rule_id),
        )
        return tx.outcome(StepDecision(decision=Decision.RATE_LIMITED, reason=verdict.rate_limited))

    advance_counter()
    tx.rate_buckets.extend(rate_buckets)
    log.step(_T.STEP_PROPOSED, step)

    if verdict.action is Action.DENY:
        reason = verdict.reason or "policy_denied"
        error = error_json(reason, rule_id=verdict.rule_id)
        step = tx.put_step(
            dataclasses.replace(
                step,
                status=advance(STEP_TRANSITIONS, step.status, StepTrigger.POLICY_DENIED),
                error=error,
                rule_id=verdict.rule_id,
                completed_at=now,
            )
        )
        log.step(_T.STEP_DENIED, step, rule_id=verdict.rule_id, error=error)
        return tx.outcome(
            StepDecision(
                decision=Decision.DENIED,
                step_id=step.step_id,
                reason=reason,
                rule_id=verdict.rule_id,
            )
        )

    if verdict.action is Action.REQUIRE_APPROVAL:
        approval = tx.put_approval(
            Approval(
                id=new_id(),
                execution_id=execution.id,
                step_id=step.step_id,
                status=ApprovalStatus.PENDING,
                created_at=now,
                timeout_at=now + verdict.approval_timeout_s,
                approvers=verdict.approvers,
                message=verdict.approval_message,
                rule_id=verdict.rule_id,
            )
        )
        step = tx.put_step(
            dataclasses.replace(
                step,
                status=advance(STEP_TRANSITIONS, step.status, StepTrigger.APPROVAL_REQUIRED),
                approval_id=approval.id,
                rule_id=verdict.rule_id,
            )
        )
        log.step(_T.STEP_AWAITING_APPROVAL, step, rule_id=verdict.rule_id)
        log.approval(_T.APPROVAL_REQUESTED, approval)
        blocked = retire(
            dataclasses.replace(
                execution,
                status=advance(
                    EXECUTION_TRANSITIONS, execution.status, ExecutionTrigger.APPROVAL_REQUIRED
                ),
                updated_at=now,
            )
        )
        tx.put(blocked)
        log.execution(_T.EXECUTION_BLOCKED, blocked)
        tx.wake_timer(approval.timeout_at)
        return tx.outcome(
            StepDecision(decision=Decision.BLOCKED, step_id=step.step_id, approval_id=approval.id)
        )

    step = tx.put_step(
        dataclasses.replace(
            step,
            status=advance(STEP_TRANSITIONS, step.status, StepTrigger.POLICY_ALLOWED),
            rule_id=verdict.rule_id,
        )
    )
    log.step(_T.STEP_ALLOWED, step, rule_id=verdict.rule_id)
    log.step(_T.STEP_EXECUTING, step)
    _renew_for_proceed(tx, execution)
    return tx.outcome(StepDecision(decision=Decision.PROCEED, step_id=step.step_id))


def _renew_for_proceed(tx: Tx, execution: Execution) -> None:
    """A `proceed` renews the lease now, whatever `RENEW_EVERY_S` says: the
    agent may act on it for a lease timeout from when it asked
    (`may_start_body`), so the kernel must hold the lease that long."""
    tx.put(renew_lease(tx.execution(execution.id), tx.now, always=True))


def _stricter(first: Idempotency, second: Idempotency) -> Idempotency:
    if Idempotency.AT_MOST_ONCE in (first, second):
        return Idempotency.AT_MOST_ONCE
    return Idempotency.SAFE_TO_RETRY


def _decide_existing(
    tx: Tx, execution: Execution, step: Step, submission: StepSubmission
) -> StepDecision:
    status = step.status
    if status in (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.CANCELLED):
        return _replay(step)
    if status is StepStatus.DENIED:
        return StepDecision(
            decision=Decision.DENIED,
            step_id=step.step_id,
            reason=_error_reason(step.error, "policy_denied"),
            rule_id=step.rule_id,
        )
    if status is StepStatus.AWAITING_APPROVAL:
        return StepDecision(
            decision=Decision.BLOCKED, step_id=step.step_id, approval_id=step.approval_id
        )
    if status is StepStatus.ALLOWED:
        # Approved: it runs once, whatever its idempotency. The body starts now,
        # under this submission's idempotency: keep the stricter of the two, so
        # an orphan of this run is never re-run if either said at_most_once.
        step = tx.put_step(
            dataclasses.replace(
                step,
                status=advance(STEP_TRANSITIONS, status, StepTrigger.RESUBMITTED),
                started_at=tx.now,
                idempotency=_stricter(step.idempotency, submission.idempotency),
            )
        )
        tx.log(execution).step(_T.STEP_EXECUTING, step)
        _renew_for_proceed(tx, execution)
        return StepDecision(decision=Decision.PROCEED, step_id=step.step_id)
    # An orphan: executing, submitted again by a later attempt (§6.2). The
    # idempotency of *this* submission decides -- unless the body already ran
    # as at_most_once: a promise made when the effect started is kept even if
    # a later submission of the same call says it is safe to retry (found by
    # the simulator, seed 5737 of the harsh profile).
    if (
        submission.idempotency is Idempotency.SAFE_TO_RETRY
        and step.idempotency is Idempotency.SAFE_TO_RETRY
    ):
        advance(STEP_TRANSITIONS, status, StepTrigger.ORPHAN_RETRIED)
        _renew_for_proceed(tx, execution)
        return StepDecision(decision=Decision.PROCEED, step_id=step.step_id)
    step = tx.put_step(
        dataclasses.replace(
            step,
            status=advance(STEP_TRANSITIONS, status, StepTrigger.ORPHAN_INDETERMINATE),
            error=INDETERMINATE_ERROR,
            completed_at=tx.now,
        )
    )
    tx.log(execution).step(_T.STEP_FAILED, step, error=INDETERMINATE_ERROR)
    return _replay(step)


def _finish_step(
    *,
    execution: Execution,
    caller: str | None,
    lease: Lease,
    lease_owner: str | None,
    step: Step | None,
    now: float,
    trigger: StepTrigger,
    result: str | None,
    error: str | None,
) -> Outcome[StepDecision]:
    refusal = check_owner(execution, caller)
    if refusal is not None:
        return Outcome(reply=refusal)
    if execution.status.is_terminal:
        return Outcome(reply=_TERMINAL_DECISION)
    refusal = lease_refusal(execution, lease, lease_owner, allow_retired=True)
    if refusal is not None:
        return Outcome(reply=refusal)
    if step is None or step.execution_id != execution.id:
        return Outcome(reply=Refusal(ErrorCode.NOT_FOUND, "step not found"))
    if step.status.is_terminal:
        # The first recorded outcome is the truth; a late report changes nothing.
        return Outcome(reply=_replay(step))
    if step.status is not StepStatus.EXECUTING:
        return Outcome(
            reply=Refusal(ErrorCode.CONFLICT, f"step is {step.status.value}, not executing")
        )
    tx = Tx(now)
    execution = tx.put(renew_lease(tx.track(execution), now))
    step = tx.put_step(
        dataclasses.replace(
            step,
            status=advance(STEP_TRANSITIONS, step.status, trigger),
            result=result,
            error=error,
            completed_at=now,
        )
    )
    if trigger is StepTrigger.AGENT_COMPLETED:
        tx.log(execution).step(_T.STEP_SUCCEEDED, step)
    else:
        tx.log(execution).step(_T.STEP_FAILED, step, error=error)
    return tx.outcome(StepDecision(decision=Decision.RECORDED))


def complete_step(
    *,
    execution: Execution,
    caller: str | None,
    lease: Lease,
    lease_owner: str | None,
    step: Step | None,
    result: str,
    now: float,
) -> Outcome[StepDecision]:
    """Record a step's result (`recorded`), or answer what already stands:
    `replay` for a step that already ended, `execution_terminal`, a refusal."""
    return _finish_step(
        execution=execution,
        caller=caller,
        lease=lease,
        lease_owner=lease_owner,
        step=step,
        now=now,
        trigger=StepTrigger.AGENT_COMPLETED,
        result=result,
        error=None,
    )


def fail_step(
    *,
    execution: Execution,
    caller: str | None,
    lease: Lease,
    lease_owner: str | None,
    step: Step | None,
    error: str,
    now: float,
) -> Outcome[StepDecision]:
    """Record a step's failure; `error` is a JSON object text."""
    return _finish_step(
        execution=execution,
        caller=caller,
        lease=lease,
        lease_owner=lease_owner,
        step=step,
        now=now,
        trigger=StepTrigger.AGENT_FAILED,
        result=None,
        error=error,
    )

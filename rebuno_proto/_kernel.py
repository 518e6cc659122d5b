"""Execution lifecycle rules (PROTOCOL.md §6.1, §6.3, §8): create, heartbeat,
complete, fail, cancel; claim, delivery result and reclaim of the dispatch;
approval decisions and expiry; the session's previous state.

Every rule is a pure function over the records the service read under the
execution's lock. It returns an `Outcome`: the reply, the `Change` to commit,
and when the dispatcher or the timer should wake.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Final

from ._dispatch import (
    DispatchSettings,
    backoff_delay,
    lease_refusal,
    renew_lease,
)
from ._events import EventType
from ._outcome import ErrorCode, Outcome, Refusal
from ._records import Agent, Approval, Execution, Lease, Step
from ._state import (
    APPROVAL_TRANSITIONS,
    DISPATCH_TRANSITIONS,
    EXECUTION_TRANSITIONS,
    STEP_TRANSITIONS,
    ApprovalStatus,
    ApprovalTrigger,
    DispatchStatus,
    DispatchTrigger,
    ExecutionStatus,
    ExecutionTrigger,
    StepTrigger,
    advance,
)
from ._tx import NewId, SessionView, Tx, check_owner
from ._wire import CreateExecution, ExecutionCompletion, ExecutionFailure

__all__ = [
    "ApprovalChoice",
    "Created",
    "Delivery",
    "cancel_execution",
    "claim_dispatch",
    "create_execution",
    "decide_approval",
    "end_execution",
    "expire_approval",
    "heartbeat",
    "holds_lease",
    "previous_state",
    "reclaim_lease",
    "record_delivery",
    "retire_lease_after_restart",
]

_T: Final = EventType
_CLAIMABLE: Final = (DispatchStatus.PENDING, DispatchStatus.FAILED)


@dataclass(frozen=True, slots=True, kw_only=True)
class Created:
    """The reply to a create: the execution, and whether it is new (an
    idempotency-key match returns the earlier one)."""

    execution: Execution
    is_new: bool


def create_execution(
    *,
    request: CreateExecution,
    agent: Agent | None,
    duplicate: Execution | None,
    session_busy: bool,
    head: Execution | None,
    new_id: NewId,
    now: float,
    settings: DispatchSettings,
) -> Outcome[Created]:
    """Create an execution; admit it at once unless its session is busy.

    Args:
        request: the parsed create request.
        agent: the agent it names, if registered.
        duplicate: an execution of the same agent with the same idempotency key.
        session_busy: the session already has an admitted, unfinished execution
            or a queue (PROTOCOL.md §8: one at a time, in creation order).
        head: the agent's last completed execution in the session.
    """
    if agent is None:
        return Outcome(
            reply=Refusal(ErrorCode.NOT_FOUND, f"agent {request.agent_id!r} is not registered")
        )
    if duplicate is not None:
        if duplicate.input == request.input and duplicate.session == request.session:
            return Outcome(reply=Created(execution=duplicate, is_new=False))
        return Outcome(
            reply=Refusal(
                ErrorCode.CONFLICT,
                f"idempotency_key {request.idempotency_key!r} was already used by execution "
                f"{duplicate.id} with a different input or session",
            )
        )
    tx = Tx(now)
    execution = tx.put(
        Execution(
            id=new_id(),
            agent_id=agent.id,
            status=ExecutionStatus.PENDING,
            created_at=now,
            updated_at=now,
            input=request.input,
            session=request.session,
            idempotency_key=request.idempotency_key,
        )
    )
    tx.log(execution).execution(_T.EXECUTION_CREATED, execution, session=execution.session)
    if not session_busy:
        tx.admit(execution, head, new_id, settings)
    return tx.outcome(Created(execution=tx.execution(execution.id), is_new=True))


def heartbeat(
    *, execution: Execution, caller: str | None, lease: Lease, lease_owner: str | None, now: float
) -> Outcome[None]:
    """Renew the lease. A terminal execution has retired its dispatch, so its
    heartbeat is `lease_superseded` too: that stops a cancelled handler
    (PROTOCOL.md §10.7)."""
    refusal = check_owner(execution, caller)
    if refusal is None:
        refusal = lease_refusal(execution, lease, lease_owner, allow_retired=False)
    if refusal is not None:
        return Outcome(reply=refusal)
    tx = Tx(now)
    tx.put(renew_lease(tx.track(execution), now, always=True))
    return tx.outcome(None)


def _may_end(
    execution: Execution, caller: str | None, lease: Lease, lease_owner: str | None
) -> Refusal | None:
    refusal = check_owner(execution, caller)
    if refusal is not None:
        return refusal
    if execution.status.is_terminal:
        return Refusal(ErrorCode.EXECUTION_TERMINAL, f"execution is {execution.status.value}")
    return lease_refusal(execution, lease, lease_owner, allow_retired=True)


def end_execution(
    *,
    execution: Execution,
    caller: str | None,
    lease: Lease,
    lease_owner: str | None,
    ending: ExecutionCompletion | ExecutionFailure,
    session: SessionView,
    pending: tuple[tuple[Approval, Step], ...],
    new_id: NewId,
    now: float,
    settings: DispatchSettings,
) -> Outcome[None]:
    """The agent ends its execution: completed with the handler's output (and
    session state), or failed with `ending.error` as the reason.

    Refused (nothing changes) for another agent's execution, a terminal one
    (`409 execution_terminal`), or a lease that may not act.
    """
    refusal = _may_end(execution, caller, lease, lease_owner)
    if refusal is not None:
        return Outcome(reply=refusal)
    tx = Tx(now)
    is_completion = isinstance(ending, ExecutionCompletion)
    tx.finish(
        tx.track(execution),
        ExecutionTrigger.AGENT_COMPLETED if is_completion else ExecutionTrigger.AGENT_FAILED,
        session=session,
        pending=pending,
        new_id=new_id,
        settings=settings,
        output=ending.output if isinstance(ending, ExecutionCompletion) else None,
        state=ending.state if isinstance(ending, ExecutionCompletion) else None,
        reason=ending.error if isinstance(ending, ExecutionFailure) else "",
    )
    return tx.outcome(None)


def cancel_execution(
    *,
    execution: Execution,
    session: SessionView,
    pending: tuple[tuple[Approval, Step], ...],
    active_steps: tuple[Step, ...],
    new_id: NewId,
    now: float,
    settings: DispatchSettings,
) -> Outcome[None]:
    """A client cancels: `409 execution_terminal` if it already ended (the
    published SDK's `Client.cancel` then raises `Terminated`)."""
    if execution.status.is_terminal:
        return Outcome(
            reply=Refusal(ErrorCode.EXECUTION_TERMINAL, f"execution is {execution.status.value}")
        )
    tx = Tx(now)
    ended = tx.finish(
        tx.track(execution),
        ExecutionTrigger.CLIENT_CANCELLED,
        session=session,
        pending=pending,
        new_id=new_id,
        settings=settings,
        reason="client_cancelled",
    )
    tx.cancel_steps(ended, active_steps)
    return tx.outcome(None)


# -- dispatch ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """A claimed dispatch to deliver: POST the webhook for this lease."""

    execution_id: str
    agent_id: str
    dispatch_id: str
    attempt: int

    def lease(self) -> Lease:
        return Lease(dispatch_id=self.dispatch_id, attempt=self.attempt)


def claim_dispatch(
    *,
    execution: Execution,
    session: SessionView,
    new_id: NewId,
    now: float,
    settings: DispatchSettings,
) -> Outcome[Delivery | None]:
    """Claim the execution's dispatch if it is due: attempt + 1, `in_flight`,
    occurrence counters cleared. Past `max_attempts` the execution fails
    `dispatch_exhausted`; a terminal execution's dispatch is discarded."""
    dispatch = execution.dispatch
    if dispatch is None or dispatch.status not in _CLAIMABLE or dispatch.next_attempt_at > now:
        return Outcome(reply=None)
    tx = Tx(now)
    execution = tx.track(execution)
    if execution.status.is_terminal or dispatch.attempt + 1 > dispatch.max_attempts:
        refused = dataclasses.replace(
            dispatch,
            status=advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.CLAIM_REFUSED),
        )
        execution = tx.put(dataclasses.replace(execution, dispatch=refused))
        if execution.status.is_terminal:
            tx.log(execution).dispatch(_T.DISPATCH_DISCARDED, refused, "exhausted")
        else:
            tx.finish(
                execution,
                ExecutionTrigger.DISPATCH_EXHAUSTED,
                session=session,
                pending=(),
                new_id=new_id,
                settings=settings,
                reason="dispatch_exhausted",
            )
        return tx.outcome(None)
    claimed = dataclasses.replace(
        dispatch,
        status=advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.CLAIMED),
        attempt=dispatch.attempt + 1,
        locked_at=now,
    )
    tx.put(dataclasses.replace(execution, dispatch=claimed))
    tx.cleared_counters.append(execution.id)
    return tx.outcome(
        Delivery(
            execution_id=execution.id,
            agent_id=execution.agent_id,
            dispatch_id=claimed.id,
            attempt=claimed.attempt,
        )
    )


def record_delivery(
    *,
    execution: Execution,
    lease: Lease,
    is_acked: bool,
    jitter: float,
    session: SessionView,
    new_id: NewId,
    now: float,
    settings: DispatchSettings,
) -> Outcome[None]:
    """Record how a webhook POST went. 2xx: `dispatch.acked`, the lease stays
    held. Otherwise `dispatch.failed`, and a retry after backoff -- or, on the
    last allowed attempt, the execution fails `dispatch_exhausted`. A result
    for a lease that is no longer current changes nothing."""
    dispatch = execution.dispatch
    if (
        execution.status.is_terminal
        or dispatch is None
        or dispatch.status is not DispatchStatus.IN_FLIGHT
        or dispatch.lease() != lease
    ):
        return Outcome(reply=None)
    tx = Tx(now)
    execution = tx.track(execution)
    if is_acked:
        advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.DELIVERY_ACKED)
        execution = tx.put(renew_lease(execution, now, always=True))
        tx.log(execution).dispatch(_T.DISPATCH_ACKED, dispatch, "acked")
        return tx.outcome(None)
    if dispatch.attempt >= dispatch.max_attempts:
        failed = dataclasses.replace(
            dispatch,
            status=advance(
                DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.DELIVERY_EXHAUSTED
            ),
        )
        execution = tx.put(dataclasses.replace(execution, dispatch=failed))
        tx.log(execution).dispatch(_T.DISPATCH_FAILED, failed, "failed")
        tx.finish(
            execution,
            ExecutionTrigger.DISPATCH_EXHAUSTED,
            session=session,
            pending=(),
            new_id=new_id,
            settings=settings,
            reason="dispatch_exhausted",
        )
        return tx.outcome(None)
    due = now + backoff_delay(dispatch.attempt, jitter, settings)
    failed = dataclasses.replace(
        dispatch,
        status=advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.DELIVERY_FAILED),
        next_attempt_at=due,
        locked_at=None,
    )
    execution = tx.put(dataclasses.replace(execution, dispatch=failed))
    tx.log(execution).dispatch(_T.DISPATCH_FAILED, failed, "failed")
    tx.dispatch_due_at = due
    return tx.outcome(None)


def lease_lapsed(execution: Execution, now: float, settings: DispatchSettings) -> bool:
    """Whether the execution's in-flight lease has not been renewed for a lease timeout."""
    dispatch = execution.dispatch
    return (
        dispatch is not None
        and dispatch.status is DispatchStatus.IN_FLIGHT
        and dispatch.locked_at is not None
        and now - dispatch.locked_at >= settings.lease_timeout_s
    )


def reclaim_lease(*, execution: Execution, now: float, settings: DispatchSettings) -> Outcome[bool]:
    """The reaper: an in-flight dispatch whose lease lapsed goes back to the
    queue, due now, attempt unchanged; the next claim re-delivers the same
    dispatch id with attempt + 1 (`dispatch.queued` records it)."""
    if not lease_lapsed(execution, now, settings) or execution.status.is_terminal:
        return Outcome(reply=False)
    dispatch = execution.dispatch
    assert dispatch is not None
    tx = Tx(now)
    requeued = dataclasses.replace(
        dispatch,
        status=advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.LEASE_LAPSED),
        next_attempt_at=now,
        locked_at=None,
    )
    execution = tx.put(dataclasses.replace(tx.track(execution), dispatch=requeued))
    tx.log(execution).dispatch(_T.DISPATCH_QUEUED, requeued, "pending")
    tx.dispatch_due_at = now
    return tx.outcome(True)


def holds_lease(execution: Execution) -> bool:
    """Whether some agent may still act under a lease of this execution: an
    in-flight dispatch, or one retired by the execution's own block."""
    dispatch = execution.dispatch
    if dispatch is None or execution.status.is_terminal:
        return False
    return dispatch.status is DispatchStatus.IN_FLIGHT or (
        dispatch.status is DispatchStatus.EXHAUSTED and execution.status is ExecutionStatus.BLOCKED
    )


def retire_lease_after_restart(*, execution: Execution, now: float) -> Outcome[bool]:
    """A kernel (re)start retires every lease granted before it.

    The occurrence counters of a dispatch attempt live only in the kernel's
    memory (they reset at every claim anyway), so after a restart no earlier
    attempt may submit again: an in-flight dispatch is re-queued at once (the
    next claim re-delivers it with attempt + 1 and a fresh count; the old
    handler gets `lease_superseded`), and a dispatch retired by a block moves to
    a new attempt so its lease no longer matches. A crashed kernel's runs are
    re-dispatched immediately instead of after a lease timeout.
    """
    if not holds_lease(execution):
        return Outcome(reply=False)
    dispatch = execution.dispatch
    assert dispatch is not None
    tx = Tx(now)
    execution = tx.track(execution)
    status = advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.KERNEL_RESTARTED)
    if status is DispatchStatus.PENDING:
        requeued = dataclasses.replace(dispatch, status=status, next_attempt_at=now, locked_at=None)
        execution = tx.put(dataclasses.replace(execution, dispatch=requeued))
        tx.log(execution).dispatch(_T.DISPATCH_QUEUED, requeued, "pending")
        tx.dispatch_due_at = now
    else:
        retired = dataclasses.replace(dispatch, attempt=dispatch.attempt + 1)
        tx.put(dataclasses.replace(execution, dispatch=retired))
    return tx.outcome(True)


# -- approvals -----------------------------------------------------------------


class ApprovalChoice(enum.Enum):
    GRANT = "grant"
    DENY = "deny"


def decide_approval(
    *,
    approval: Approval,
    execution: Execution,
    step: Step,
    choice: ApprovalChoice,
    decided_by: str,
    rationale: str,
    new_id: NewId,
    now: float,
    settings: DispatchSettings,
) -> Outcome[None]:
    """A human grants or denies a pending approval.

    The approval releases only the step it was created for: that step id (so
    those exact canonical arguments) in that execution, under that rule. Grant:
    the step becomes `allowed` and runs once when resubmitted. Deny: the step is
    denied with the human's rationale. Either way the execution resumes with a
    new dispatch. A decider outside a non-empty `approvers` list gets `403`; an
    approval no longer pending gets `409`; neither changes anything.
    """
    if approval.status is not ApprovalStatus.PENDING:
        return Outcome(
            reply=Refusal(ErrorCode.CONFLICT, f"approval is already {approval.status.value}")
        )
    if approval.approvers and decided_by not in approval.approvers:
        who = repr(decided_by) if decided_by else "an anonymous caller"
        return Outcome(
            reply=Refusal(
                ErrorCode.FORBIDDEN,
                f"{who} may not decide this approval; approvers: {', '.join(approval.approvers)}",
            )
        )
    if (
        step.step_id != approval.step_id
        or step.execution_id != approval.execution_id
        or step.approval_id != approval.id
        or execution.id != approval.execution_id
        or execution.status is not ExecutionStatus.BLOCKED
    ):
        return Outcome(
            reply=Refusal(ErrorCode.CONFLICT, "approval no longer matches a blocked step")
        )
    tx = Tx(now)
    execution = tx.track(execution)
    log = tx.log(execution)
    if choice is ApprovalChoice.GRANT:
        approval = tx.put_approval(
            dataclasses.replace(
                approval,
                status=advance(APPROVAL_TRANSITIONS, approval.status, ApprovalTrigger.GRANTED),
                decided_by=decided_by,
                decided_at=now,
                rationale=rationale,
            )
        )
        step = tx.put_step(
            dataclasses.replace(
                step,
                status=advance(STEP_TRANSITIONS, step.status, StepTrigger.APPROVAL_GRANTED),
            )
        )
        log.approval(_T.APPROVAL_GRANTED, approval)
        log.step(_T.STEP_ALLOWED, step, rule_id=step.rule_id)
    else:
        tx.refuse_approval(
            approval,
            step,
            ApprovalTrigger.DENIED,
            rationale=rationale,
            decided_by=decided_by,
            step_reason=rationale or "approval_denied",
        )
    _resume(tx, execution, new_id, settings)
    return tx.outcome(None)


def expire_approval(
    *,
    approval: Approval,
    execution: Execution,
    step: Step,
    new_id: NewId,
    now: float,
    settings: DispatchSettings,
) -> Outcome[bool]:
    """A pending approval past its timeout expires: the step is denied
    (`approval_timeout`) and the execution resumes."""
    if (
        approval.status is not ApprovalStatus.PENDING
        or now < approval.timeout_at
        or execution.status is not ExecutionStatus.BLOCKED
        or step.approval_id != approval.id
    ):
        return Outcome(reply=False)
    tx = Tx(now)
    execution = tx.track(execution)
    tx.log(execution)
    tx.refuse_approval(
        approval,
        step,
        ApprovalTrigger.EXPIRED,
        rationale="timeout",
        decided_by="",
        step_reason="approval_timeout",
    )
    _resume(tx, execution, new_id, settings)
    return tx.outcome(True)


def _resume(tx: Tx, execution: Execution, new_id: NewId, settings: DispatchSettings) -> None:
    resumed = tx.put(
        dataclasses.replace(
            execution,
            status=advance(
                EXECUTION_TRANSITIONS, execution.status, ExecutionTrigger.APPROVAL_RESOLVED
            ),
            updated_at=tx.now,
        )
    )
    tx.log(resumed).execution(_T.EXECUTION_RESUMED, resumed)
    tx.enqueue(resumed, new_id, settings)


# -- sessions ------------------------------------------------------------------


def previous_state(parent: Execution | None) -> str:
    """What `previous()` returns, as JSON text (PROTOCOL.md §8): the state the
    session head completed with, else its output, else `null`."""
    if parent is None or parent.status is not ExecutionStatus.COMPLETED:
        return "null"
    if parent.state is not None:
        return parent.state
    return parent.output if parent.output is not None else "null"

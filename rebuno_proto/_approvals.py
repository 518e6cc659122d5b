"""Approval rules (PROTOCOL.md §6.1, §7), pure: a human grants or denies a
pending approval, or it expires; either way the execution resumes with a new
dispatch and the held step is allowed once or denied."""

from __future__ import annotations

import dataclasses
import enum
from typing import Final

from ._dispatch import (
    DispatchSettings,
)
from ._events import EventType
from ._outcome import ErrorCode, Outcome, Refusal
from ._records import Approval, Execution, Step
from ._state import (
    APPROVAL_TRANSITIONS,
    EXECUTION_TRANSITIONS,
    STEP_TRANSITIONS,
    ApprovalStatus,
    ApprovalTrigger,
    ExecutionStatus,
    ExecutionTrigger,
    StepTrigger,
    advance,
)
from ._tx import NewId, Tx

__all__ = ["ApprovalChoice", "decide_approval", "expire_approval"]

_T: Final = EventType


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
    if now >= approval.timeout_at:
        # Its timeout passed; the expiry timer is about to record it.
        return Outcome(reply=Refusal(ErrorCode.CONFLICT, "approval has expired"))
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

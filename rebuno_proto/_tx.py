"""The change a kernel rule is building, and the helpers every rule shares:
ownership, admission, termination.

A rule reads the records it was given, records every new version here, and
ends with `Tx.outcome(reply)`. Executions that got events have their
`last_event_seq` advanced in the same change, so event numbering is gap-free by
construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeVar

from ._dispatch import DispatchSettings, new_dispatch, retire
from ._events import EventLog, EventType
from ._jsonout import dumps
from ._outcome import Change, CounterWrite, ErrorCode, Outcome, RateBucket, Refusal
from ._records import Approval, Execution, Step
from ._state import (
    APPROVAL_TRANSITIONS,
    EXECUTION_TRANSITIONS,
    STEP_TRANSITIONS,
    ApprovalStatus,
    ApprovalTrigger,
    ExecutionStatus,
    ExecutionTrigger,
    StepStatus,
    StepTrigger,
    advance,
)

__all__ = ["NO_SESSION", "NewId", "SessionView", "Tx", "check_owner", "may_hold_approvals"]

NewId = Callable[[], str]
_R = TypeVar("_R")
_T: Final = EventType


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionView:
    """What a rule needs to know about the execution's session when the
    execution may end: the next queued execution to admit, and that execution's
    head (its agent's last completed execution in the session) before this change.
    """

    next_pending: Execution | None = None
    head_for_next: Execution | None = None


NO_SESSION: Final = SessionView()


def check_owner(execution: Execution, agent_id: str | None) -> Refusal | None:
    """An agent may act only on its own executions (PROTOCOL.md §2.5).

    `agent_id` is `None` for a bearer (client or admin) caller.
    """
    if agent_id is None or agent_id == execution.agent_id:
        return None
    return Refusal(ErrorCode.FORBIDDEN, f"execution {execution.id} belongs to another agent")


def may_hold_approvals(execution: Execution) -> bool:
    """Whether the execution can have a pending approval (only while blocked):
    an ending then needs them, to close them."""
    return execution.status is ExecutionStatus.BLOCKED


def error_json(reason: str, **extra: str) -> str:
    """A step error object, as JSON text (errors are always objects)."""
    return dumps({"reason": reason, **extra})


class Tx:
    """Accumulates the records a rule writes."""

    def __init__(self, now: float) -> None:
        self.now = now
        self._executions: dict[str, Execution] = {}
        self._originals: dict[str, Execution] = {}
        self._logs: dict[str, EventLog] = {}
        self._steps: dict[str, Step] = {}
        self._approvals: dict[str, Approval] = {}
        self.counters: list[CounterWrite] = []
        self.cleared_counters: list[str] = []
        self.new_dispatches: list[tuple[str, str]] = []
        self.rate_buckets: list[RateBucket] = []
        self.dispatch_due_at: float | None = None
        self.timer_due_at: float | None = None

    def log(self, execution: Execution) -> EventLog:
        log = self._logs.get(execution.id)
        if log is None:
            log = self._logs[execution.id] = EventLog(execution, self.now)
            self._executions.setdefault(execution.id, execution)
        return log

    def track(self, execution: Execution) -> Execution:
        """Register an execution as read: it is written only if it changes."""
        self._originals[execution.id] = execution
        self._executions.setdefault(execution.id, execution)
        return execution

    def put(self, execution: Execution) -> Execution:
        self._executions[execution.id] = execution
        return execution

    def put_step(self, step: Step) -> Step:
        self._steps[step.step_id] = step
        return step

    def put_approval(self, approval: Approval) -> Approval:
        self._approvals[approval.id] = approval
        return approval

    def execution(self, execution_id: str) -> Execution:
        """The latest version of an execution this change holds, events counted."""
        execution = self._executions[execution_id]
        log = self._logs.get(execution_id)
        return execution if log is None else log.close(execution)

    def wake_timer(self, at: float) -> None:
        if self.timer_due_at is None or at < self.timer_due_at:
            self.timer_due_at = at

    def outcome(self, reply: _R) -> Outcome[_R]:
        executions = tuple(
            self.execution(eid)
            for eid, version in self._executions.items()
            if version is not self._originals.get(eid)
            or (eid in self._logs and self._logs[eid].events)
        )
        events = tuple(e for log in self._logs.values() for e in log.events)
        return Outcome(
            reply=reply,
            change=Change(
                executions=executions,
                steps=tuple(self._steps.values()),
                approvals=tuple(self._approvals.values()),
                events=events,
                counters=tuple(self.counters),
                cleared_counters=tuple(self.cleared_counters),
                new_dispatches=tuple(self.new_dispatches),
                rate_buckets=tuple(self.rate_buckets),
            ),
            dispatch_due_at=self.dispatch_due_at,
            timer_due_at=self.timer_due_at,
        )

    # -- shared rules ------------------------------------------------------

    def enqueue(self, execution: Execution, new_id: NewId, settings: DispatchSettings) -> Execution:
        """Give the execution a new dispatch, due now; `dispatch.queued`."""
        dispatch = new_dispatch(new_id(), self.now, settings)
        execution = self.put(dataclasses.replace(execution, dispatch=dispatch))
        self.log(execution).dispatch(_T.DISPATCH_QUEUED, dispatch, "pending")
        self.new_dispatches.append((dispatch.id, execution.id))
        self.dispatch_due_at = self.now
        return execution

    def admit(
        self,
        execution: Execution,
        head: Execution | None,
        new_id: NewId,
        settings: DispatchSettings,
    ) -> Execution:
        """Start a pending execution: it continues `head` (PROTOCOL.md §8)."""
        status = advance(EXECUTION_TRANSITIONS, execution.status, ExecutionTrigger.ADMITTED)
        execution = self.put(
            dataclasses.replace(
                execution,
                status=status,
                parent_execution_id=None if head is None else head.id,
                updated_at=self.now,
            )
        )
        self.log(execution).execution(
            _T.EXECUTION_STARTED, execution, parent_execution_id=execution.parent_execution_id
        )
        return self.enqueue(execution, new_id, settings)

    def refuse_approval(
        self,
        approval: Approval,
        step: Step,
        trigger: ApprovalTrigger,
        *,
        rationale: str,
        decided_by: str,
        step_reason: str,
    ) -> None:
        """Close a pending approval without granting it; its step is denied."""
        approval = self.put_approval(
            dataclasses.replace(
                approval,
                status=advance(APPROVAL_TRANSITIONS, approval.status, trigger),
                decided_by=decided_by,
                decided_at=self.now,
                rationale=rationale,
            )
        )
        error = error_json(step_reason)
        step = self.put_step(
            dataclasses.replace(
                step,
                status=advance(STEP_TRANSITIONS, step.status, StepTrigger.APPROVAL_REFUSED),
                error=error,
                completed_at=self.now,
            )
        )
        event = {
            ApprovalStatus.DENIED: _T.APPROVAL_DENIED,
            ApprovalStatus.EXPIRED: _T.APPROVAL_EXPIRED,
        }[approval.status]
        log = self._logs[approval.execution_id]
        log.approval(event, approval)
        log.step(_T.STEP_DENIED, step, rule_id=step.rule_id, error=error)

    def finish(
        self,
        execution: Execution,
        trigger: ExecutionTrigger,
        *,
        session: SessionView,
        pending: tuple[tuple[Approval, Step], ...],
        new_id: NewId,
        settings: DispatchSettings,
        output: str | None = None,
        state: str | None = None,
        reason: str = "",
    ) -> Execution:
        """End an execution: release its dispatch, close its pending approvals,
        and admit the next execution queued in its session."""
        # Only an admitted execution holds its session's slot (PROTOCOL.md §8);
        # a queued one that is cancelled frees nothing.
        held_slot = execution.status is not ExecutionStatus.PENDING
        status = advance(EXECUTION_TRANSITIONS, execution.status, trigger)
        execution = self.put(
            retire(
                dataclasses.replace(
                    execution,
                    status=status,
                    output=output if status is ExecutionStatus.COMPLETED else execution.output,
                    state=state if status is ExecutionStatus.COMPLETED else execution.state,
                    failure_reason=reason,
                    updated_at=self.now,
                )
            )
        )
        # Its occurrence counters can never be used again: let the store drop them.
        self.cleared_counters.append(execution.id)
        log = self.log(execution)
        if status is ExecutionStatus.COMPLETED:
            log.completed(execution)
        elif status is ExecutionStatus.FAILED:
            log.execution(_T.EXECUTION_FAILED, execution, reason=reason)
        else:
            log.execution(_T.EXECUTION_CANCELLED, execution, reason=reason)
        for approval, step in pending:
            self.refuse_approval(
                approval,
                step,
                ApprovalTrigger.EXPIRED,
                rationale=f"execution_{status.value}",
                decided_by="",
                step_reason=f"execution_{status.value}",
            )
        nxt = session.next_pending
        if (
            held_slot
            and execution.session
            and nxt is not None
            and nxt.status is ExecutionStatus.PENDING
        ):
            head = session.head_for_next
            if status is ExecutionStatus.COMPLETED and execution.agent_id == nxt.agent_id:
                head = execution
            self.admit(nxt, head, new_id, settings)
        return execution

    def cancel_steps(self, execution: Execution, steps: tuple[Step, ...]) -> None:
        """Steps still executing (or approved, not yet run) when the execution
        is cancelled become `cancelled`."""
        error = error_json("execution_cancelled")
        log = self.log(execution)
        for step in steps:
            if step.status not in (StepStatus.EXECUTING, StepStatus.ALLOWED):
                continue
            step = self.put_step(
                dataclasses.replace(
                    step,
                    status=advance(STEP_TRANSITIONS, step.status, StepTrigger.EXECUTION_CANCELLED),
                    error=error,
                    completed_at=self.now,
                )
            )
            log.step(_T.STEP_CANCELLED, step, error=error)

"""Kernel commands: each reads exactly the records its rule needs and returns
the rule's `Outcome` (DESIGN.md, "How the kernel core meets storage").

A command is a synchronous function over a `Records` reader -- one store
transaction. The caller applies `outcome.change` in that same transaction,
commits, and then acts on the wake-ups. The kernel service runs these over its
stores; the simulator (`rebuno_proto.sim`) runs the very same commands over
`MemoryRecords`, so what it checks is what the kernel does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

from ._approvals import ApprovalChoice, decide_approval, expire_approval
from ._delivery import (
    Delivery,
    DeliveryResult,
    claim_dispatch,
    reclaim_lease,
    record_delivery,
    retire_lease_after_restart,
)
from ._dispatch import DispatchSettings, needs_lease_owner
from ._kernel import Created, cancel_execution, create_execution, end_execution, heartbeat
from ._outcome import ErrorCode, Outcome, RateBucket, Refusal, StepDecision
from ._records import Agent, Approval, Execution, Lease, Step, StepKind
from ._submit import (
    complete_step,
    decide_submission,
    fail_step,
    needs_indeterminate_check,
    needs_verdict,
    step_key,
    submission_hash,
)
from ._tx import NO_SESSION, NewId, SessionView, may_hold_approvals
from ._verdict import ALLOW, Verdict
from ._wire import CreateExecution, ExecutionCompletion, ExecutionFailure, StepSubmission

__all__ = ["KernelCommands", "Policy", "Records", "allow_all"]

_R = TypeVar("_R")


class Records(Protocol):
    """The reads a kernel command makes, inside its transaction."""

    def execution(self, execution_id: str) -> Execution | None: ...
    def step(self, step_id: str) -> Step | None: ...
    def counter(
        self, execution_id: str, kind: StepKind, target: str, args_hash: str
    ) -> int | None: ...
    def dispatch_owner(self, dispatch_id: str) -> str | None: ...
    def has_indeterminate(
        self, execution_id: str, kind: StepKind, target: str, args_hash: str
    ) -> bool: ...
    def active_steps(self, execution_id: str) -> Sequence[Step]: ...
    def execution_by_key(self, agent_id: str, idempotency_key: str) -> Execution | None: ...
    def session_busy(self, session: str) -> bool: ...
    def session_head(self, session: str, agent_id: str) -> Execution | None: ...
    def session_next(self, session: str, excluding: str) -> Execution | None: ...
    def approval(self, approval_id: str) -> Approval | None: ...
    def pending_approvals(self, execution_id: str) -> Sequence[tuple[Approval, Step]]: ...
    def agent(self, agent_id: str) -> Agent | None: ...
    def rate_bucket(self, key: str) -> RateBucket | None: ...


#: Evaluates policy for a new step: the verdict, and the rate-limit buckets to
#: store if the step is counted.
Policy = Callable[
    [Records, Execution, Agent | None, StepSubmission, float],
    tuple[Verdict, tuple[RateBucket, ...]],
]


def allow_all(
    records: Records,
    execution: Execution,
    agent: Agent | None,
    submission: StepSubmission,
    now: float,
) -> tuple[Verdict, tuple[RateBucket, ...]]:
    """The policy with no bundle: every step is allowed."""
    return ALLOW, ()


def _not_found(what: str = "execution") -> Refusal:
    return Refusal(ErrorCode.NOT_FOUND, f"{what} not found")


_NO_EXECUTION: Final[Outcome[None]] = Outcome(reply=_not_found())


def session_view(records: Records, execution: Execution) -> SessionView:
    """What ending `execution` needs to know about its session."""
    if not execution.session:
        return NO_SESSION
    nxt = records.session_next(execution.session, execution.id)
    head = None if nxt is None else records.session_head(execution.session, nxt.agent_id)
    return SessionView(next_pending=nxt, head_for_next=head)


def lease_owner(records: Records, execution: Execution, lease: Lease) -> str | None:
    """The owner of the lease's dispatch id, when the lease rules need it."""
    if needs_lease_owner(execution, lease):
        return records.dispatch_owner(lease.dispatch_id)
    return None


def _pending(records: Records, execution: Execution) -> tuple[tuple[Approval, Step], ...]:
    if may_hold_approvals(execution):
        return tuple(records.pending_approvals(execution.id))
    return ()


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelCommands:
    """Every kernel command, over a `Records` reader.

    Args:
        settings: lease timeout, delivery attempts, backoff.
        new_id: source of new ids (executions, dispatches, approvals).
        policy: evaluates policy for new steps; allows everything by default.
    """

    settings: DispatchSettings
    new_id: NewId
    policy: Policy = allow_all

    # -- clients -------------------------------------------------------------------

    def create(self, records: Records, request: CreateExecution, now: float) -> Outcome[Created]:
        duplicate = (
            records.execution_by_key(request.agent_id, request.idempotency_key)
            if request.idempotency_key
            else None
        )
        busy = bool(request.session) and records.session_busy(request.session)
        head = (
            records.session_head(request.session, request.agent_id)
            if request.session and not busy
            else None
        )
        return create_execution(
            request=request,
            agent=records.agent(request.agent_id),
            duplicate=duplicate,
            session_busy=busy,
            head=head,
            new_id=self.new_id,
            now=now,
            settings=self.settings,
        )

    def cancel(self, records: Records, execution_id: str, now: float) -> Outcome[None]:
        execution = records.execution(execution_id)
        if execution is None:
            return _NO_EXECUTION
        return cancel_execution(
            execution=execution,
            session=session_view(records, execution),
            pending=_pending(records, execution),
            active_steps=tuple(records.active_steps(execution.id)),
            new_id=self.new_id,
            now=now,
            settings=self.settings,
        )

    def decide_approval(
        self,
        records: Records,
        approval_id: str,
        choice: ApprovalChoice,
        *,
        decided_by: str,
        rationale: str,
        now: float,
    ) -> Outcome[None]:
        found = self._approval(records, approval_id)
        if found is None:
            return Outcome(reply=_not_found("approval"))
        approval, execution, step = found
        return decide_approval(
            approval=approval,
            execution=execution,
            step=step,
            choice=choice,
            decided_by=decided_by,
            rationale=rationale,
            new_id=self.new_id,
            now=now,
            settings=self.settings,
        )

    # -- agents ----------------------------------------------------------------------

    def submit(
        self,
        records: Records,
        execution_id: str,
        caller: str | None,
        lease: Lease,
        submission: StepSubmission,
        now: float,
        *,
        args_hash: str | None = None,
    ) -> Outcome[StepDecision]:
        """Decide a step submission; `args_hash` if the caller computed it
        outside the transaction."""
        execution = records.execution(execution_id)
        if execution is None:
            return Outcome(reply=_not_found())
        digest = args_hash or submission_hash(submission)
        counter = records.counter(execution.id, submission.kind, submission.target, digest)
        key = step_key(execution.id, submission, counter, args_hash=digest)
        existing = records.step(key.step_id)
        indeterminate = needs_indeterminate_check(
            execution, submission, existing
        ) and records.has_indeterminate(execution.id, submission.kind, submission.target, digest)
        verdict: Verdict = ALLOW
        buckets: tuple[RateBucket, ...] = ()
        if needs_verdict(execution, existing):
            verdict, buckets = self.policy(
                records, execution, records.agent(execution.agent_id), submission, now
            )
        return decide_submission(
            execution=execution,
            caller=caller,
            lease=lease,
            lease_owner=lease_owner(records, execution, lease),
            submission=submission,
            key=key,
            existing=existing,
            has_indeterminate_failure=indeterminate,
            verdict=verdict,
            rate_buckets=buckets,
            new_id=self.new_id,
            now=now,
        )

    def finish_step(
        self,
        records: Records,
        execution_id: str,
        step_id: str,
        caller: str | None,
        lease: Lease,
        now: float,
        *,
        result: str | None = None,
        error: str | None = None,
    ) -> Outcome[StepDecision]:
        """Record a step's result (`result`) or failure (`error`, a JSON object text)."""
        execution = records.execution(execution_id)
        if execution is None:
            return Outcome(reply=_not_found())
        owner = lease_owner(records, execution, lease)
        step = records.step(step_id)
        if error is None:
            return complete_step(
                execution=execution,
                caller=caller,
                lease=lease,
                lease_owner=owner,
                step=step,
                result=result or "null",
                now=now,
            )
        return fail_step(
            execution=execution,
            caller=caller,
            lease=lease,
            lease_owner=owner,
            step=step,
            error=error,
            now=now,
        )

    def heartbeat(
        self, records: Records, execution_id: str, caller: str | None, lease: Lease, now: float
    ) -> Outcome[None]:
        execution = records.execution(execution_id)
        if execution is None:
            return _NO_EXECUTION
        return heartbeat(
            execution=execution,
            caller=caller,
            lease=lease,
            lease_owner=lease_owner(records, execution, lease),
            now=now,
        )

    def end(
        self,
        records: Records,
        execution_id: str,
        caller: str | None,
        lease: Lease,
        ending: ExecutionCompletion | ExecutionFailure,
        now: float,
    ) -> Outcome[None]:
        """The agent completes or fails its execution."""
        execution = records.execution(execution_id)
        if execution is None:
            return _NO_EXECUTION
        return end_execution(
            execution=execution,
            caller=caller,
            lease=lease,
            lease_owner=lease_owner(records, execution, lease),
            ending=ending,
            session=session_view(records, execution),
            pending=_pending(records, execution),
            new_id=self.new_id,
            now=now,
            settings=self.settings,
        )

    # -- background work: dispatcher, reaper, timers, start-up ---------------------------

    def claim(self, records: Records, execution_id: str, now: float) -> Outcome[Delivery | None]:
        execution = records.execution(execution_id)
        if execution is None:
            return Outcome(reply=None)
        return claim_dispatch(
            execution=execution,
            session=session_view(records, execution),
            new_id=self.new_id,
            now=now,
            settings=self.settings,
        )

    def delivered(
        self,
        records: Records,
        delivery: Delivery,
        *,
        result: DeliveryResult,
        jitter: float,
        now: float,
    ) -> Outcome[None]:
        """Record how the webhook POST of `delivery` went (see `record_delivery`)."""
        execution = records.execution(delivery.execution_id)
        if execution is None:
            return Outcome(reply=None)
        return record_delivery(
            execution=execution,
            lease=delivery.lease(),
            result=result,
            jitter=jitter,
            session=session_view(records, execution),
            new_id=self.new_id,
            now=now,
            settings=self.settings,
        )

    def reclaim(self, records: Records, execution_id: str, now: float) -> Outcome[bool]:
        execution = records.execution(execution_id)
        if execution is None:
            return Outcome(reply=False)
        return reclaim_lease(execution=execution, now=now, settings=self.settings)

    def retire_after_restart(
        self, records: Records, now: float, *, execution_id: str
    ) -> Outcome[bool]:
        execution = records.execution(execution_id)
        if execution is None:
            return Outcome(reply=False)
        return retire_lease_after_restart(
            execution=execution, now=now, lease_timeout_s=self.settings.lease_timeout_s
        )

    def expire(self, records: Records, approval_id: str, now: float) -> Outcome[bool]:
        found = self._approval(records, approval_id)
        if found is None:
            return Outcome(reply=False)
        approval, execution, step = found
        return expire_approval(
            approval=approval,
            execution=execution,
            step=step,
            new_id=self.new_id,
            now=now,
            settings=self.settings,
        )

    @staticmethod
    def _approval(records: Records, approval_id: str) -> tuple[Approval, Execution, Step] | None:
        approval = records.approval(approval_id)
        if approval is None:
            return None
        execution = records.execution(approval.execution_id)
        step = records.step(approval.step_id)
        if execution is None or step is None:
            return None
        return approval, execution, step

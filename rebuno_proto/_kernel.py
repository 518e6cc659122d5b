"""Execution lifecycle rules (PROTOCOL.md §6.1, §8): create, heartbeat, end
(complete or fail), cancel; the session's previous state. The dispatch's rules
are in `_delivery`, the approvals' in `_approvals`.

Every rule is a pure function over the records the service read under the
execution's lock. It returns an `Outcome`: the reply, the `Change` to commit,
and when the dispatcher or the timer should wake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ._dispatch import (
    DispatchSettings,
    lease_refusal,
    renew_lease,
)
from ._events import EventType
from ._outcome import ErrorCode, Outcome, Refusal
from ._records import Agent, Approval, Execution, Lease, Step
from ._state import (
    ExecutionStatus,
    ExecutionTrigger,
)
from ._tx import NewId, SessionView, Tx, check_owner
from ._wire import CreateExecution, ExecutionCompletion, ExecutionFailure

__all__ = [
    "Created",
    "cancel_execution",
    "create_execution",
    "end_execution",
    "heartbeat",
    "previous_state",
]

_T: Final = EventType


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


# -- sessions ------------------------------------------------------------------


def previous_state(parent: Execution | None) -> str:
    """What `previous()` returns, as JSON text (PROTOCOL.md §8): the state the
    session head completed with, else its output, else `null`."""
    if parent is None or parent.status is not ExecutionStatus.COMPLETED:
        return "null"
    if parent.state is not None:
        return parent.state
    return parent.output if parent.output is not None else "null"

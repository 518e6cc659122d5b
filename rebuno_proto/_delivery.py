"""Dispatch lifecycle rules (PROTOCOL.md §6.3), pure: claim a due dispatch,
record how its webhook POST went, re-queue it when its lease lapses, and retire
every lease at a kernel start."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Final

from ._dispatch import (
    DispatchSettings,
    backoff_delay,
    renew_lease,
)
from ._events import EventType
from ._outcome import Outcome
from ._records import Execution, Lease
from ._state import (
    DISPATCH_TRANSITIONS,
    DispatchStatus,
    DispatchTrigger,
    ExecutionStatus,
    ExecutionTrigger,
    advance,
)
from ._tx import NewId, SessionView, Tx

__all__ = [
    "Delivery",
    "DeliveryResult",
    "claim_dispatch",
    "delivery_result",
    "holds_lease",
    "lease_lapsed",
    "reclaim_lease",
    "record_delivery",
    "retire_lease_after_restart",
]

_T: Final = EventType
_CLAIMABLE: Final = (DispatchStatus.PENDING, DispatchStatus.FAILED)


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """A claimed dispatch to deliver: POST the webhook for this lease."""

    execution_id: str
    agent_id: str
    dispatch_id: str
    attempt: int

    def lease(self) -> Lease:
        return Lease(dispatch_id=self.dispatch_id, attempt=self.attempt)


def _exhausted(
    tx: Tx, execution: Execution, session: SessionView, new_id: NewId, settings: DispatchSettings
) -> None:
    """The execution fails `dispatch_exhausted`: no attempt is left."""
    tx.finish(
        execution,
        ExecutionTrigger.DISPATCH_EXHAUSTED,
        session=session,
        pending=(),
        new_id=new_id,
        settings=settings,
        reason="dispatch_exhausted",
    )


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
            _exhausted(tx, execution, session, new_id, settings)
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


class DeliveryResult(enum.Enum):
    """How a webhook POST went."""

    #: The agent answered 2xx: it took the dispatch.
    ACKED = "acked"
    #: It never reached a handler: no connection, a bad URL, a non-2xx answer.
    REFUSED = "refused"
    #: It was sent and no answer came (a timeout, a connection lost, a proxy's
    #: 502 or 504): a handler may be running under its lease.
    UNANSWERED = "unanswered"


#: Answers a proxy gives when the agent behind it may have got the request.
_GATEWAY_LOST: Final = frozenset({502, 504})


def delivery_result(status: int) -> DeliveryResult:
    """The result of a POST answered with HTTP `status` (by the agent, or by
    a proxy in front of it)."""
    if 200 <= status < 300:
        return DeliveryResult.ACKED
    return DeliveryResult.UNANSWERED if status in _GATEWAY_LOST else DeliveryResult.REFUSED


def record_delivery(
    *,
    execution: Execution,
    lease: Lease,
    result: DeliveryResult,
    jitter: float,
    session: SessionView,
    new_id: NewId,
    now: float,
    settings: DispatchSettings,
) -> Outcome[None]:
    """Record how a webhook POST went. `ACKED`: `dispatch.acked`, the lease
    stays held. Otherwise `dispatch.failed`, and a retry after backoff -- or,
    on the last allowed attempt, the execution fails `dispatch_exhausted`. A
    result for a lease that is no longer current changes nothing.

    `UNANSWERED`: a handler may be running under this lease and holding a
    `proceed` it may still act on (`may_start_body`). The retry then also
    waits until the lease would have lapsed, so that a new attempt cannot
    decide those steps first (found by the simulator, seed 693 of the
    webhook-loss probe); on the last attempt the next claim exhausts it.
    """
    may_have_arrived = result is DeliveryResult.UNANSWERED
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
    if result is DeliveryResult.ACKED:
        advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.DELIVERY_ACKED)
        execution = tx.put(renew_lease(execution, now, always=True))
        tx.log(execution).dispatch(_T.DISPATCH_ACKED, dispatch, "acked")
        return tx.outcome(None)
    if dispatch.attempt >= dispatch.max_attempts and not may_have_arrived:
        failed = dataclasses.replace(
            dispatch,
            status=advance(
                DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.DELIVERY_EXHAUSTED
            ),
        )
        execution = tx.put(dataclasses.replace(execution, dispatch=failed))
        tx.log(execution).dispatch(_T.DISPATCH_FAILED, failed, "failed")
        _exhausted(tx, execution, session, new_id, settings)
        return tx.outcome(None)
    due = now + backoff_delay(dispatch.attempt, jitter, settings)
    if may_have_arrived:
        # On the last attempt too: the next claim then finds no attempt left
        # and fails the execution `dispatch_exhausted`, once no handler of
        # this one can still act.
        due = max(
            due,
            (now if dispatch.locked_at is None else dispatch.locked_at) + settings.lease_timeout_s,
        )
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
    """Whether some agent may still act under a lease of this execution -- or
    might after a crash: its dispatch is in flight, queued, waiting to retry, or
    retired by the execution's own block."""
    dispatch = execution.dispatch
    if dispatch is None or execution.status.is_terminal:
        return False
    if dispatch.status is DispatchStatus.EXHAUSTED:
        return execution.status is ExecutionStatus.BLOCKED
    return True


def retire_lease_after_restart(
    *, execution: Execution, now: float, lease_timeout_s: float
) -> Outcome[bool]:
    """A kernel start after a crash retires every lease granted before it.

    The occurrence counters of a dispatch attempt live in the kernel's memory
    (every claim resets them anyway), so after a crash no earlier attempt may
    submit again. An in-flight dispatch is re-queued, due when its lease would
    have lapsed (at once if it already has): the next claim re-delivers it with
    attempt + 1 and a fresh count, and the old handler gets `lease_superseded`.
    It is not due sooner because the old handler may hold a `proceed` it is
    still allowed to act on (`may_start_body`): a new attempt must not resolve
    that step before the body could have started (found by the simulator,
    seed 61258). A queued or retrying dispatch, and one retired by a
    block, move to a new attempt, so no lease handed out before -- not even a
    claim whose commit the crash lost -- can ever match again. None of this
    spends the delivery budget: `max_attempts` grows with the attempt. (After a
    clean shutdown the counters are saved and restored, and nothing is retired.)
    """
    if not holds_lease(execution):
        return Outcome(reply=False)
    dispatch = execution.dispatch
    assert dispatch is not None
    tx = Tx(now)
    execution = tx.track(execution)
    status = advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.KERNEL_RESTARTED)
    if dispatch.status is DispatchStatus.IN_FLIGHT:
        locked_at = now if dispatch.locked_at is None else dispatch.locked_at
        due = max(now, locked_at + lease_timeout_s)
        requeued = dataclasses.replace(
            dispatch,
            status=status,
            next_attempt_at=due,
            locked_at=None,
            max_attempts=dispatch.max_attempts + 1,
        )
        execution = tx.put(dataclasses.replace(execution, dispatch=requeued))
        tx.log(execution).dispatch(_T.DISPATCH_QUEUED, requeued, "pending")
        tx.dispatch_due_at = due
    else:
        retired = dataclasses.replace(
            dispatch, attempt=dispatch.attempt + 1, max_attempts=dispatch.max_attempts + 1
        )
        tx.put(dataclasses.replace(execution, dispatch=retired))
        if status is not DispatchStatus.EXHAUSTED:
            tx.dispatch_due_at = now
    return tx.outcome(True)

"""Dispatch and lease rules (PROTOCOL.md §6.3), pure.

A dispatch delivers an execution to its agent. The kernel queues it, claims it
(attempt + 1, the occurrence counters of the execution cleared, so every
attempt replays from occurrence 0), POSTs the webhook, and holds it `in_flight`
while the handler runs. The `(dispatch_id, attempt)` pair is the *lease*: every
agent mutation carries it, and only the current lease may change anything.

Current lease: the dispatch is the execution's most recent one, its attempt is
the one in the request, and it is `in_flight`. Anything else is refused with
`409 lease_superseded` and no effect -- except that a lease retired because its
own execution blocked on an approval may still finish the steps it started.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Final

from ._outcome import ErrorCode, Refusal
from ._records import Dispatch, Execution, Lease
from ._state import DISPATCH_TRANSITIONS, DispatchStatus, DispatchTrigger, ExecutionStatus, advance

__all__ = [
    "RENEW_EVERY_S",
    "DispatchSettings",
    "LeaseStatus",
    "backoff_delay",
    "lease_refusal",
    "lease_status",
    "needs_lease_owner",
    "new_dispatch",
    "renew_lease",
    "retire",
]

#: A lease-carrying mutation renews the lease at most this often; a heartbeat
#: always renews. Keeps the write load of a fast handler down.
RENEW_EVERY_S: Final = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchSettings:
    """How the kernel delivers: lease length, delivery attempts and backoff."""

    lease_timeout_s: float = 120.0
    max_attempts: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.lease_timeout_s < float("inf"):
            raise ValueError("lease_timeout_s must be positive and finite")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 <= self.backoff_base_s <= self.backoff_max_s < float("inf"):
            raise ValueError("need 0 <= backoff_base_s <= backoff_max_s")


def backoff_delay(attempt: int, jitter: float, settings: DispatchSettings) -> float:
    """Seconds to wait before re-delivering after failed attempt `attempt`.

    `min(base * 2**(attempt-1), max)`, plus `jitter` (a fraction in [0, 1) the
    caller draws) times a quarter of that.
    """
    exponent = min(max(attempt - 1, 0), 62)
    delay = min(settings.backoff_base_s * (2.0**exponent), settings.backoff_max_s)
    return delay * (1.0 + 0.25 * min(max(jitter, 0.0), 0.999999))


def new_dispatch(dispatch_id: str, now: float, settings: DispatchSettings) -> Dispatch:
    """A freshly queued dispatch: attempt 0, due now."""
    return Dispatch(
        id=dispatch_id,
        status=DispatchStatus.PENDING,
        attempt=0,
        max_attempts=settings.max_attempts,
        next_attempt_at=now,
    )


class LeaseStatus(enum.Enum):
    CURRENT = "current"
    RETIRED_BY_BLOCK = "retired_by_block"
    SUPERSEDED = "superseded"
    UNKNOWN = "unknown"
    FOREIGN = "foreign"


def needs_lease_owner(execution: Execution, lease: Lease) -> bool:
    """Whether `lease_status` needs to know which execution owns the lease's
    dispatch id (only when it is not the execution's current dispatch)."""
    return execution.dispatch is None or execution.dispatch.id != lease.dispatch_id


def lease_status(execution: Execution, lease: Lease, lease_owner: str | None) -> LeaseStatus:
    """Classify a lease against the execution's current dispatch.

    Args:
        execution: the execution the request names.
        lease: the lease the request carries.
        lease_owner: the execution that owns `lease.dispatch_id`, or `None` if
            no dispatch has that id; only read when `needs_lease_owner`.
    """
    dispatch = execution.dispatch
    if dispatch is None or dispatch.id != lease.dispatch_id:
        if lease_owner is None:
            return LeaseStatus.UNKNOWN
        if lease_owner != execution.id:
            return LeaseStatus.FOREIGN
        return LeaseStatus.SUPERSEDED
    if dispatch.attempt != lease.attempt:
        return LeaseStatus.SUPERSEDED
    if dispatch.status is DispatchStatus.IN_FLIGHT:
        return LeaseStatus.CURRENT
    if dispatch.status is DispatchStatus.EXHAUSTED and execution.status is ExecutionStatus.BLOCKED:
        return LeaseStatus.RETIRED_BY_BLOCK
    return LeaseStatus.SUPERSEDED


_LEASE_REFUSALS: Final = {
    LeaseStatus.UNKNOWN: Refusal(ErrorCode.VALIDATION_ERROR, "unknown dispatch_id"),
    LeaseStatus.FOREIGN: Refusal(
        ErrorCode.VALIDATION_ERROR, "dispatch_id belongs to another execution"
    ),
    LeaseStatus.SUPERSEDED: Refusal(ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded"),
    LeaseStatus.RETIRED_BY_BLOCK: Refusal(ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded"),
}


def lease_refusal(
    execution: Execution, lease: Lease, lease_owner: str | None, *, allow_retired: bool
) -> Refusal | None:
    """`None` if the lease may act, else the refusal to answer.

    Args:
        allow_retired: accept a lease retired by its own execution's block (step
            completion and submissions may; a heartbeat may not).
    """
    status = lease_status(execution, lease, lease_owner)
    if status is LeaseStatus.CURRENT or (allow_retired and status is LeaseStatus.RETIRED_BY_BLOCK):
        return None
    return _LEASE_REFUSALS[status]


def renew_lease(execution: Execution, now: float, *, always: bool = False) -> Execution:
    """The execution with its in-flight lease renewed at `now`.

    Unless `always`, a lease renewed less than `RENEW_EVERY_S` ago is left as is.
    """
    dispatch = execution.dispatch
    if dispatch is None or dispatch.status is not DispatchStatus.IN_FLIGHT:
        return execution
    if not always and dispatch.locked_at is not None and now - dispatch.locked_at < RENEW_EVERY_S:
        return execution
    advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.LEASE_RENEWED)
    return dataclasses.replace(execution, dispatch=dataclasses.replace(dispatch, locked_at=now))


def retire(execution: Execution) -> Execution:
    """The execution with its dispatch released (on block or a terminal status)."""
    dispatch = execution.dispatch
    if dispatch is None or dispatch.status is DispatchStatus.EXHAUSTED:
        return execution
    status = advance(DISPATCH_TRANSITIONS, dispatch.status, DispatchTrigger.RELEASED)
    return dataclasses.replace(execution, dispatch=dataclasses.replace(dispatch, status=status))

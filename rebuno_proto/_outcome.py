"""What a kernel rule returns: the reply, the records to write, and when to
wake the kernel's background work.

The service applies a `Change` inside the same transaction the inputs were read
in, commits, and only then acts on the wake-ups (DESIGN.md, "How the kernel core
meets storage").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from ._records import Approval, Event, Execution, Step, StepKind

__all__ = [
    "Change",
    "CounterWrite",
    "Decision",
    "ErrorCode",
    "Outcome",
    "RateBucket",
    "Refusal",
    "StepDecision",
]


class ErrorCode(enum.Enum):
    """The `code` of the error envelope (PROTOCOL.md §4.0), with its HTTP status."""

    VALIDATION_ERROR = "validation_error"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    EXECUTION_TERMINAL = "execution_terminal"
    LEASE_SUPERSEDED = "lease_superseded"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NOT_IMPLEMENTED = "not_implemented"
    INTERNAL_ERROR = "internal_error"

    @property
    def status(self) -> int:
        return _STATUS[self]


_STATUS: Final = {
    ErrorCode.VALIDATION_ERROR: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.EXECUTION_TERMINAL: 409,
    ErrorCode.LEASE_SUPERSEDED: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.NOT_IMPLEMENTED: 501,
    ErrorCode.INTERNAL_ERROR: 500,
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """An error reply: nothing was changed."""

    code: ErrorCode
    message: str

    @property
    def status(self) -> int:
        return self.code.status


class Decision(enum.Enum):
    """The kernel's answer to a step submission (PROTOCOL.md §5.2)."""

    PROCEED = "proceed"
    REPLAY = "replay"
    DENIED = "denied"
    RATE_LIMITED = "rate_limited"
    BLOCKED = "blocked"
    EXECUTION_BLOCKED = "execution_blocked"
    EXECUTION_TERMINAL = "execution_terminal"
    RECORDED = "recorded"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDecision:
    """A step decision. `result` and `error` are JSON texts (at most one is set;
    `error` is always an object)."""

    decision: Decision
    step_id: str = ""
    result: str | None = None
    error: str | None = None
    approval_id: str | None = None
    reason: str = ""
    rule_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class CounterWrite:
    """The highest occurrence consumed for one effect in the current dispatch."""

    execution_id: str
    kind: StepKind
    target: str
    args_hash: str
    value: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RateBucket:
    """Calls counted against one rate limit in its current fixed window."""

    key: str
    window_start: float
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """Records to write in one transaction. Executions, steps, approvals and
    buckets are upserts of whole records; events and dispatch ids are inserts."""

    executions: tuple[Execution, ...] = ()
    steps: tuple[Step, ...] = ()
    approvals: tuple[Approval, ...] = ()
    events: tuple[Event, ...] = ()
    counters: tuple[CounterWrite, ...] = ()
    cleared_counters: tuple[str, ...] = ()
    new_dispatches: tuple[tuple[str, str], ...] = ()  # (dispatch_id, execution_id)
    rate_buckets: tuple[RateBucket, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (
            self.executions
            or self.steps
            or self.approvals
            or self.events
            or self.counters
            or self.cleared_counters
            or self.new_dispatches
            or self.rate_buckets
        )


_R = TypeVar("_R")
_NO_CHANGE: Final = Change()


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome(Generic[_R]):
    """The reply, the change to commit, and the wake-ups to act on after commit.

    `dispatch_due_at` is when the dispatcher next has a dispatch to claim;
    `timer_due_at` is when an approval next expires.
    """

    reply: _R | Refusal
    change: Change = field(default=_NO_CHANGE)
    dispatch_due_at: float | None = None
    timer_due_at: float | None = None

"""The kernel's four state machines, as data (PROTOCOL.md §6).

Theory of operation. Each record the kernel keeps -- an execution, a step, the
dispatch that delivers an execution to its agent, an approval -- has a status
from a closed enum, and it changes status only through a trigger: something that
happened (an agent completed the step, a lease lapsed, a human granted). The
legal moves are the tables below, one per record type, keyed by
(status, trigger). `advance` is the only way the kernel code moves a status; a
pair missing from its table raises `LocalProtocolError`, so a bug shows up as a
protocol error rather than as a record in a state nobody designed.

The tables are also the documentation: `docs/protocol.md` describes them and
the tests visit every (status, trigger) pair.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, TypeVar

from ._errors import LocalProtocolError

__all__ = [
    "APPROVAL_TRANSITIONS",
    "DISPATCH_TRANSITIONS",
    "EXECUTION_TRANSITIONS",
    "STEP_TRANSITIONS",
    "ApprovalStatus",
    "ApprovalTrigger",
    "DispatchStatus",
    "DispatchTrigger",
    "ExecutionStatus",
    "ExecutionTrigger",
    "StepStatus",
    "StepTrigger",
    "advance",
]


class ExecutionStatus(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    BLOCKED = "blocked"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_EXECUTION


_TERMINAL_EXECUTION: Final = frozenset(
    {ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.CANCELLED}
)


class ExecutionTrigger(enum.Enum):
    ADMITTED = "admitted"  # the session slot is free: start it
    APPROVAL_REQUIRED = "approval_required"  # a step is held for a human
    APPROVAL_RESOLVED = "approval_resolved"  # granted, denied or expired
    AGENT_COMPLETED = "agent_completed"
    AGENT_FAILED = "agent_failed"
    DISPATCH_EXHAUSTED = "dispatch_exhausted"
    CLIENT_CANCELLED = "client_cancelled"


class StepStatus(enum.Enum):
    PROPOSED = "proposed"
    ALLOWED = "allowed"
    EXECUTING = "executing"
    AWAITING_APPROVAL = "awaiting_approval"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DENIED = "denied"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_STEP


_TERMINAL_STEP: Final = frozenset(
    {StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.DENIED, StepStatus.CANCELLED}
)


class StepTrigger(enum.Enum):
    POLICY_ALLOWED = "policy_allowed"
    POLICY_DENIED = "policy_denied"
    APPROVAL_REQUIRED = "approval_required"
    APPROVAL_GRANTED = "approval_granted"
    APPROVAL_REFUSED = "approval_refused"  # denied, expired, or the execution ended
    RESUBMITTED = "resubmitted"  # an approved step is submitted again: run it once
    ORPHAN_RETRIED = "orphan_retried"  # executing, safe_to_retry: run again
    ORPHAN_INDETERMINATE = "orphan_indeterminate"  # executing, at_most_once: unknown
    AGENT_COMPLETED = "agent_completed"
    AGENT_FAILED = "agent_failed"
    EXECUTION_CANCELLED = "execution_cancelled"


class DispatchStatus(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    FAILED = "failed"
    EXHAUSTED = "exhausted"


class DispatchTrigger(enum.Enum):
    CLAIMED = "claimed"  # taken for delivery: attempt + 1, occurrences reset
    DELIVERY_ACKED = "delivery_acked"  # agent answered 2xx; lease held while it runs
    DELIVERY_FAILED = "delivery_failed"  # non-2xx or network error; retry later
    DELIVERY_EXHAUSTED = "delivery_exhausted"  # failed on the last allowed attempt
    LEASE_RENEWED = "lease_renewed"  # heartbeat or lease-carrying mutation
    LEASE_LAPSED = "lease_lapsed"  # reaper: back to the queue for re-delivery
    CLAIM_REFUSED = "claim_refused"  # max attempts reached, or execution terminal
    RELEASED = "released"  # execution blocked or terminal
    KERNEL_RESTARTED = "kernel_restarted"  # every lease held before a restart is retired


class ApprovalStatus(enum.Enum):
    PENDING = "pending"
    GRANTED = "granted"
    DENIED = "denied"
    EXPIRED = "expired"


class ApprovalTrigger(enum.Enum):
    GRANTED = "granted"
    DENIED = "denied"
    EXPIRED = "expired"  # timeout, or the execution ended first


_E = ExecutionStatus
_ET = ExecutionTrigger
EXECUTION_TRANSITIONS: Final[Mapping[tuple[ExecutionStatus, ExecutionTrigger], ExecutionStatus]] = {
    (_E.PENDING, _ET.ADMITTED): _E.RUNNING,
    (_E.PENDING, _ET.CLIENT_CANCELLED): _E.CANCELLED,
    (_E.RUNNING, _ET.APPROVAL_REQUIRED): _E.BLOCKED,
    (_E.RUNNING, _ET.AGENT_COMPLETED): _E.COMPLETED,
    (_E.RUNNING, _ET.AGENT_FAILED): _E.FAILED,
    (_E.RUNNING, _ET.DISPATCH_EXHAUSTED): _E.FAILED,
    (_E.RUNNING, _ET.CLIENT_CANCELLED): _E.CANCELLED,
    (_E.BLOCKED, _ET.APPROVAL_RESOLVED): _E.RUNNING,
    # A handler may still finish after its own lease was retired by the block.
    (_E.BLOCKED, _ET.AGENT_COMPLETED): _E.COMPLETED,
    (_E.BLOCKED, _ET.AGENT_FAILED): _E.FAILED,
    (_E.BLOCKED, _ET.CLIENT_CANCELLED): _E.CANCELLED,
}

_S = StepStatus
_ST = StepTrigger
STEP_TRANSITIONS: Final[Mapping[tuple[StepStatus, StepTrigger], StepStatus]] = {
    (_S.PROPOSED, _ST.POLICY_ALLOWED): _S.EXECUTING,
    (_S.PROPOSED, _ST.POLICY_DENIED): _S.DENIED,
    (_S.PROPOSED, _ST.APPROVAL_REQUIRED): _S.AWAITING_APPROVAL,
    (_S.AWAITING_APPROVAL, _ST.APPROVAL_GRANTED): _S.ALLOWED,
    (_S.AWAITING_APPROVAL, _ST.APPROVAL_REFUSED): _S.DENIED,
    (_S.ALLOWED, _ST.RESUBMITTED): _S.EXECUTING,
    (_S.ALLOWED, _ST.EXECUTION_CANCELLED): _S.CANCELLED,
    (_S.EXECUTING, _ST.ORPHAN_RETRIED): _S.EXECUTING,
    (_S.EXECUTING, _ST.ORPHAN_INDETERMINATE): _S.FAILED,
    (_S.EXECUTING, _ST.AGENT_COMPLETED): _S.SUCCEEDED,
    (_S.EXECUTING, _ST.AGENT_FAILED): _S.FAILED,
    (_S.EXECUTING, _ST.EXECUTION_CANCELLED): _S.CANCELLED,
}

_D = DispatchStatus
_DT = DispatchTrigger
DISPATCH_TRANSITIONS: Final[Mapping[tuple[DispatchStatus, DispatchTrigger], DispatchStatus]] = {
    (_D.PENDING, _DT.CLAIMED): _D.IN_FLIGHT,
    (_D.FAILED, _DT.CLAIMED): _D.IN_FLIGHT,
    (_D.PENDING, _DT.CLAIM_REFUSED): _D.EXHAUSTED,
    (_D.FAILED, _DT.CLAIM_REFUSED): _D.EXHAUSTED,
    (_D.IN_FLIGHT, _DT.DELIVERY_ACKED): _D.IN_FLIGHT,
    (_D.IN_FLIGHT, _DT.DELIVERY_FAILED): _D.FAILED,
    (_D.IN_FLIGHT, _DT.DELIVERY_EXHAUSTED): _D.EXHAUSTED,
    (_D.IN_FLIGHT, _DT.LEASE_RENEWED): _D.IN_FLIGHT,
    (_D.IN_FLIGHT, _DT.LEASE_LAPSED): _D.PENDING,
    (_D.PENDING, _DT.RELEASED): _D.EXHAUSTED,
    (_D.IN_FLIGHT, _DT.RELEASED): _D.EXHAUSTED,
    (_D.FAILED, _DT.RELEASED): _D.EXHAUSTED,
    (_D.EXHAUSTED, _DT.RELEASED): _D.EXHAUSTED,
    # A restart after a crash retires every lease: an in-flight dispatch is
    # re-queued (the next claim re-delivers it with attempt + 1); a queued one
    # and one a block retired move to a new attempt, so no old lease matches.
    (_D.IN_FLIGHT, _DT.KERNEL_RESTARTED): _D.PENDING,
    (_D.PENDING, _DT.KERNEL_RESTARTED): _D.PENDING,
    (_D.FAILED, _DT.KERNEL_RESTARTED): _D.FAILED,
    (_D.EXHAUSTED, _DT.KERNEL_RESTARTED): _D.EXHAUSTED,
}

_A = ApprovalStatus
_AT = ApprovalTrigger
APPROVAL_TRANSITIONS: Final[Mapping[tuple[ApprovalStatus, ApprovalTrigger], ApprovalStatus]] = {
    (_A.PENDING, _AT.GRANTED): _A.GRANTED,
    (_A.PENDING, _AT.DENIED): _A.DENIED,
    (_A.PENDING, _AT.EXPIRED): _A.EXPIRED,
}

_Status = TypeVar("_Status", ExecutionStatus, StepStatus, DispatchStatus, ApprovalStatus)
_Trigger = TypeVar("_Trigger", ExecutionTrigger, StepTrigger, DispatchTrigger, ApprovalTrigger)


def advance(
    table: Mapping[tuple[_Status, _Trigger], _Status], status: _Status, trigger: _Trigger
) -> _Status:
    """The status `trigger` moves `status` to, by `table`.

    Raises:
        LocalProtocolError: the table has no such move.
    """
    try:
        return table[(status, trigger)]
    except KeyError:
        raise LocalProtocolError(
            f"{type(status).__name__}.{status.name} has no transition on {trigger.name}"
        ) from None

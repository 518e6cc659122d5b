"""The kernel's records: what it stores about executions, their dispatch,
steps, approvals, agents and events.

Records are frozen; the kernel rules return new versions and the stores persist
them. JSON values a peer sent are kept as canonical JSON text (`str`), so what
is replayed is exactly what was recorded. Times are Unix seconds (`float`) from
the caller's clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._state import ApprovalStatus, DispatchStatus, ExecutionStatus, StepStatus

__all__ = [
    "Agent",
    "Approval",
    "Dispatch",
    "Event",
    "Execution",
    "Idempotency",
    "Lease",
    "Step",
    "StepKind",
]


class StepKind(enum.Enum):
    """What kind of effect a step records (PROTOCOL.md §1.4)."""

    TOOL_CALL = "tool_call"
    LLM_CALL = "llm_call"
    LOCAL = "local"


class Idempotency(enum.Enum):
    """What may happen when a step's outcome is unknown (PROTOCOL.md §6.2)."""

    SAFE_TO_RETRY = "safe_to_retry"
    AT_MOST_ONCE = "at_most_once"


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """The delivery attempt an agent works under: `(dispatch_id, attempt)`."""

    dispatch_id: str
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Dispatch:
    """The execution's current delivery to its agent (PROTOCOL.md §6.3).

    Only the most recently created dispatch of an execution can be current, so
    the kernel keeps just that one on the execution; older dispatch ids are
    remembered only to tell "superseded" from "unknown".
    """

    id: str
    status: DispatchStatus
    attempt: int = 0
    max_attempts: int = 5
    next_attempt_at: float = 0.0
    locked_at: float | None = None

    def lease(self) -> Lease:
        return Lease(dispatch_id=self.id, attempt=self.attempt)


@dataclass(frozen=True, slots=True, kw_only=True)
class Execution:
    id: str
    agent_id: str
    status: ExecutionStatus
    created_at: float
    updated_at: float
    input: str = "null"
    output: str | None = None
    state: str | None = None
    failure_reason: str = ""
    session: str = ""
    parent_execution_id: str | None = None
    idempotency_key: str = ""
    last_event_seq: int = 0
    dispatch: Dispatch | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    step_id: str
    execution_id: str
    kind: StepKind
    target: str
    args_hash: str
    occurrence: int
    status: StepStatus
    idempotency: Idempotency
    args: str = "null"
    result: str | None = None
    error: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    approval_id: str | None = None
    rule_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Approval:
    id: str
    execution_id: str
    step_id: str
    status: ApprovalStatus
    created_at: float
    timeout_at: float
    approvers: tuple[str, ...] = ()
    message: str = ""
    rule_id: str = ""
    decided_by: str = ""
    decided_at: float | None = None
    rationale: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Agent:
    """A registered agent. `secret` is never sent back over the wire."""

    id: str
    webhook_url: str
    secret: str
    registered_at: float
    description: str | None = None
    input_schema: str | None = None
    output_schema: str | None = None
    policy: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One entry of an execution's append-only log; `seq` is gap-free from 1."""

    execution_id: str
    seq: int
    type: str
    payload: str
    occurred_at: float

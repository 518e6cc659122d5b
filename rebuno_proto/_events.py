"""The closed event taxonomy (PROTOCOL.md §7) and the builder that appends
events to an execution's log with gap-free sequence numbers.

Step results and LLM bodies never go into event payloads; they live on the step.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Final

from ._jsonout import JSONOut, RawJSON, dumps
from ._records import Approval, Dispatch, Event, Execution, Step

__all__ = ["EventLog", "EventType"]


class EventType(enum.Enum):
    EXECUTION_CREATED = "execution.created"
    EXECUTION_STARTED = "execution.started"
    EXECUTION_BLOCKED = "execution.blocked"
    EXECUTION_RESUMED = "execution.resumed"
    EXECUTION_COMPLETED = "execution.completed"
    EXECUTION_FAILED = "execution.failed"
    EXECUTION_CANCELLED = "execution.cancelled"
    STEP_PROPOSED = "step.proposed"
    STEP_ALLOWED = "step.allowed"
    STEP_EXECUTING = "step.executing"
    STEP_SUCCEEDED = "step.succeeded"
    STEP_FAILED = "step.failed"
    STEP_DENIED = "step.denied"
    STEP_CANCELLED = "step.cancelled"
    STEP_AWAITING_APPROVAL = "step.awaiting_approval"
    STEP_RATE_LIMITED = "step.rate_limited"
    APPROVAL_REQUESTED = "approval.requested"
    APPROVAL_GRANTED = "approval.granted"
    APPROVAL_DENIED = "approval.denied"
    APPROVAL_EXPIRED = "approval.expired"
    DISPATCH_QUEUED = "dispatch.queued"
    DISPATCH_ACKED = "dispatch.acked"
    DISPATCH_FAILED = "dispatch.failed"
    DISPATCH_DISCARDED = "dispatch.discarded"


_T: Final = EventType


class EventLog:
    """Appends events for one execution, numbering them after its last event.

    Build one per execution a rule touches; `close` returns the execution with
    its new `last_event_seq`, and `events` holds what to insert.
    """

    __slots__ = ("_seq", "events", "execution_id", "now")

    def __init__(self, execution: Execution, now: float) -> None:
        self.execution_id = execution.id
        self._seq = execution.last_event_seq
        self.now = now
        self.events: list[Event] = []

    def append(self, type_: EventType, payload: dict[str, JSONOut]) -> None:
        self._seq += 1
        self.events.append(
            Event(
                execution_id=self.execution_id,
                seq=self._seq,
                type=type_.value,
                payload=dumps(payload),
                occurred_at=self.now,
            )
        )

    def close(self, execution: Execution) -> Execution:
        if execution.last_event_seq == self._seq:
            return execution
        return dataclasses.replace(execution, last_event_seq=self._seq)

    # -- execution events --------------------------------------------------

    def execution(self, type_: EventType, execution: Execution, **extra: JSONOut) -> None:
        payload: dict[str, JSONOut] = {
            "execution_id": execution.id,
            "status": execution.status.value,
        }
        payload.update({k: v for k, v in extra.items() if v is not None and v != ""})
        self.append(type_, payload)

    def completed(self, execution: Execution) -> None:
        output = None if execution.output is None else RawJSON(execution.output)
        self.execution(_T.EXECUTION_COMPLETED, execution, output=output)

    # -- step events -------------------------------------------------------

    def step(
        self, type_: EventType, step: Step, *, rule_id: str = "", error: str | None = None
    ) -> None:
        payload: dict[str, JSONOut] = {
            "step_id": step.step_id,
            "step_type": step.kind.value,
            "target": step.target,
        }
        if rule_id:
            payload["rule_id"] = rule_id
        if error is not None:
            payload["error"] = RawJSON(error)
        self.append(type_, payload)

    # -- approval and dispatch events --------------------------------------

    def approval(self, type_: EventType, approval: Approval) -> None:
        payload: dict[str, JSONOut] = {
            "approval_id": approval.id,
            "step_id": approval.step_id,
            "execution_id": approval.execution_id,
            "status": approval.status.value,
        }
        if approval.decided_by:
            payload["decided_by"] = approval.decided_by
        if approval.rationale:
            payload["rationale"] = approval.rationale
        self.append(type_, payload)

    def dispatch(self, type_: EventType, dispatch: Dispatch, status: str) -> None:
        self.append(
            type_,
            {
                "dispatch_id": dispatch.id,
                "execution_id": self.execution_id,
                "status": status,
                "attempt": dispatch.attempt,
            },
        )

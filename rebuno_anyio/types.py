"""Typed views of the kernel's resources for SDK users (PROTOCOL.md §4.1).

Lenient on input: unknown fields are ignored and absent ones take defaults, so
a newer kernel does not break an older SDK.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["Agent", "Approval", "Event", "Execution", "ExecutionPage", "Step"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Execution(_Model):
    id: str
    agent_id: str = ""
    status: str = "pending"
    input: Any = None
    output: Any = None
    failure_reason: str = ""
    session: str = ""
    parent_execution_id: str | None = None
    idempotency_key: str = ""
    created_at: str = ""
    updated_at: str = ""

    @property
    def is_terminal(self) -> bool:
        return self.status in ("completed", "failed", "cancelled")


class ExecutionPage(_Model):
    executions: list[Execution] = []
    next_cursor: str = ""


class Step(_Model):
    step_id: str
    execution_id: str = ""
    kind: str = ""
    target: str = ""
    args_hash: str = ""
    occurrence: int = 0
    status: str = ""
    idempotency: str = ""
    args: Any = None
    result: Any = None
    error: Any = None
    started_at: str = ""
    completed_at: str = ""
    rule_id: str = ""
    approval_id: str = ""


class Event(_Model):
    execution_id: str = ""
    event_seq: int = 0
    type: str = ""
    payload: Any = None
    occurred_at: str = ""


class Approval(_Model):
    id: str
    step_id: str = ""
    execution_id: str = ""
    status: str = ""
    approvers: list[str] = []
    message: str = ""
    rule_id: str = ""
    timeout_at: str = ""
    decided_by: str = ""
    decided_at: str = ""
    rationale: str = ""
    created_at: str = ""


class Agent(_Model):
    id: str
    webhook_url: str = ""
    registered_at: str = ""
    description: str | None = None
    input_schema: Any = None
    output_schema: Any = None
    has_policy: bool = False

"""Outbound wire shapes (PROTOCOL.md §4.1): records as the JSON the published
SDK reads.

Never `null` where the SDK declares a `str`, `int` or `list` (§4.0): those are
sent as their typed empty value or left out. Secrets are never sent.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

from ._delivery import Delivery
from ._jsonout import JSONOut, RawJSON, dumps
from ._outcome import Refusal, StepDecision
from ._records import Agent, Approval, Event, Execution, Step

__all__ = [
    "encode_agent",
    "encode_approval",
    "encode_decision",
    "encode_error",
    "encode_event",
    "encode_execution",
    "encode_step",
    "encode_webhook",
    "rfc3339",
]

_EMPTY_LIST: Final[list[JSONOut]] = []


_LATEST: Final = "9999-12-31T23:59:59.999999Z"


def rfc3339(t: float) -> str:
    """Unix seconds as an RFC 3339 UTC timestamp with microseconds (times past
    year 9999, such as a practically endless timeout, read as its last instant)."""
    try:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    except (OverflowError, ValueError, OSError):
        return _LATEST if t > 0 else "0001-01-01T00:00:00.000000Z"


def _raw(text: str | None) -> RawJSON | None:
    return None if text is None else RawJSON(text)


def execution_fields(ex: Execution) -> dict[str, JSONOut]:
    return {
        "id": ex.id,
        "agent_id": ex.agent_id,
        "input": RawJSON(ex.input),
        "status": ex.status.value,
        "output": _raw(ex.output),
        "failure_reason": ex.failure_reason,
        "session": ex.session,
        "parent_execution_id": ex.parent_execution_id,
        "forked_from": None,
        "fork_seq": 0,
        "restoration": None,
        "idempotency_key": ex.idempotency_key,
        "spawned_by": None,
        "created_by": "",
        "on_behalf_of": "",
        "subject_groups": _EMPTY_LIST,
        "created_at": rfc3339(ex.created_at),
        "updated_at": rfc3339(ex.updated_at),
    }


def encode_execution(ex: Execution) -> bytes:
    return dumps(execution_fields(ex)).encode("utf-8")


def step_fields(step: Step) -> dict[str, JSONOut]:
    fields: dict[str, JSONOut] = {
        "step_id": step.step_id,
        "execution_id": step.execution_id,
        "kind": step.kind.value,
        "target": step.target,
        "args_hash": step.args_hash,
        "occurrence": step.occurrence,
        "status": step.status.value,
        "idempotency": step.idempotency.value,
        "args": RawJSON(step.args),
        "result": _raw(step.result),
        "error": _raw(step.error),
    }
    if step.started_at is not None:
        fields["started_at"] = rfc3339(step.started_at)
    if step.completed_at is not None:
        fields["completed_at"] = rfc3339(step.completed_at)
    if step.rule_id:
        fields["rule_id"] = step.rule_id
    if step.approval_id:
        fields["approval_id"] = step.approval_id
    return fields


def encode_step(step: Step) -> bytes:
    return dumps(step_fields(step)).encode("utf-8")


def encode_decision(decision: StepDecision) -> bytes:
    fields: dict[str, JSONOut] = {"decision": decision.decision.value}
    if decision.step_id:
        fields["step_id"] = decision.step_id
    if decision.result is not None:
        fields["result"] = RawJSON(decision.result)
    if decision.error is not None:
        fields["error"] = RawJSON(decision.error)
    if decision.approval_id:
        fields["approval_id"] = decision.approval_id
    if decision.reason:
        fields["reason"] = decision.reason
    if decision.rule_id:
        fields["rule_id"] = decision.rule_id
    fields["resources"] = _EMPTY_LIST
    return dumps(fields).encode("utf-8")


def event_fields(event: Event) -> dict[str, JSONOut]:
    return {
        "execution_id": event.execution_id,
        "event_seq": event.seq,
        "type": event.type,
        "payload": RawJSON(event.payload),
        "occurred_at": rfc3339(event.occurred_at),
    }


def encode_event(event: Event) -> bytes:
    return dumps(event_fields(event)).encode("utf-8")


def approval_fields(approval: Approval) -> dict[str, JSONOut]:
    fields: dict[str, JSONOut] = {
        "id": approval.id,
        "step_id": approval.step_id,
        "execution_id": approval.execution_id,
        "status": approval.status.value,
        "approvers": list(approval.approvers),
        "message": approval.message,
        "rule_id": approval.rule_id,
        "timeout_at": rfc3339(approval.timeout_at),
        "decided_by": approval.decided_by,
        "asserted_by": approval.decided_by,
        "rationale": approval.rationale,
        "created_at": rfc3339(approval.created_at),
    }
    if approval.decided_at is not None:
        fields["decided_at"] = rfc3339(approval.decided_at)
    return fields


def encode_approval(approval: Approval) -> bytes:
    return dumps(approval_fields(approval)).encode("utf-8")


def agent_fields(agent: Agent) -> dict[str, JSONOut]:
    return {
        "id": agent.id,
        "webhook_url": agent.webhook_url,
        "registered_at": rfc3339(agent.registered_at),
        "description": agent.description,
        "input_schema": _raw(agent.input_schema),
        "output_schema": _raw(agent.output_schema),
        "has_policy": agent.policy is not None,
    }


def encode_agent(agent: Agent) -> bytes:
    return dumps(agent_fields(agent)).encode("utf-8")


def encode_error(refusal: Refusal) -> bytes:
    """The error envelope `{"code", "message"}` (PROTOCOL.md §4.0)."""
    return dumps({"code": refusal.code.value, "message": refusal.message}).encode("utf-8")


def encode_webhook(delivery: Delivery, lease_timeout_s: float) -> bytes:
    """The webhook body: all four fields the published SDK reads (PROTOCOL.md §3)."""
    timeout: JSONOut = (
        int(lease_timeout_s) if lease_timeout_s == int(lease_timeout_s) else lease_timeout_s
    )
    return dumps(
        {
            "execution_id": delivery.execution_id,
            "dispatch_id": delivery.dispatch_id,
            "dispatch_attempt": delivery.attempt,
            "lease_timeout_seconds": timeout,
        }
    ).encode("utf-8")

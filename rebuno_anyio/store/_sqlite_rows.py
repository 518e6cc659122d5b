"""SQLite rows <-> kernel records: the columns, the upserts and the mappers."""

from __future__ import annotations

import json
from typing import Any, Final

from rebuno_proto import (
    Agent,
    Approval,
    ApprovalStatus,
    DispatchRecord,
    DispatchStatus,
    Execution,
    ExecutionStatus,
    Idempotency,
    Step,
    StepKind,
    StepStatus,
)

EXEC_STATUS: Final = {s.value: s for s in ExecutionStatus}
STEP_STATUS: Final = {s.value: s for s in StepStatus}
DISPATCH_STATUS: Final = {s.value: s for s in DispatchStatus}
APPROVAL_STATUS: Final = {s.value: s for s in ApprovalStatus}
KIND: Final = {k.value: k for k in StepKind}
IDEMPOTENCY: Final = {i.value: i for i in Idempotency}
SYNCHRONOUS: Final = ("FULL", "NORMAL", "EXTRA")


def upsert(table: str, columns: str) -> str:
    """An upsert of whole records: every column but the key (the first) is replaced."""
    names = [c.strip() for c in columns.split(",")]
    updates = ", ".join(f"{c}=excluded.{c}" for c in names[1:])
    return (
        f"INSERT INTO {table} ({columns}) VALUES ({', '.join('?' * len(names))}) "
        f"ON CONFLICT({names[0]}) DO UPDATE SET {updates}"
    )


EXEC_COLS: Final = (
    "id, agent_id, status, input, output, state, failure_reason, session, parent_execution_id, "
    "idempotency_key, created_at, updated_at, last_event_seq, dispatch_id, dispatch_status, "
    "dispatch_attempt, dispatch_max_attempts, dispatch_next_attempt_at, dispatch_locked_at"
)
EXEC_SELECT: Final = f"SELECT {EXEC_COLS} FROM executions"
EXEC_UPSERT: Final = upsert("executions", EXEC_COLS)
STEP_COLS: Final = (
    "step_id, execution_id, kind, target, args_hash, occurrence, status, idempotency, args, "
    "result, error, started_at, completed_at, approval_id, rule_id"
)
STEP_SELECT: Final = f"SELECT {STEP_COLS} FROM steps"
STEP_UPSERT: Final = upsert("steps", STEP_COLS)
APPROVAL_COLS: Final = (
    "id, execution_id, step_id, status, approvers, message, rule_id, decided_by, decided_at, "
    "rationale, created_at, timeout_at"
)
APPROVAL_SELECT: Final = f"SELECT {APPROVAL_COLS} FROM approvals"
AGENT_COLS: Final = (
    "id, webhook_url, secret, registered_at, description, input_schema, output_schema, policy"
)
ACTIVE: Final = "('pending', 'running', 'blocked')"


def execution_of(row: tuple[Any, ...]) -> Execution:
    dispatch = None
    if row[13] is not None:
        dispatch = DispatchRecord(
            id=row[13],
            status=DISPATCH_STATUS[row[14]],
            attempt=row[15],
            max_attempts=row[16],
            next_attempt_at=row[17],
            locked_at=row[18],
        )
    return Execution(
        id=row[0],
        agent_id=row[1],
        status=EXEC_STATUS[row[2]],
        input=row[3],
        output=row[4],
        state=row[5],
        failure_reason=row[6],
        session=row[7],
        parent_execution_id=row[8],
        idempotency_key=row[9],
        created_at=row[10],
        updated_at=row[11],
        last_event_seq=row[12],
        dispatch=dispatch,
    )


def execution_row(e: Execution) -> tuple[Any, ...]:
    d = e.dispatch
    return (
        e.id,
        e.agent_id,
        e.status.value,
        e.input,
        e.output,
        e.state,
        e.failure_reason,
        e.session,
        e.parent_execution_id,
        e.idempotency_key,
        e.created_at,
        e.updated_at,
        e.last_event_seq,
        None if d is None else d.id,
        None if d is None else d.status.value,
        None if d is None else d.attempt,
        None if d is None else d.max_attempts,
        None if d is None else d.next_attempt_at,
        None if d is None else d.locked_at,
    )


def step_of(row: tuple[Any, ...]) -> Step:
    return Step(
        step_id=row[0],
        execution_id=row[1],
        kind=KIND[row[2]],
        target=row[3],
        args_hash=row[4],
        occurrence=row[5],
        status=STEP_STATUS[row[6]],
        idempotency=IDEMPOTENCY[row[7]],
        args=row[8],
        result=row[9],
        error=row[10],
        started_at=row[11],
        completed_at=row[12],
        approval_id=row[13],
        rule_id=row[14],
    )


def step_row(s: Step) -> tuple[Any, ...]:
    return (
        s.step_id,
        s.execution_id,
        s.kind.value,
        s.target,
        s.args_hash,
        s.occurrence,
        s.status.value,
        s.idempotency.value,
        s.args,
        s.result,
        s.error,
        s.started_at,
        s.completed_at,
        s.approval_id,
        s.rule_id,
    )


def approval_of(row: tuple[Any, ...]) -> Approval:
    return Approval(
        id=row[0],
        execution_id=row[1],
        step_id=row[2],
        status=APPROVAL_STATUS[row[3]],
        approvers=tuple(json.loads(row[4])),
        message=row[5],
        rule_id=row[6],
        decided_by=row[7],
        decided_at=row[8],
        rationale=row[9],
        created_at=row[10],
        timeout_at=row[11],
    )


def approval_row(a: Approval) -> tuple[Any, ...]:
    return (
        a.id,
        a.execution_id,
        a.step_id,
        a.status.value,
        json.dumps(list(a.approvers)),
        a.message,
        a.rule_id,
        a.decided_by,
        a.decided_at,
        a.rationale,
        a.created_at,
        a.timeout_at,
    )


def agent_of(row: tuple[Any, ...]) -> Agent:
    return Agent(
        id=row[0],
        webhook_url=row[1],
        secret=row[2],
        registered_at=row[3],
        description=row[4],
        input_schema=row[5],
        output_schema=row[6],
        policy=row[7],
    )

"""`rebuno_proto.KernelCommands` over `MemoryRecords` for what the service
tests do not reach (unknown ids), and the simulator's checker on its own."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rebuno_proto import (
    ALLOW,
    Agent,
    ApprovalChoice,
    Change,
    CreateExecution,
    Delivery,
    DeliveryResult,
    DispatchSettings,
    ErrorCode,
    Event,
    Execution,
    ExecutionCompletion,
    ExecutionStatus,
    Idempotency,
    KernelCommands,
    Lease,
    MemoryRecords,
    Outcome,
    Refusal,
    Step,
    StepKind,
    StepStatus,
    StepSubmission,
    allow_all,
)
from rebuno_proto.sim._checks import Checker

NOW = 1_800_000_000.0
MISSING = "00000000-0000-7000-8000-00000000dead"
LEASE = Lease(dispatch_id=MISSING, attempt=1)
SUBMISSION = StepSubmission(
    kind=StepKind.TOOL_CALL, target="t", args="{}", idempotency=Idempotency.SAFE_TO_RETRY
)


@pytest.fixture
def commands() -> KernelCommands:
    ids = iter(range(1, 1000))
    return KernelCommands(
        settings=DispatchSettings(), new_id=lambda: f"00000000-0000-7000-8000-{next(ids):012x}"
    )


def _not_found(outcome: Outcome[Any]) -> str:
    assert outcome.change.is_empty
    assert isinstance(outcome.reply, Refusal)
    assert outcome.reply.code is ErrorCode.NOT_FOUND
    return outcome.reply.message


def test_unknown_ids_are_not_found_and_change_nothing(commands: KernelCommands) -> None:
    tx = MemoryRecords().begin()
    assert _not_found(commands.cancel(tx, MISSING, NOW)) == "execution not found"
    assert _not_found(commands.submit(tx, MISSING, "a", LEASE, SUBMISSION, NOW))
    assert _not_found(commands.finish_step(tx, MISSING, "s", "a", LEASE, NOW, result="1"))
    assert _not_found(commands.heartbeat(tx, MISSING, "a", LEASE, NOW))
    ending = ExecutionCompletion(output="1", state=None)
    assert _not_found(commands.end(tx, MISSING, "a", LEASE, ending, NOW))
    decided = commands.decide_approval(
        tx, MISSING, ApprovalChoice.GRANT, decided_by="", rationale="", now=NOW
    )
    assert _not_found(decided) == "approval not found"
    # Background work about something gone is a quiet no-op.
    assert commands.claim(tx, MISSING, NOW).reply is None
    delivery = Delivery(execution_id=MISSING, agent_id="a", dispatch_id=MISSING, attempt=1)
    assert (
        commands.delivered(tx, delivery, result=DeliveryResult.ACKED, jitter=0.0, now=NOW).reply
        is None
    )
    assert commands.reclaim(tx, MISSING, NOW).reply is False
    assert commands.retire_after_restart(tx, NOW, execution_id=MISSING).reply is False
    assert commands.expire(tx, MISSING, NOW).reply is False


def test_the_default_policy_allows_everything() -> None:
    execution = Execution(
        id=MISSING, agent_id="a", status=ExecutionStatus.RUNNING, created_at=NOW, updated_at=NOW
    )
    tx = MemoryRecords().begin()
    assert allow_all(tx, execution, None, SUBMISSION, NOW) == (ALLOW, ())


def test_a_create_then_a_submit_flow_through_memory_records(commands: KernelCommands) -> None:
    records = MemoryRecords()
    tx = records.begin()
    tx.put_agent(Agent(id="a", webhook_url="http://x/", secret="s", registered_at=NOW))
    created = commands.create(
        tx, CreateExecution(agent_id="a", input="{}", session="", idempotency_key=""), NOW
    )
    tx.apply(created.change)
    assert not isinstance(created.reply, Refusal)
    execution_id = created.reply.execution.id
    claimed = commands.claim(tx, execution_id, NOW)
    tx.apply(claimed.change)
    assert isinstance(claimed.reply, Delivery)
    decided = commands.submit(tx, execution_id, "a", claimed.reply.lease(), SUBMISSION, NOW)
    tx.apply(decided.change)
    assert records.counters  # the occurrence counter is kept in the tables...
    records.forget_counters()
    assert not records.counters  # ...and is what a crash loses


def _step(status: StepStatus, idempotency: Idempotency = Idempotency.SAFE_TO_RETRY) -> Step:
    return Step(
        step_id="s1",
        execution_id=MISSING,
        kind=StepKind.TOOL_CALL,
        target="t",
        args_hash="h",
        occurrence=0,
        status=status,
        idempotency=idempotency,
    )


def _checker_with(step: Step, execution_status: ExecutionStatus) -> Checker:
    records = MemoryRecords()
    records.steps[step.step_id] = step
    records.executions[MISSING] = Execution(
        id=MISSING, agent_id="a", status=execution_status, created_at=NOW, updated_at=NOW
    )
    return Checker(records)


@pytest.mark.parametrize(
    ("status", "execution_status", "broken"),
    [
        (StepStatus.EXECUTING, ExecutionStatus.RUNNING, False),
        (StepStatus.SUCCEEDED, ExecutionStatus.RUNNING, True),
        (StepStatus.CANCELLED, ExecutionStatus.CANCELLED, False),  # cancel raced the proceed
        (StepStatus.CANCELLED, ExecutionStatus.RUNNING, True),
        (StepStatus.AWAITING_APPROVAL, ExecutionStatus.BLOCKED, True),
    ],
)
def test_checker_judges_a_body_start(
    status: StepStatus, execution_status: ExecutionStatus, broken: bool
) -> None:
    checker = _checker_with(_step(status), execution_status)
    checker.granted(MISSING, LEASE)
    checker.body_started(MISSING, "s1", LEASE, Idempotency.SAFE_TO_RETRY)
    assert bool(checker.violations) is broken
    assert all(v.invariant == "no_rerun_after_outcome" for v in checker.violations)


def test_checker_allows_one_run_per_lease_and_one_for_at_most_once() -> None:
    safe, strict = Idempotency.SAFE_TO_RETRY, Idempotency.AT_MOST_ONCE
    second = dataclasses.replace(LEASE, attempt=2)
    checker = _checker_with(_step(StepStatus.EXECUTING), ExecutionStatus.RUNNING)
    checker.body_started(MISSING, "s1", LEASE, safe)
    checker.body_started(MISSING, "s1", second, safe)  # an orphan re-run: fine
    assert checker.violations == []
    assert checker.orphan_reruns == 1
    checker.body_started(MISSING, "s1", second, safe)  # twice under one lease
    assert [v.invariant for v in checker.violations] == ["orphan_reruns_bounded"]
    # A run declared at_most_once counts, even if the step's record says safe.
    declared = _checker_with(_step(StepStatus.EXECUTING), ExecutionStatus.RUNNING)
    declared.body_started(MISSING, "s1", LEASE, strict)
    declared.body_started(MISSING, "s1", second, safe)
    assert [v.invariant for v in declared.violations] == ["at_most_once"]
    recorded = _checker_with(_step(StepStatus.EXECUTING, strict), ExecutionStatus.RUNNING)
    recorded.body_started(MISSING, "s1", LEASE, safe)
    recorded.body_started(MISSING, "s1", second, safe)
    assert [v.invariant for v in recorded.violations] == ["at_most_once"]
    unknown = Checker(MemoryRecords())
    unknown.body_started(MISSING, "nope", LEASE, safe)
    assert [v.invariant for v in unknown.violations] == ["no_rerun_after_outcome"]


def test_checker_sees_an_event_gap() -> None:
    checker = Checker(MemoryRecords())
    event = Event(execution_id=MISSING, seq=2, type="step.proposed", payload="{}", occurred_at=NOW)
    checker.command("submit", Outcome(reply=None, change=Change(events=(event,))))
    (violation,) = checker.violations
    assert violation.invariant == "event_seq_gapless"
    assert "has seq 2, expected 1" in str(violation)


def test_memory_records_read_indeterminate_failures_only() -> None:
    records = MemoryRecords()
    records.steps["s1"] = dataclasses.replace(_step(StepStatus.FAILED), error="not json")
    records.step_ids[MISSING] = {"s1": None}
    tx = records.begin()
    assert not tx.has_indeterminate(MISSING, StepKind.TOOL_CALL, "t", "h")
    records.steps["s1"] = dataclasses.replace(
        _step(StepStatus.FAILED), error='{"reason": "indeterminate"}'
    )
    assert tx.has_indeterminate(MISSING, StepKind.TOOL_CALL, "t", "h")

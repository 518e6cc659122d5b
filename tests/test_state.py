"""The transition tables (`_state.py`, `_agent.py`): every (state, trigger)
pair either follows its table or raises `LocalProtocolError`, nothing else."""

import enum
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from rebuno_proto import (
    APPROVAL_TRANSITIONS,
    DISPATCH_TRANSITIONS,
    EXECUTION_TRANSITIONS,
    STEP_TRANSITIONS,
    ApprovalStatus,
    ApprovalTrigger,
    CompleteExecution,
    Dispatch,
    DispatchReceived,
    DispatchStatus,
    DispatchTrigger,
    ExecutionFetched,
    ExecutionReported,
    ExecutionStatus,
    ExecutionTrigger,
    HandlerFinished,
    HeartbeatAcked,
    HeartbeatFailed,
    InputRejected,
    LeaseLost,
    LocalProtocolError,
    Phase,
    ProtocolError,
    StepStatus,
    StepTrigger,
    Superseded,
    Tick,
    WebhookPayload,
    advance,
)
from rebuno_proto._agent import _NEXT

TABLES: list[tuple[Mapping[Any, Any], type[enum.Enum], type[enum.Enum]]] = [
    (EXECUTION_TRANSITIONS, ExecutionStatus, ExecutionTrigger),
    (STEP_TRANSITIONS, StepStatus, StepTrigger),
    (DISPATCH_TRANSITIONS, DispatchStatus, DispatchTrigger),
    (APPROVAL_TRANSITIONS, ApprovalStatus, ApprovalTrigger),
]

PAIRS = [
    pytest.param(table, status, trigger, id=f"{status.name}-{trigger.name}")
    for table, statuses, triggers in TABLES
    for status, trigger in itertools.product(statuses, triggers)
]


@pytest.mark.parametrize(("table", "status", "trigger"), PAIRS)
def test_every_pair_follows_the_table_or_raises(
    table: Mapping[Any, Any], status: enum.Enum, trigger: enum.Enum
) -> None:
    if (status, trigger) in table:
        assert advance(table, status, trigger) is table[(status, trigger)]
    else:
        with pytest.raises(LocalProtocolError) as info:
            advance(table, status, trigger)
        assert str(info.value) == (
            f"{type(status).__name__}.{status.name} has no transition on {trigger.name}"
        )


def test_pair_count() -> None:
    """Every enum combination is visited above."""
    assert (
        len(PAIRS) == sum(len(s) * len(t) for _, s, t in TABLES) == 6 * 7 + 8 * 11 + 4 * 9 + 4 * 3
    )


@pytest.mark.parametrize(("table", "statuses", "triggers"), TABLES)
def test_tables_use_only_their_own_enums(
    table: Mapping[Any, Any], statuses: type[enum.Enum], triggers: type[enum.Enum]
) -> None:
    for (status, trigger), target in table.items():
        assert isinstance(status, statuses)
        assert isinstance(trigger, triggers)
        assert isinstance(target, statuses)


def test_terminal_statuses() -> None:
    assert {s for s in ExecutionStatus if s.is_terminal} == {
        ExecutionStatus.COMPLETED,
        ExecutionStatus.FAILED,
        ExecutionStatus.CANCELLED,
    }
    assert {s for s in StepStatus if s.is_terminal} == {
        StepStatus.SUCCEEDED,
        StepStatus.FAILED,
        StepStatus.DENIED,
        StepStatus.CANCELLED,
    }


@pytest.mark.parametrize(
    ("table", "statuses"),
    [(EXECUTION_TRANSITIONS, ExecutionStatus), (STEP_TRANSITIONS, StepStatus)],
)
def test_terminal_stays_terminal(table: Mapping[Any, Any], statuses: type[enum.Enum]) -> None:
    for status, _ in table:
        assert not status.is_terminal, status


def test_approval_decided_only_once() -> None:
    assert {status for status, _ in APPROVAL_TRANSITIONS} == {ApprovalStatus.PENDING}


def test_dispatch_exhausted_only_releases_or_retires() -> None:
    assert [(s, t) for s, t in DISPATCH_TRANSITIONS if s is DispatchStatus.EXHAUSTED] == [
        (DispatchStatus.EXHAUSTED, DispatchTrigger.RELEASED),
        (DispatchStatus.EXHAUSTED, DispatchTrigger.KERNEL_RESTARTED),
    ]
    for trigger in (DispatchTrigger.RELEASED, DispatchTrigger.KERNEL_RESTARTED):
        assert DISPATCH_TRANSITIONS[(DispatchStatus.EXHAUSTED, trigger)] is DispatchStatus.EXHAUSTED


def test_every_status_is_reachable() -> None:
    """Nothing in an enum is dead: each status is a start or a target."""
    for table, statuses, _ in TABLES:
        targets = set(table.values())
        sources = {s for s, _ in table}
        for status in statuses:
            assert status in targets or status in sources, status


# -- the agent's Dispatch machine --------------------------------------------------------------

PAYLOAD = WebhookPayload(
    execution_id="0192f1a0-0000-7000-8000-000000000000",
    dispatch_id="0192f1a0-1111-7000-8000-000000000000",
    dispatch_attempt=1,
    lease_timeout_seconds=90.0,
)

# One instance of each event type, chosen so `_act` does not redirect the phase.
EVENTS: dict[type[Any], Any] = {
    DispatchReceived: DispatchReceived(payload=PAYLOAD),
    ExecutionFetched: ExecutionFetched(status="running"),
    InputRejected: InputRejected(detail="missing required input fields: a"),
    HeartbeatAcked: HeartbeatAcked(),
    HeartbeatFailed: HeartbeatFailed(),
    LeaseLost: LeaseLost(),
    Superseded: Superseded(),
    HandlerFinished: HandlerFinished(conclusion=CompleteExecution(output="1")),
    ExecutionReported: ExecutionReported(),
    Tick: Tick(),
}

# How to reach each phase from IDLE.
PATHS: dict[Phase, list[Any]] = {
    Phase.IDLE: [],
    Phase.FETCHING: [EVENTS[DispatchReceived]],
    Phase.RUNNING: [EVENTS[DispatchReceived], EVENTS[ExecutionFetched]],
    Phase.FINISHING: [EVENTS[DispatchReceived], EVENTS[ExecutionFetched], EVENTS[HandlerFinished]],
    Phase.DONE: [
        EVENTS[DispatchReceived],
        EVENTS[ExecutionFetched],
        EVENTS[HandlerFinished],
        EVENTS[ExecutionReported],
    ],
    Phase.SUPERSEDED: [EVENTS[DispatchReceived], EVENTS[LeaseLost]],
    Phase.ERROR: [Tick()],
}


def machine_in(phase: Phase) -> Dispatch:
    machine = Dispatch()
    for i, event in enumerate(PATHS[phase]):
        if phase is Phase.ERROR:
            with pytest.raises(LocalProtocolError):
                machine.handle(event, now=float(i))
        else:
            machine.handle(event, now=float(i))
    assert machine.state is phase
    return machine


def test_event_instances_cover_every_event_type() -> None:
    assert {event_type for _, event_type in _NEXT} <= set(EVENTS)
    assert len(EVENTS) == 10


@pytest.mark.parametrize(
    ("phase", "event_type"),
    [pytest.param(p, e, id=f"{p.name}-{e.__name__}") for p in Phase for e in EVENTS],
)
def test_dispatch_every_pair_follows_next_or_errors(phase: Phase, event_type: type[Any]) -> None:
    machine = machine_in(phase)
    event = EVENTS[event_type]
    if (phase, event_type) in _NEXT:
        actions = machine.handle(event, now=100.0)
        assert machine.state is _NEXT[(phase, event_type)]
        assert isinstance(actions, list)
    else:
        with pytest.raises(LocalProtocolError) as info:
            machine.handle(event, now=100.0)
        assert isinstance(info.value, ProtocolError)
        assert str(info.value) == f"Dispatch in {phase.name} cannot handle {event_type.__name__}"
        assert machine.state is Phase.ERROR
        # ERROR refuses everything afterwards.
        for other in EVENTS.values():
            with pytest.raises(LocalProtocolError):
                machine.handle(other, now=101.0)
            assert machine.state is Phase.ERROR
        assert machine.next_deadline() is None


def test_error_and_idle_rows() -> None:
    assert not [key for key in _NEXT if key[0] is Phase.ERROR]
    assert [key for key in _NEXT if key[0] is Phase.IDLE] == [(Phase.IDLE, DispatchReceived)]


# The two documented redirections of `_act` (comments in `_NEXT`).
REDIRECTS: list[tuple[Phase, Callable[[], Any], Phase]] = [
    (Phase.FETCHING, lambda: ExecutionFetched(status="completed"), Phase.DONE),
    (Phase.FETCHING, lambda: ExecutionFetched(status="failed"), Phase.DONE),
    (Phase.FETCHING, lambda: ExecutionFetched(status="cancelled"), Phase.DONE),
    (Phase.FETCHING, lambda: ExecutionFetched(status="blocked"), Phase.RUNNING),
    (Phase.RUNNING, lambda: HandlerFinished(conclusion=None), Phase.DONE),
]


@pytest.mark.parametrize(("phase", "make", "expected"), REDIRECTS)
def test_dispatch_redirects(phase: Phase, make: Callable[[], Any], expected: Phase) -> None:
    machine = machine_in(phase)
    machine.handle(make(), now=5.0)
    assert machine.state is expected


def _reachable(start: Phase) -> set[Phase]:
    seen = {start}
    frontier = [start]
    while frontier:
        here = frontier.pop()
        for (src, _), dst in _NEXT.items():
            if src is here and dst not in seen:
                seen.add(dst)
                frontier.append(dst)
    return seen


def test_final_phases_stay_final() -> None:
    assert _reachable(Phase.DONE) == {Phase.DONE}
    assert _reachable(Phase.SUPERSEDED) == {Phase.SUPERSEDED}
    assert _reachable(Phase.IDLE) == set(Phase) - {Phase.ERROR}

"""The agent's rules (`_agent.py`): which handler a webhook starts, what each
decision means, how a handler's outcome ends the execution (PROTOCOL.md §5.3),
and the Dispatch machine's heartbeat schedule."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rebuno_proto import (
    MAX_HEARTBEAT_INTERVAL_S,
    CancelHandler,
    CompleteExecution,
    Dispatch,
    DispatchReceived,
    ExecutionFetched,
    ExecutionReported,
    FailExecution,
    FetchExecution,
    HandlerFinished,
    HandlerOutcome,
    HeartbeatAcked,
    HeartbeatFailed,
    InputRejected,
    Lease,
    LeaseLost,
    LocalProtocolError,
    Meaning,
    Phase,
    SendHeartbeat,
    StartHandler,
    Superseded,
    Tick,
    WebhookPayload,
    Webhooks,
    conclude,
    failure_reason,
    heartbeat_interval,
    interpret,
)

EXEC_A = "0192f1a0-0000-7000-8000-00000000000a"
EXEC_B = "0192f1a0-0000-7000-8000-00000000000b"
D1 = "0192f1a0-1111-7000-8000-000000000001"
D2 = "0192f1a0-1111-7000-8000-000000000002"


def webhook(
    execution_id: str = EXEC_A, dispatch_id: str = D1, attempt: int = 1, lease: float = 120.0
) -> WebhookPayload:
    return WebhookPayload(
        execution_id=execution_id,
        dispatch_id=dispatch_id,
        dispatch_attempt=attempt,
        lease_timeout_seconds=lease,
    )


# -- Webhooks: start / supersede / ignore ----------------------------------------------------


def test_first_webhook_starts() -> None:
    hooks = Webhooks()
    assert hooks.received(webhook()) == "start"
    assert hooks.running(EXEC_A) == Lease(dispatch_id=D1, attempt=1)
    assert len(hooks) == 1


@pytest.mark.parametrize("attempt", [1, 0])
def test_same_dispatch_not_newer_is_ignored(attempt: int) -> None:
    hooks = Webhooks()
    hooks.received(webhook(attempt=1))
    assert hooks.received(webhook(attempt=attempt)) == "ignore"
    assert hooks.running(EXEC_A) == Lease(dispatch_id=D1, attempt=1)


def test_stale_attempt_after_newer_is_ignored() -> None:
    hooks = Webhooks()
    hooks.received(webhook(attempt=3))
    assert hooks.received(webhook(attempt=2)) == "ignore"
    assert hooks.running(EXEC_A) == Lease(dispatch_id=D1, attempt=3)


def test_newer_attempt_supersedes() -> None:
    hooks = Webhooks()
    hooks.received(webhook(attempt=1))
    assert hooks.received(webhook(attempt=2)) == "supersede"
    assert hooks.running(EXEC_A) == Lease(dispatch_id=D1, attempt=2)


@pytest.mark.parametrize("attempt", [1, 2, 5])
def test_other_dispatch_supersedes_whatever_its_attempt(attempt: int) -> None:
    hooks = Webhooks()
    hooks.received(webhook(attempt=3))
    assert hooks.received(webhook(dispatch_id=D2, attempt=attempt)) == "supersede"
    assert hooks.running(EXEC_A) == Lease(dispatch_id=D2, attempt=attempt)


def test_executions_are_independent() -> None:
    hooks = Webhooks()
    assert hooks.received(webhook(EXEC_A)) == "start"
    assert hooks.received(webhook(EXEC_B)) == "start"
    assert len(hooks) == 2


def test_finished_forgets_only_the_current_lease() -> None:
    hooks = Webhooks()
    hooks.received(webhook(attempt=1))
    hooks.received(webhook(attempt=2))
    hooks.finished(EXEC_A, Lease(dispatch_id=D1, attempt=1))  # the superseded one ends
    assert hooks.running(EXEC_A) == Lease(dispatch_id=D1, attempt=2)
    hooks.finished(EXEC_A, Lease(dispatch_id=D1, attempt=2))
    assert hooks.running(EXEC_A) is None
    assert len(hooks) == 0
    hooks.finished(EXEC_B, Lease(dispatch_id=D1, attempt=1))  # unknown: no error
    assert hooks.received(webhook(attempt=1)) == "start"  # a fresh start after it ended


@given(st.lists(st.tuples(st.sampled_from([D1, D2]), st.integers(1, 4)), min_size=1, max_size=12))
def test_webhooks_model(deliveries: list[tuple[str, int]]) -> None:
    hooks = Webhooks()
    running: Lease | None = None
    for dispatch_id, attempt in deliveries:
        verdict = hooks.received(webhook(dispatch_id=dispatch_id, attempt=attempt))
        if running is None:
            expected = "start"
        elif running.dispatch_id == dispatch_id and attempt <= running.attempt:
            expected = "ignore"
        else:
            expected = "supersede"
        assert verdict == expected
        if verdict != "ignore":
            running = Lease(dispatch_id=dispatch_id, attempt=attempt)
        assert hooks.running(EXEC_A) == running


# -- interpret --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("decision", "has_error", "meaning"),
    [
        ("proceed", False, Meaning.RUN_BODY),
        ("replay", False, Meaning.RETURN_RESULT),
        ("replay", True, Meaning.RAISE_RECORDED_ERROR),
        ("denied", False, Meaning.RAISE_POLICY_ERROR),
        ("rate_limited", False, Meaning.RAISE_RATE_LIMITED),
        ("blocked", False, Meaning.RAISE_BLOCKED),
        ("execution_blocked", False, Meaning.RAISE_BLOCKED),
        ("execution_terminal", False, Meaning.RAISE_TERMINATED),
        ("recorded", False, Meaning.RAISE_UNEXPECTED),
        ("", False, Meaning.RAISE_UNEXPECTED),
        ("PROCEED", False, Meaning.RAISE_UNEXPECTED),
        ("lease_superseded", False, Meaning.RAISE_UNEXPECTED),
    ],
)
def test_interpret(decision: str, has_error: bool, meaning: Meaning) -> None:
    assert interpret(decision, has_error=has_error) is meaning


@pytest.mark.parametrize(
    "decision",
    ["proceed", "denied", "rate_limited", "blocked", "execution_blocked", "execution_terminal"],
)
def test_interpret_ignores_error_flag_outside_replay(decision: str) -> None:
    assert interpret(decision, has_error=True) is interpret(decision, has_error=False)


# -- failure_reason and conclude (§5.3) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "detail", "error_class", "reason"),
    [
        (HandlerOutcome.POLICY_ERROR, "policy_denied", "", "policy_denied"),
        (HandlerOutcome.POLICY_ERROR, "approval_timeout", "", "approval_timeout"),
        (HandlerOutcome.POLICY_ERROR, "no_2", "", "no_2"),
        (HandlerOutcome.POLICY_ERROR, "Not on weekends", "", "policy_denied: Not on weekends"),
        (HandlerOutcome.POLICY_ERROR, "budget-exceeded", "", "policy_denied: budget-exceeded"),
        (HandlerOutcome.POLICY_ERROR, "", "", "policy_denied: "),
        (HandlerOutcome.RATE_LIMITED, "rate_limit_exceeded", "", "rate_limit_exceeded"),
        (HandlerOutcome.RATE_LIMITED, "rate_limiter_unavailable", "", "rate_limiter_unavailable"),
        (HandlerOutcome.RATE_LIMITED, "", "", "rate_limit_exceeded"),
        (HandlerOutcome.TOOL_ERROR, "search: timed out", "", "tool_error: search: timed out"),
        (
            HandlerOutcome.OTHER_ERROR,
            "division by zero",
            "ZeroDivisionError",
            "agent_error: ZeroDivisionError: division by zero",
        ),
        (HandlerOutcome.OTHER_ERROR, "", "KeyError", "agent_error: KeyError: "),
    ],
)
def test_failure_reason(
    outcome: HandlerOutcome, detail: str, error_class: str, reason: str
) -> None:
    assert failure_reason(outcome, detail=detail, error_class=error_class) == reason
    assert conclude(outcome, detail=detail, error_class=error_class) == FailExecution(reason=reason)


@pytest.mark.parametrize(
    "outcome",
    [
        HandlerOutcome.RETURNED,
        HandlerOutcome.BLOCKED,
        HandlerOutcome.TERMINATED,
        HandlerOutcome.LEASE_SUPERSEDED,
    ],
)
def test_failure_reason_refuses_outcomes_that_do_not_fail(outcome: HandlerOutcome) -> None:
    with pytest.raises(LocalProtocolError, match=f"{outcome.name} does not fail the execution"):
        failure_reason(outcome, detail="x")


def test_conclude_returned() -> None:
    assert conclude(HandlerOutcome.RETURNED, output='{"a":1}') == CompleteExecution(
        output='{"a":1}'
    )
    assert conclude(HandlerOutcome.RETURNED, output='"o"', state='{"s":1}') == CompleteExecution(
        output='"o"', state='{"s":1}'
    )
    assert conclude(HandlerOutcome.RETURNED) == CompleteExecution(output="null", state=None)


@pytest.mark.parametrize(
    "outcome", [HandlerOutcome.BLOCKED, HandlerOutcome.TERMINATED, HandlerOutcome.LEASE_SUPERSEDED]
)
def test_conclude_unwinds(outcome: HandlerOutcome) -> None:
    assert conclude(outcome) is None


@pytest.mark.parametrize("remembered", [HandlerOutcome.BLOCKED, HandlerOutcome.TERMINATED])
@pytest.mark.parametrize("outcome", list(HandlerOutcome))
def test_remembered_suspension_wins(remembered: HandlerOutcome, outcome: HandlerOutcome) -> None:
    """A Blocked/Terminated the handler swallowed still unwinds the dispatch."""
    assert conclude(outcome, remembered=remembered, detail="x", error_class="E") is None


@pytest.mark.parametrize(
    "remembered",
    [None, HandlerOutcome.RETURNED, HandlerOutcome.TOOL_ERROR, HandlerOutcome.LEASE_SUPERSEDED],
)
def test_other_remembered_values_do_not_unwind(remembered: HandlerOutcome | None) -> None:
    assert conclude(
        HandlerOutcome.TOOL_ERROR, remembered=remembered, detail="t: m"
    ) == FailExecution(reason="tool_error: t: m")


# -- heartbeat interval ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lease", "interval"),
    [(120.0, 30.0), (90.0, 30.0), (60.0, 20.0), (3.0, 1.0), (0.3, 0.1), (1e9, 30.0)],
)
def test_heartbeat_interval(lease: float, interval: float) -> None:
    assert heartbeat_interval(lease) == pytest.approx(interval)
    assert MAX_HEARTBEAT_INTERVAL_S == 30.0


@given(st.floats(min_value=1e-3, max_value=1e7))
def test_heartbeat_interval_property(lease: float) -> None:
    interval = heartbeat_interval(lease)
    assert interval == min(lease / 3, 30.0)
    assert 0 < interval <= 30.0
    # Three beats fit in one lease, so one lost beat never lets it lapse.
    assert 3 * interval <= lease * (1 + 1e-12)


# -- the Dispatch machine ------------------------------------------------------------------------


def phase(machine: Dispatch) -> Phase:
    """The machine's phase, read fresh (so type checkers do not keep a narrowed value)."""
    return machine.state


def started(lease: float = 90.0, *, at: float = 0.0) -> Dispatch:
    machine = Dispatch()
    assert machine.next_deadline() is None
    assert machine.handle(DispatchReceived(payload=webhook(lease=lease)), now=at) == [
        FetchExecution()
    ]
    assert machine.lease == Lease(dispatch_id=D1, attempt=1)
    assert machine.execution_id == EXEC_A
    assert machine.next_deadline() is None
    assert machine.handle(ExecutionFetched(status="running"), now=at) == [StartHandler()]
    return machine


def test_heartbeat_schedule_ticks_at_next_deadline() -> None:
    machine = started(lease=90.0, at=100.0)
    assert machine.state is Phase.RUNNING
    assert machine.next_deadline() == 130.0
    assert machine.handle(Tick(), now=129.9) == []  # early wake-up: nothing
    assert machine.next_deadline() == 130.0
    beats = []
    now = 100.0
    for _ in range(4):
        deadline = machine.next_deadline()
        assert deadline is not None
        now = deadline
        actions = machine.handle(Tick(), now=now)
        assert actions == [SendHeartbeat()]
        beats.append(now)
        assert machine.handle(HeartbeatAcked(), now=now) == []
    assert beats == [130.0, 160.0, 190.0, 220.0]


def test_late_tick_reschedules_from_now() -> None:
    machine = started(lease=60.0, at=0.0)
    assert machine.next_deadline() == 20.0
    assert machine.handle(Tick(), now=45.0) == [SendHeartbeat()]
    assert machine.next_deadline() == 65.0


def test_heartbeat_failure_keeps_going() -> None:
    machine = started()
    machine.handle(Tick(), now=30.0)
    assert machine.handle(HeartbeatFailed(), now=30.5) == []
    assert machine.state is Phase.RUNNING
    assert machine.handle(Tick(), now=60.0) == [SendHeartbeat()]


def test_handler_finishing_reports_and_keeps_beating() -> None:
    machine = started()
    done = CompleteExecution(output='"x"')
    assert machine.handle(HandlerFinished(conclusion=done), now=10.0) == [done]
    assert machine.state is Phase.FINISHING
    assert machine.next_deadline() == 30.0
    assert machine.handle(Tick(), now=30.0) == [SendHeartbeat()]
    assert machine.handle(ExecutionReported(), now=31.0) == []
    assert phase(machine) is Phase.DONE
    assert machine.next_deadline() is None


def test_failing_handler_reports_fail() -> None:
    machine = started()
    fail = FailExecution(reason="tool_error: t: m")
    assert machine.handle(HandlerFinished(conclusion=fail), now=1.0) == [fail]


def test_unwinding_handler_is_done_at_once() -> None:
    machine = started()
    assert machine.handle(HandlerFinished(conclusion=None), now=1.0) == []
    assert machine.state is Phase.DONE
    assert machine.next_deadline() is None
    assert machine.handle(Tick(), now=100.0) == []


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled"])
def test_terminal_execution_is_skipped(status: str) -> None:
    machine = Dispatch()
    machine.handle(DispatchReceived(payload=webhook()), now=0.0)
    assert machine.handle(ExecutionFetched(status=status), now=0.0) == []
    assert machine.state is Phase.DONE
    assert machine.next_deadline() is None


def test_input_rejected_fails_execution() -> None:
    machine = Dispatch()
    machine.handle(DispatchReceived(payload=webhook()), now=0.0)
    actions = machine.handle(InputRejected(detail="missing required input fields: a, b"), now=0.0)
    assert actions == [FailExecution(reason="input_invalid: missing required input fields: a, b")]
    assert machine.state is Phase.FINISHING


@pytest.mark.parametrize("event", [LeaseLost(), Superseded()])
@pytest.mark.parametrize("phase_events", ["fetching", "running", "finishing"])
def test_lost_lease_cancels_and_stops_beating(event: object, phase_events: str) -> None:
    machine = Dispatch()
    machine.handle(DispatchReceived(payload=webhook()), now=0.0)
    if phase_events != "fetching":
        machine.handle(ExecutionFetched(status="running"), now=0.0)
    if phase_events == "finishing":
        machine.handle(HandlerFinished(conclusion=CompleteExecution(output="1")), now=1.0)
    assert machine.handle(event, now=2.0) == [CancelHandler()]  # type: ignore[arg-type]
    assert machine.state is Phase.SUPERSEDED
    assert machine.next_deadline() is None
    for later in (
        Tick(),
        HeartbeatAcked(),
        HandlerFinished(conclusion=CompleteExecution(output="1")),
    ):
        assert machine.handle(later, now=1000.0) == []
    # Another loss repeats the (idempotent) cancel order; still no heartbeat.
    assert machine.handle(LeaseLost(), now=1001.0) == [CancelHandler()]
    assert machine.state is Phase.SUPERSEDED


def test_done_ignores_late_news() -> None:
    machine = started()
    machine.handle(HandlerFinished(conclusion=None), now=1.0)
    for event in (LeaseLost(), Superseded(), HeartbeatAcked(), HeartbeatFailed(), Tick()):
        assert machine.handle(event, now=2.0) == []
    assert machine.state is Phase.DONE


def test_error_refuses_and_emits_nothing() -> None:
    machine = Dispatch()
    with pytest.raises(LocalProtocolError, match="Dispatch in IDLE cannot handle Tick"):
        machine.handle(Tick(), now=0.0)
    assert machine.state is Phase.ERROR
    with pytest.raises(
        LocalProtocolError, match="Dispatch in ERROR cannot handle DispatchReceived"
    ):
        machine.handle(DispatchReceived(payload=webhook()), now=0.0)


# -- a RuleBasedStateMachine for the Dispatch machine ----------------------------------------------

_TERMINAL = ("completed", "failed", "cancelled")
_BEATS = (Tick, HeartbeatAcked, HeartbeatFailed)
_LOST = (LeaseLost, Superseded)


def model_next(phase: Phase, event: object) -> Phase:
    """The reference model: SEED 004's dispatch life, written out by hand."""
    if phase is Phase.IDLE and isinstance(event, DispatchReceived):
        return Phase.FETCHING
    if phase is Phase.FETCHING:
        if isinstance(event, ExecutionFetched):
            return Phase.DONE if event.status in _TERMINAL else Phase.RUNNING
        if isinstance(event, InputRejected):
            return Phase.FINISHING
        if isinstance(event, _LOST):
            return Phase.SUPERSEDED
    if phase in (Phase.RUNNING, Phase.FINISHING):
        if isinstance(event, _BEATS):
            return phase
        if isinstance(event, _LOST):
            return Phase.SUPERSEDED
    if phase is Phase.RUNNING and isinstance(event, HandlerFinished):
        return Phase.DONE if event.conclusion is None else Phase.FINISHING
    if phase is Phase.FINISHING and isinstance(event, ExecutionReported):
        return Phase.DONE
    if phase is Phase.SUPERSEDED and not isinstance(
        event, DispatchReceived | ExecutionFetched | InputRejected
    ):
        return Phase.SUPERSEDED
    if phase is Phase.DONE and isinstance(event, _BEATS + _LOST):
        return Phase.DONE
    return Phase.ERROR


class DispatchMachine(RuleBasedStateMachine):
    """Random event sequences with non-decreasing `now`, checked against
    `model_next`: final phases stay final, nothing follows ERROR, and a lost
    lease never heartbeats again."""

    @initialize(lease=st.sampled_from([3.0, 60.0, 90.0, 120.0, 600.0]))
    def start(self, lease: float) -> None:
        self.machine = Dispatch()
        self.now = 0.0
        self.interval = heartbeat_interval(lease)
        self.lease = lease
        self.model = Phase.IDLE
        self.lost = False

    def feed(self, event: object) -> list[object]:
        before = self.model
        expected = model_next(before, event)
        deadline = self.machine.next_deadline()
        try:
            actions: list[object] = list(self.machine.handle(event, now=self.now))  # type: ignore[arg-type]
        except LocalProtocolError:
            assert expected is Phase.ERROR, (before, event)
            actions = []
        else:
            assert expected is not Phase.ERROR, (before, event)
        assert self.machine.state is expected
        self.model = expected
        if before in (Phase.ERROR, Phase.DONE):
            assert actions == []
        if before is Phase.SUPERSEDED:
            # Only a repeated loss re-issues the idempotent cancel order.
            assert actions == ([CancelHandler()] if isinstance(event, _LOST) else [])
        if self.lost:
            assert SendHeartbeat() not in actions
        beat = (
            isinstance(event, Tick)
            and before in (Phase.RUNNING, Phase.FINISHING)
            and deadline is not None
            and self.now >= deadline
        )
        assert (SendHeartbeat() in actions) is beat
        if beat:
            assert self.machine.next_deadline() == self.now + self.interval
        if isinstance(event, _LOST) and before in (
            Phase.FETCHING,
            Phase.RUNNING,
            Phase.FINISHING,
            Phase.SUPERSEDED,
        ):
            assert actions == [CancelHandler()]
            self.lost = True
        return actions

    @rule(delta=st.floats(min_value=0, max_value=50, allow_nan=False))
    def advance_time(self, delta: float) -> None:
        self.now += delta

    @rule()
    def tick_at_deadline(self) -> None:
        deadline = self.machine.next_deadline()
        if deadline is not None:
            self.now = max(self.now, deadline)
        self.feed(Tick())

    @rule()
    def receive(self) -> None:
        assert self.feed(DispatchReceived(payload=webhook(lease=self.lease))) in (
            [],
            [FetchExecution()],
        )

    @rule(status=st.sampled_from(["running", "blocked", "completed", "cancelled"]))
    def fetched(self, status: str) -> None:
        before = self.model
        actions = self.feed(ExecutionFetched(status=status))
        if before is Phase.FETCHING:
            assert actions == ([] if status in _TERMINAL else [StartHandler()])

    @rule(
        event=st.sampled_from(
            [HeartbeatAcked(), HeartbeatFailed(), ExecutionReported(), InputRejected(detail="d")]
        )
    )
    def other(self, event: object) -> None:
        actions = self.feed(event)
        assert all(isinstance(a, FailExecution) for a in actions)

    @rule(superseded=st.booleans())
    def lose_lease(self, superseded: bool) -> None:
        self.feed(Superseded() if superseded else LeaseLost())

    @rule(kind=st.sampled_from(["complete", "fail", "unwind"]))
    def finish(self, kind: str) -> None:
        conclusions: dict[str, CompleteExecution | FailExecution | None] = {
            "complete": CompleteExecution(output="1"),
            "fail": FailExecution(reason="r"),
            "unwind": None,
        }
        conclusion = conclusions[kind]
        before = self.model
        actions = self.feed(HandlerFinished(conclusion=conclusion))
        if before is Phase.RUNNING and conclusion is not None:
            assert actions == [conclusion]
        else:
            assert actions == []

    @invariant()
    def deadline_only_while_running(self) -> None:
        if hasattr(self, "machine") and self.model not in (Phase.RUNNING, Phase.FINISHING):
            assert self.machine.next_deadline() is None

    @precondition(lambda self: hasattr(self, "machine") and self.lost)
    @invariant()
    def lost_lease_never_beats(self) -> None:
        assert self.machine.next_deadline() is None


TestDispatchMachine = DispatchMachine.TestCase
TestDispatchMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class _AsyncCallable:
    async def __call__(self, x: int) -> int:
        return x * 2


@pytest.mark.anyio
async def test_offload_awaits_an_object_with_async_call() -> None:
    """Not in a worker thread: trio refuses a coroutine returned from one."""
    from rebuno_anyio.agent._context import is_async_callable, offload

    assert is_async_callable(_AsyncCallable())
    assert not is_async_callable(_AsyncCallable)  # the class itself makes an object
    assert await offload(_AsyncCallable(), 21) == 42

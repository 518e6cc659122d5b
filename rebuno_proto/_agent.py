"""The agent's rules (SEED 004, SEED 000, PROTOCOL.md §3, §5.2, §5.3), pure.

Three pieces:

* `Webhooks` decides what a verified webhook does to the handlers already
  running: start one, supersede the running attempt, or ignore a repeat.
* `Dispatch` is one delivery's life on the agent, an h11-style machine: fetch
  the execution, run the handler with heartbeats every
  `min(lease / 3, 30 s)`, then complete, fail or unwind. Feed it events, carry
  out the actions it returns, wake it at `next_deadline()`.
* `interpret` says what a step decision means for the caller, and
  `failure_reason` / `conclude` map a handler's outcome onto the execution.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final, assert_never

from ._dispatch import RENEW_EVERY_S
from ._errors import LocalProtocolError
from ._records import Lease
from ._wire import WebhookPayload

__all__ = [
    "MAX_HEARTBEAT_INTERVAL_S",
    "CancelHandler",
    "CompleteExecution",
    "Dispatch",
    "DispatchReceived",
    "ExecutionFetched",
    "ExecutionReported",
    "FailExecution",
    "FetchExecution",
    "HandlerFinished",
    "HeartbeatAcked",
    "HeartbeatFailed",
    "InputRejected",
    "LeaseLost",
    "Meaning",
    "Outcome",
    "Phase",
    "SendHeartbeat",
    "StartHandler",
    "Superseded",
    "Tick",
    "Webhooks",
    "conclude",
    "failure_reason",
    "heartbeat_interval",
    "interpret",
    "may_start_body",
]

#: The longest gap between heartbeats, whatever the lease (PROTOCOL.md §6.3).
MAX_HEARTBEAT_INTERVAL_S: Final = 30.0
_TERMINAL_STATUSES: Final = frozenset({"completed", "failed", "cancelled"})


def heartbeat_interval(lease_timeout_s: float) -> float:
    """Seconds between heartbeats: `min(lease_timeout / 3, 30)`."""
    return min(lease_timeout_s / 3.0, MAX_HEARTBEAT_INTERVAL_S)


def may_start_body(*, asked_at: float, now: float, lease_timeout_s: float) -> bool:
    """Whether a `proceed` may still be acted on: the lease is surely still held.

    Deciding `proceed` renewed the lease, after the request was sent (at
    `asked_at`, on the agent's monotonic clock). An answer that took longer
    than the lease -- a process frozen with it in a buffer, a reply delayed in
    the network -- may arrive after the kernel re-queued the dispatch and
    another attempt resolved the step: the body must not start then, and the
    handler stops as if its lease was lost. `RENEW_EVERY_S` (or half of a
    shorter lease) is kept as a margin. (Leases assume clocks that run at the
    same rate: a kernel whose wall clock steps forward expires them early.)
    """
    return now - asked_at < lease_timeout_s - min(RENEW_EVERY_S, lease_timeout_s / 2)


# -- webhooks: which handler runs -----------------------------------------------


class Webhooks:
    """Which attempt runs for each execution on this agent.

    `received` returns what to do with a verified webhook: `"start"` (nothing
    runs for it), `"supersede"` (cancel the running handler, then start), or
    `"ignore"` (a repeat of the running attempt, or of one the kernel has moved
    past -- same dispatch, attempt not newer). `finished` forgets a handler
    that ended, if it is still the one on record.
    """

    __slots__ = ("_running",)

    def __init__(self) -> None:
        self._running: dict[str, Lease] = {}

    def received(self, payload: WebhookPayload) -> str:
        lease = Lease(dispatch_id=payload.dispatch_id, attempt=payload.dispatch_attempt)
        running = self._running.get(payload.execution_id)
        if running is not None and (
            running.dispatch_id == lease.dispatch_id and lease.attempt <= running.attempt
        ):
            return "ignore"
        self._running[payload.execution_id] = lease
        return "start" if running is None else "supersede"

    def finished(self, execution_id: str, lease: Lease) -> None:
        if self._running.get(execution_id) == lease:
            del self._running[execution_id]

    def running(self, execution_id: str) -> Lease | None:
        return self._running.get(execution_id)

    def __len__(self) -> int:
        return len(self._running)


# -- what a handler's outcome means ------------------------------------------------


class Outcome(enum.Enum):
    """How a handler ended, by the exception class it raised (SEED 004 table)."""

    RETURNED = "returned"
    BLOCKED = "blocked"
    TERMINATED = "terminated"
    LEASE_SUPERSEDED = "lease_superseded"
    POLICY_ERROR = "policy_error"
    RATE_LIMITED = "rate_limited"
    TOOL_ERROR = "tool_error"
    OTHER_ERROR = "other_error"


_TOKEN: Final = re.compile(r"[a-z0-9_]+")


def failure_reason(outcome: Outcome, *, detail: str, error_class: str = "") -> str:
    """The `failure_reason` an execution is failed with (PROTOCOL.md §5.3).

    Args:
        outcome: how the handler ended.
        detail: the denial or rate-limit reason, `"<tool_id>: <message>"` for a
            tool error, or the exception message.
        error_class: the exception class name, for `OTHER_ERROR`.
    """
    if outcome is Outcome.POLICY_ERROR:
        return detail if _TOKEN.fullmatch(detail) else f"policy_denied: {detail}"
    if outcome is Outcome.RATE_LIMITED:
        return detail or "rate_limit_exceeded"
    if outcome is Outcome.TOOL_ERROR:
        return f"tool_error: {detail}"
    if outcome is Outcome.OTHER_ERROR:
        return f"agent_error: {error_class}: {detail}"
    raise LocalProtocolError(f"{outcome.name} does not fail the execution")


@dataclass(frozen=True, slots=True, kw_only=True)
class CompleteExecution:
    """Order: `POST .../complete` with `output` (and `state` unless `None`), JSON texts."""

    output: str
    state: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FailExecution:
    """Order: `POST .../fail` with this reason."""

    reason: str


def conclude(
    outcome: Outcome,
    *,
    remembered: Outcome | None = None,
    detail: str = "",
    error_class: str = "",
    output: str = "null",
    state: str | None = None,
) -> CompleteExecution | FailExecution | None:
    """What ends the dispatch: complete, fail, or `None` to unwind.

    Args:
        outcome: how the handler ended.
        remembered: a `BLOCKED`/`TERMINATED` the execution context recorded
            even if the handler swallowed it; it wins over anything else.
        detail, error_class: see `failure_reason`.
        output, state: the JSON texts of a normal return.
    """
    if remembered in (Outcome.BLOCKED, Outcome.TERMINATED):
        return None
    if outcome in (Outcome.BLOCKED, Outcome.TERMINATED, Outcome.LEASE_SUPERSEDED):
        return None
    if outcome is Outcome.RETURNED:
        return CompleteExecution(output=output, state=state)
    return FailExecution(reason=failure_reason(outcome, detail=detail, error_class=error_class))


# -- what a step decision means ---------------------------------------------------


class Meaning(enum.Enum):
    """What the caller of a recording primitive does with a decision."""

    RUN_BODY = "run_body"
    RETURN_RESULT = "return_result"
    RAISE_RECORDED_ERROR = "raise_recorded_error"
    RAISE_POLICY_ERROR = "raise_policy_error"
    RAISE_RATE_LIMITED = "raise_rate_limited"
    RAISE_BLOCKED = "raise_blocked"
    RAISE_TERMINATED = "raise_terminated"
    RAISE_UNEXPECTED = "raise_unexpected"


_MEANINGS: Final = {
    "proceed": Meaning.RUN_BODY,
    "denied": Meaning.RAISE_POLICY_ERROR,
    "rate_limited": Meaning.RAISE_RATE_LIMITED,
    "blocked": Meaning.RAISE_BLOCKED,
    "execution_blocked": Meaning.RAISE_BLOCKED,
    "execution_terminal": Meaning.RAISE_TERMINATED,
}


def interpret(decision: str, *, has_error: bool) -> Meaning:
    """What a decision string means (PROTOCOL.md §5.2). `replay` returns the
    recorded result, or raises the recorded error when one is present."""
    if decision == "replay":
        return Meaning.RAISE_RECORDED_ERROR if has_error else Meaning.RETURN_RESULT
    return _MEANINGS.get(decision, Meaning.RAISE_UNEXPECTED)


# -- one dispatch on the agent ----------------------------------------------------


class Phase(enum.Enum):
    IDLE = "idle"
    FETCHING = "fetching"
    RUNNING = "running"
    FINISHING = "finishing"
    DONE = "done"
    SUPERSEDED = "superseded"
    ERROR = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchReceived:
    payload: WebhookPayload


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionFetched:
    status: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InputRejected:
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatAcked:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatFailed:
    """A heartbeat failed for a reason other than a lost lease; keep going."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseLost:
    """The kernel answered `lease_superseded`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Superseded:
    """A newer webhook for the same execution arrived."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HandlerFinished:
    conclusion: CompleteExecution | FailExecution | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionReported:
    """The complete/fail call returned (whatever the answer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """The driver woke at `next_deadline()`."""


Event = (
    DispatchReceived
    | ExecutionFetched
    | InputRejected
    | HeartbeatAcked
    | HeartbeatFailed
    | LeaseLost
    | Superseded
    | HandlerFinished
    | ExecutionReported
    | Tick
)


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchExecution:
    """Order: `GET /v0/executions/{id}`, then report `ExecutionFetched`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StartHandler:
    """Order: bind the input and run the handler under the execution context."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SendHeartbeat:
    """Order: `POST .../heartbeat` under the lease."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelHandler:
    """Order: cancel the handler's scope; write nothing more under this lease."""


Action = (
    FetchExecution
    | StartHandler
    | SendHeartbeat
    | CancelHandler
    | CompleteExecution
    | FailExecution
)

_P: Final = Phase
_NEXT: Final[dict[tuple[Phase, type[Event]], Phase]] = {
    (_P.IDLE, DispatchReceived): _P.FETCHING,
    (_P.FETCHING, ExecutionFetched): _P.RUNNING,  # or DONE when terminal
    (_P.FETCHING, InputRejected): _P.FINISHING,
    (_P.FETCHING, Superseded): _P.SUPERSEDED,
    (_P.FETCHING, LeaseLost): _P.SUPERSEDED,
    (_P.RUNNING, Tick): _P.RUNNING,
    (_P.RUNNING, HeartbeatAcked): _P.RUNNING,
    (_P.RUNNING, HeartbeatFailed): _P.RUNNING,
    (_P.RUNNING, LeaseLost): _P.SUPERSEDED,
    (_P.RUNNING, Superseded): _P.SUPERSEDED,
    (_P.RUNNING, HandlerFinished): _P.FINISHING,  # or DONE when it unwinds
    (_P.FINISHING, ExecutionReported): _P.DONE,
    (_P.FINISHING, LeaseLost): _P.SUPERSEDED,
    (_P.FINISHING, Superseded): _P.SUPERSEDED,
    (_P.FINISHING, Tick): _P.FINISHING,
    (_P.FINISHING, HeartbeatAcked): _P.FINISHING,
    (_P.FINISHING, HeartbeatFailed): _P.FINISHING,
    # A handler cancelled because its lease was lost still reports finishing.
    (_P.SUPERSEDED, HandlerFinished): _P.SUPERSEDED,
    (_P.SUPERSEDED, HeartbeatAcked): _P.SUPERSEDED,
    (_P.SUPERSEDED, HeartbeatFailed): _P.SUPERSEDED,
    (_P.SUPERSEDED, LeaseLost): _P.SUPERSEDED,
    (_P.SUPERSEDED, Superseded): _P.SUPERSEDED,
    (_P.SUPERSEDED, Tick): _P.SUPERSEDED,
    (_P.SUPERSEDED, ExecutionReported): _P.SUPERSEDED,
    (_P.DONE, Superseded): _P.DONE,
    (_P.DONE, Tick): _P.DONE,
    (_P.DONE, HeartbeatAcked): _P.DONE,
    (_P.DONE, HeartbeatFailed): _P.DONE,
    (_P.DONE, LeaseLost): _P.DONE,
}


class Dispatch:
    """One webhook delivery handled on the agent.

    The driver reports each thing that happened with `handle`, carries out the
    returned actions in order, and calls `handle(Tick(), now=...)` at
    `next_deadline()`. After a `LocalProtocolError` the machine is in `ERROR`
    and refuses everything.
    """

    __slots__ = ("_heartbeat_at", "_interval_s", "_phase", "execution_id", "lease")

    def __init__(self) -> None:
        self._phase = Phase.IDLE
        self._heartbeat_at: float | None = None
        self._interval_s = MAX_HEARTBEAT_INTERVAL_S
        self.lease: Lease | None = None
        self.execution_id = ""

    @property
    def state(self) -> Phase:
        return self._phase

    def next_deadline(self) -> float | None:
        """When the next heartbeat is due, while the handler runs."""
        if self._phase in (Phase.RUNNING, Phase.FINISHING):
            return self._heartbeat_at
        return None

    def handle(self, event: Event, *, now: float) -> list[Action]:
        """Feed one event; returns the actions to carry out, in order.

        Raises:
            LocalProtocolError: the event is not allowed in the current phase.
        """
        key = (self._phase, type(event))
        if key not in _NEXT:
            current = self._phase
            self._phase = Phase.ERROR
            raise LocalProtocolError(
                f"Dispatch in {current.name} cannot handle {type(event).__name__}"
            )
        self._phase = _NEXT[key]
        return self._act(event, now)

    def _act(self, event: Event, now: float) -> list[Action]:
        match event:
            case DispatchReceived(payload=payload):
                self.execution_id = payload.execution_id
                self.lease = Lease(
                    dispatch_id=payload.dispatch_id, attempt=payload.dispatch_attempt
                )
                self._interval_s = heartbeat_interval(payload.lease_timeout_seconds)
                return [FetchExecution()]
            case ExecutionFetched(status=status):
                if status in _TERMINAL_STATUSES:
                    self._phase = Phase.DONE
                    return []
                self._heartbeat_at = now + self._interval_s
                return [StartHandler()]
            case InputRejected(detail=detail):
                return [FailExecution(reason=f"input_invalid: {detail}")]
            case Tick():
                if (
                    self._heartbeat_at is not None
                    and now >= self._heartbeat_at
                    and (self._phase in (Phase.RUNNING, Phase.FINISHING))
                ):
                    self._heartbeat_at = now + self._interval_s
                    return [SendHeartbeat()]
                return []
            case HeartbeatAcked() | HeartbeatFailed() | ExecutionReported():
                return []
            case LeaseLost() | Superseded():
                if self._phase is Phase.DONE:
                    return []
                self._heartbeat_at = None
                return [CancelHandler()]
            case HandlerFinished(conclusion=conclusion):
                if self._phase is Phase.SUPERSEDED:
                    return []
                if conclusion is None:
                    self._phase = Phase.DONE
                    return []
                return [conclusion]
            case _ as unreachable:  # pragma: no cover - the table rejects others first
                assert_never(unreachable)

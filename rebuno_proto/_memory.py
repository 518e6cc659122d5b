"""Every kernel record in dictionaries: the memory store's tables, and the
simulator's durable state.

`MemoryRecords.begin()` opens a transaction (`MemoryTx`): it reads what the
kernel commands ask for (`rebuno_proto.Records`) and writes a `Change` with
`apply`; `rollback` undoes every write it made. Transactions must run one at a
time (the caller serialises them).

The occurrence counters are the one table a real kernel keeps in memory only;
`forget_counters` drops them, which is what a kernel crash loses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Final

from ._delivery import holds_lease
from ._outcome import Change, RateBucket
from ._records import Agent, Approval, Event, Execution, Step, StepKind
from ._state import ApprovalStatus, DispatchStatus, ExecutionStatus, StepStatus

__all__ = ["MemoryRecords", "MemoryTx"]

_MISSING: Final = object()
_CLAIMABLE: Final = (DispatchStatus.PENDING, DispatchStatus.FAILED)
_ACTIVE: Final = (ExecutionStatus.PENDING, ExecutionStatus.RUNNING, ExecutionStatus.BLOCKED)

CounterKey = tuple[str, StepKind, str, str]


def _is_indeterminate(error: str | None) -> bool:
    """Whether a step error is an object whose top-level `reason` is `indeterminate`."""
    if error is None:
        return False
    try:
        value = json.loads(error)
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("reason") == "indeterminate"


class MemoryRecords:
    """The kernel's tables, in memory."""

    def __init__(self) -> None:
        self.executions: dict[str, Execution] = {}
        self.steps: dict[str, Step] = {}
        self.step_ids: dict[str, dict[str, None]] = {}
        self.counters: dict[CounterKey, int] = {}
        self.owners: dict[str, str] = {}
        self.events: dict[str, list[Event]] = {}
        self.approvals: dict[str, Approval] = {}
        self.agents: dict[str, Agent] = {}
        self.buckets: dict[str, RateBucket] = {}

    def begin(self) -> MemoryTx:
        return MemoryTx(self)

    def forget_counters(self) -> None:
        """Drop the occurrence counters (what a kernel crash loses)."""
        self.counters.clear()


class MemoryTx:
    """One transaction over `MemoryRecords` (see the module docstring)."""

    def __init__(self, data: MemoryRecords) -> None:
        self._d = data
        self._undo: list[Callable[[], object]] = []

    # -- undo-logged mutation ----------------------------------------------------

    def _set(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        old = table.get(key, _MISSING)
        self._undo.append(
            lambda: table.pop(key) if old is _MISSING else table.__setitem__(key, old)
        )
        table[key] = value

    def _pop(self, table: dict[Any, Any], key: Any) -> None:
        if key in table:
            old = table.pop(key)
            self._undo.append(lambda: table.__setitem__(key, old))

    def rollback(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- reads -----------------------------------------------------------------------

    def execution(self, execution_id: str) -> Execution | None:
        return self._d.executions.get(execution_id)

    def step(self, step_id: str) -> Step | None:
        return self._d.steps.get(step_id)

    def counter(self, execution_id: str, kind: StepKind, target: str, args_hash: str) -> int | None:
        return self._d.counters.get((execution_id, kind, target, args_hash))

    def dispatch_owner(self, dispatch_id: str) -> str | None:
        return self._d.owners.get(dispatch_id)

    def _steps_of(self, execution_id: str) -> list[Step]:
        return [self._d.steps[s] for s in self._d.step_ids.get(execution_id, {})]

    def has_indeterminate(
        self, execution_id: str, kind: StepKind, target: str, args_hash: str
    ) -> bool:
        return any(
            s.kind is kind
            and s.target == target
            and s.args_hash == args_hash
            and s.status is StepStatus.FAILED
            and _is_indeterminate(s.error)
            for s in self._steps_of(execution_id)
        )

    def steps(self, execution_id: str, *, terminal_only: bool = False) -> list[Step]:
        found = [
            s for s in self._steps_of(execution_id) if s.status.is_terminal or not terminal_only
        ]
        return sorted(found, key=lambda s: s.step_id)

    def active_steps(self, execution_id: str) -> list[Step]:
        return [
            s
            for s in self._steps_of(execution_id)
            if s.status in (StepStatus.EXECUTING, StepStatus.ALLOWED)
        ]

    def events(self, execution_id: str, *, after_seq: int, limit: int) -> list[Event]:
        log = self._d.events.get(execution_id, [])
        return log[max(after_seq, 0) : max(after_seq, 0) + limit]

    def executions(
        self, *, agent_id: str, status: str, before_id: str, limit: int
    ) -> list[Execution]:
        found = sorted(
            (
                e
                for e in self._d.executions.values()
                if (not agent_id or e.agent_id == agent_id)
                and (not status or e.status.value == status)
                and (not before_id or e.id < before_id)
            ),
            key=lambda e: e.id,
            reverse=True,
        )
        return found[:limit]

    def execution_by_key(self, agent_id: str, idempotency_key: str) -> Execution | None:
        for e in self._d.executions.values():
            if e.agent_id == agent_id and e.idempotency_key == idempotency_key:
                return e
        return None

    def _session(self, session: str) -> list[Execution]:
        return [e for e in self._d.executions.values() if e.session == session]

    def session_busy(self, session: str) -> bool:
        return any(e.status in _ACTIVE for e in self._session(session))

    def session_head(self, session: str, agent_id: str) -> Execution | None:
        done = [
            e
            for e in self._session(session)
            if e.agent_id == agent_id and e.status is ExecutionStatus.COMPLETED
        ]
        return max(done, key=lambda e: (e.updated_at, e.id), default=None)

    def session_next(self, session: str, excluding: str) -> Execution | None:
        queued = [
            e
            for e in self._session(session)
            if e.status is ExecutionStatus.PENDING and e.id != excluding
        ]
        return min(queued, key=lambda e: (e.created_at, e.id), default=None)

    def approval(self, approval_id: str) -> Approval | None:
        return self._d.approvals.get(approval_id)

    def approvals(self, *, status: str, limit: int) -> list[Approval]:
        found = [a for a in self._d.approvals.values() if not status or a.status.value == status]
        return sorted(found, key=lambda a: (a.created_at, a.id))[:limit]

    def pending_approvals(self, execution_id: str) -> list[tuple[Approval, Step]]:
        return [
            (a, self._d.steps[a.step_id])
            for a in self._d.approvals.values()
            if a.execution_id == execution_id and a.status is ApprovalStatus.PENDING
        ]

    def due_dispatches(self, now: float, limit: int) -> list[str]:
        due = [
            (e.dispatch.next_attempt_at, e.id)
            for e in self._d.executions.values()
            if e.dispatch is not None
            and e.dispatch.status in _CLAIMABLE
            and e.dispatch.next_attempt_at <= now
        ]
        return [eid for _, eid in sorted(due)[:limit]]

    def next_dispatch_at(self) -> float | None:
        return min(
            (
                e.dispatch.next_attempt_at
                for e in self._d.executions.values()
                if e.dispatch is not None and e.dispatch.status in _CLAIMABLE
            ),
            default=None,
        )

    def _in_flight(self) -> list[tuple[float, str]]:
        return sorted(
            (e.dispatch.locked_at, e.id)
            for e in self._d.executions.values()
            if e.dispatch is not None
            and e.dispatch.status is DispatchStatus.IN_FLIGHT
            and e.dispatch.locked_at is not None
        )

    def lapsed_leases(self, locked_before: float, limit: int) -> list[str]:
        return [eid for at, eid in self._in_flight() if at <= locked_before][:limit]

    def oldest_lease_at(self) -> float | None:
        leases = self._in_flight()
        return leases[0][0] if leases else None

    def leased(self, after_id: str, limit: int) -> list[str]:
        return sorted(
            e.id for e in self._d.executions.values() if e.id > after_id and holds_lease(e)
        )[:limit]

    def _pending_approvals(self) -> list[tuple[float, str]]:
        return sorted(
            (a.timeout_at, a.id)
            for a in self._d.approvals.values()
            if a.status is ApprovalStatus.PENDING
        )

    def due_approvals(self, now: float, limit: int) -> list[str]:
        return [aid for at, aid in self._pending_approvals() if at <= now][:limit]

    def next_approval_at(self) -> float | None:
        pending = self._pending_approvals()
        return pending[0][0] if pending else None

    def agent(self, agent_id: str) -> Agent | None:
        return self._d.agents.get(agent_id)

    def agents(self) -> list[Agent]:
        return sorted(self._d.agents.values(), key=lambda a: a.id)

    def rate_bucket(self, key: str) -> RateBucket | None:
        return self._d.buckets.get(key)

    # -- writes ------------------------------------------------------------------

    def put_agent(self, agent: Agent) -> None:
        self._set(self._d.agents, agent.id, agent)

    def delete_agent(self, agent_id: str) -> bool:
        found = agent_id in self._d.agents
        self._pop(self._d.agents, agent_id)
        return found

    def _check_events(self, events: Iterable[Event]) -> None:
        """Refuse, before anything is written, events that would not continue
        their execution's log gap-free."""
        expected: dict[str, int] = {}
        for event in events:
            seq = expected.get(event.execution_id)
            if seq is None:
                seq = len(self._d.events.get(event.execution_id, ())) + 1
            if event.seq != seq:
                raise ValueError(f"event seq {event.seq} of {event.execution_id} is not {seq}")
            expected[event.execution_id] = seq + 1

    def apply(self, change: Change) -> None:
        d = self._d
        self._check_events(change.events)
        for execution in change.executions:
            self._set(d.executions, execution.id, execution)
        for step in change.steps:
            old = d.steps.get(step.step_id)
            if old is not None and old.execution_id != step.execution_id:
                self._pop(d.step_ids[old.execution_id], step.step_id)
            if old is None or old.execution_id != step.execution_id:
                ids = d.step_ids.get(step.execution_id)
                if ids is None:
                    self._set(d.step_ids, step.execution_id, {})
                    ids = d.step_ids[step.execution_id]
                self._set(ids, step.step_id, None)
            self._set(d.steps, step.step_id, step)
        for approval in change.approvals:
            self._set(d.approvals, approval.id, approval)
        for execution_id in change.cleared_counters:
            for key in [k for k in d.counters if k[0] == execution_id]:
                self._pop(d.counters, key)
        for c in change.counters:
            key = (c.execution_id, c.kind, c.target, c.args_hash)
            self._set(d.counters, key, max(d.counters.get(key, c.value), c.value))
        for dispatch_id, execution_id in change.new_dispatches:
            self._set(d.owners, dispatch_id, execution_id)
        for bucket in change.rate_buckets:
            self._set(d.buckets, bucket.key, bucket)
        for event in change.events:
            log = d.events.get(event.execution_id)
            if log is None:
                self._set(d.events, event.execution_id, [])
                log = d.events[event.execution_id]
            log.append(event)
            self._undo.append(log.pop)

"""The store contract (rebuno_anyio/store/_base.py): one suite every store passes.

Each store-agnostic test runs against `MemoryStore()`, `SQLiteStore` on a file
and `SQLiteStore` on `:memory:`, under asyncio and trio. Records are built
directly, and realistic `Change`s come from the pure kernel rules
(`create_execution`, `claim_dispatch`, `decide_submission`, ...) so the suite
checks what the kernel really writes. The SQLite-only tests at the end cover
durability, the file lock, open-time validation and the group-commit paths.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
from anyio.abc import TaskStatus

from rebuno_anyio.store import MemoryStore, SQLiteStore, Store, StoreError, Tx
from rebuno_proto import (
    ALLOW,
    INDETERMINATE_ERROR,
    NO_SESSION,
    Action,
    Agent,
    Approval,
    ApprovalChoice,
    ApprovalStatus,
    Change,
    CounterWrite,
    Created,
    CreateExecution,
    Decision,
    Delivery,
    DeliveryResult,
    DispatchRecord,
    DispatchSettings,
    DispatchStatus,
    ErrorCode,
    Event,
    Execution,
    ExecutionCompletion,
    ExecutionFailure,
    ExecutionStatus,
    Idempotency,
    Lease,
    Outcome,
    RateBucket,
    Refusal,
    SessionView,
    Step,
    StepDecision,
    StepKind,
    StepStatus,
    StepSubmission,
    Verdict,
    cancel_execution,
    claim_dispatch,
    complete_step,
    create_execution,
    decide_approval,
    decide_submission,
    end_execution,
    expire_approval,
    fail_step,
    needs_indeterminate_check,
    needs_lease_owner,
    reclaim_lease,
    record_delivery,
    step_key,
)

pytestmark = pytest.mark.anyio

R = TypeVar("R")

SETTINGS = DispatchSettings()
AGENT = "agent-a"
OTHER_AGENT = "agent-b"
STORE_KINDS = ("memory", "sqlite-file", "sqlite-memory")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def open_store(kind: str, tmp_path: Path) -> Store:
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite-file":
        return await SQLiteStore.open(str(tmp_path / "k.db"))
    return await SQLiteStore.open(":memory:")


@pytest.fixture(params=STORE_KINDS)
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, anyio_backend: str
) -> AsyncIterator[Store]:
    opened = await open_store(str(request.param), tmp_path)
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture(params=["sqlite-file", "sqlite-memory"])
async def sqlite_store(
    request: pytest.FixtureRequest, tmp_path: Path, anyio_backend: str
) -> AsyncIterator[SQLiteStore]:
    path = str(tmp_path / "k.db") if request.param == "sqlite-file" else ":memory:"
    opened = await SQLiteStore.open(path)
    try:
        yield opened
    finally:
        await opened.close()


# -- building records --------------------------------------------------------------


def uid(n: int) -> str:
    """A UUIDv7-shaped id; ids sort in the order of `n`, as time-ordered ids do."""
    h = f"{n:012x}"
    return f"{h[:8]}-{h[8:]}-7000-8000-000000000000"


class Ids:
    """A `new_id` for the kernel rules: increasing, sortable ids."""

    def __init__(self, start: int = 1_000) -> None:
        self.n = start

    def __call__(self) -> str:
        self.n += 1
        return uid(self.n)


def make_dispatch(
    n: int,
    status: DispatchStatus = DispatchStatus.PENDING,
    *,
    at: float = 0.0,
    locked_at: float | None = None,
    attempt: int = 0,
) -> DispatchRecord:
    return DispatchRecord(
        id=uid(900_000 + n),
        status=status,
        attempt=attempt,
        next_attempt_at=at,
        locked_at=locked_at,
    )


def make_execution(
    n: int,
    *,
    agent: str = AGENT,
    status: ExecutionStatus = ExecutionStatus.RUNNING,
    session: str = "",
    created_at: float | None = None,
    updated_at: float | None = None,
    dispatch: DispatchRecord | None = None,
    idempotency_key: str = "",
) -> Execution:
    created = float(n) if created_at is None else created_at
    return Execution(
        id=uid(n),
        agent_id=agent,
        status=status,
        created_at=created,
        updated_at=created if updated_at is None else updated_at,
        session=session,
        dispatch=dispatch,
        idempotency_key=idempotency_key,
    )


def make_step(
    execution_id: str,
    step_id: str,
    *,
    status: StepStatus = StepStatus.EXECUTING,
    kind: StepKind = StepKind.TOOL_CALL,
    target: str = "search",
    args_hash: str = "hash-0",
    error: str | None = None,
    occurrence: int = 0,
) -> Step:
    return Step(
        step_id=step_id,
        execution_id=execution_id,
        kind=kind,
        target=target,
        args_hash=args_hash,
        occurrence=occurrence,
        status=status,
        idempotency=Idempotency.SAFE_TO_RETRY,
        error=error,
    )


def make_event(execution_id: str, seq: int, type_: str = "step.proposed") -> Event:
    return Event(
        execution_id=execution_id,
        seq=seq,
        type=type_,
        payload=f'{{"execution_id":"{execution_id}","n":{seq}}}',
        occurred_at=1_000.0 + seq,
    )


def make_approval(
    n: int,
    execution_id: str,
    step_id: str,
    *,
    status: ApprovalStatus = ApprovalStatus.PENDING,
    created_at: float,
    timeout_at: float,
) -> Approval:
    return Approval(
        id=uid(500_000 + n),
        execution_id=execution_id,
        step_id=step_id,
        status=status,
        created_at=created_at,
        timeout_at=timeout_at,
    )


def counter_write(execution_id: str, value: int, *, target: str = "search") -> CounterWrite:
    return CounterWrite(
        execution_id=execution_id,
        kind=StepKind.TOOL_CALL,
        target=target,
        args_hash="hash-0",
        value=value,
    )


def read_counter(tx: Tx, execution_id: str, *, target: str = "search") -> int | None:
    return tx.counter(execution_id, StepKind.TOOL_CALL, target, "hash-0")


async def apply(store: Store, **change: Any) -> None:
    await store.run(lambda tx: tx.apply(Change(**change)))


class Boom(Exception):
    """Raised by a command on purpose."""


# -- driving the real kernel rules -----------------------------------------------------


def submission(
    target: str,
    args: str = "{}",
    idempotency: Idempotency = Idempotency.SAFE_TO_RETRY,
    kind: StepKind = StepKind.TOOL_CALL,
) -> StepSubmission:
    return StepSubmission(kind=kind, target=target, args=args, idempotency=idempotency)


def args_digest(execution_id: str, sub: StepSubmission) -> str:
    return step_key(execution_id, sub, None).args_hash


class Driver:
    """Runs kernel commands the way the service does: read what the rule needs
    under the store's transaction, call the pure rule, apply its `Change`.
    Remembers every change it wrote, to compare with what the store holds."""

    def __init__(self, store: Store, *, start: int = 1_000) -> None:
        self.store = store
        self.ids = Ids(start)
        self.written: list[Change] = []

    async def command(self, rule: Callable[[Tx], Outcome[R]]) -> Outcome[R]:
        def fn(tx: Tx) -> Outcome[R]:
            outcome = rule(tx)
            tx.apply(outcome.change)
            return outcome

        outcome = await self.store.run(fn)
        self.written.append(outcome.change)
        return outcome

    # -- what was written -----------------------------------------------------

    def events_of(self, execution_id: str) -> list[Event]:
        return [e for c in self.written for e in c.events if e.execution_id == execution_id]

    def latest(self) -> tuple[dict[str, Execution], dict[str, Step], dict[str, Approval]]:
        executions: dict[str, Execution] = {}
        steps: dict[str, Step] = {}
        approvals: dict[str, Approval] = {}
        for change in self.written:
            executions.update((e.id, e) for e in change.executions)
            steps.update((s.step_id, s) for s in change.steps)
            approvals.update((a.id, a) for a in change.approvals)
        return executions, steps, approvals

    async def assert_store_matches(self) -> None:
        """Every record's latest written version is what the store returns, and
        each execution's events are exactly the ones written, numbered 1..n."""
        executions, steps, approvals = self.latest()

        def check(tx: Tx) -> None:
            for execution in executions.values():
                assert tx.execution(execution.id) == execution
                events = tx.events(execution.id, after_seq=0, limit=10_000)
                assert events == self.events_of(execution.id)
                assert [e.seq for e in events] == list(range(1, len(events) + 1))
                assert execution.last_event_seq == len(events)
                mine = sorted(
                    (s for s in steps.values() if s.execution_id == execution.id),
                    key=lambda s: s.step_id,
                )
                assert tx.steps(execution.id) == mine
            for step in steps.values():
                assert tx.step(step.step_id) == step
            for approval in approvals.values():
                assert tx.approval(approval.id) == approval
            for change in self.written:
                for dispatch_id, execution_id in change.new_dispatches:
                    assert tx.dispatch_owner(dispatch_id) == execution_id

        await self.store.run(check)

    # -- commands --------------------------------------------------------------

    @staticmethod
    def _session(tx: Tx, execution: Execution) -> SessionView:
        if not execution.session:
            return NO_SESSION
        nxt = tx.session_next(execution.session, execution.id)
        head = None if nxt is None else tx.session_head(execution.session, nxt.agent_id)
        return SessionView(next_pending=nxt, head_for_next=head)

    @staticmethod
    def _owner(tx: Tx, execution: Execution, lease: Lease) -> str | None:
        if needs_lease_owner(execution, lease):
            return tx.dispatch_owner(lease.dispatch_id)
        return None

    @staticmethod
    def _pending(tx: Tx, execution: Execution) -> tuple[tuple[Approval, Step], ...]:
        if execution.status is ExecutionStatus.BLOCKED:
            return tuple(tx.pending_approvals(execution.id))
        return ()

    @staticmethod
    def _get(tx: Tx, execution_id: str) -> Execution:
        execution = tx.execution(execution_id)
        assert execution is not None
        return execution

    async def create(
        self, agent_id: str, now: float, *, session: str = "", key: str = "", input: str = "{}"
    ) -> Execution:
        request = CreateExecution(
            agent_id=agent_id, input=input, session=session, idempotency_key=key
        )

        def rule(tx: Tx) -> Outcome[Created]:
            busy = bool(session) and tx.session_busy(session)
            return create_execution(
                request=request,
                agent=tx.agent(agent_id),
                duplicate=tx.execution_by_key(agent_id, key) if key else None,
                session_busy=busy,
                head=tx.session_head(session, agent_id) if session and not busy else None,
                new_id=self.ids,
                now=now,
                settings=SETTINGS,
            )

        reply = (await self.command(rule)).reply
        assert isinstance(reply, Created)
        return reply.execution

    async def claim(self, execution_id: str, now: float) -> Delivery | None:
        def rule(tx: Tx) -> Outcome[Delivery | None]:
            execution = self._get(tx, execution_id)
            return claim_dispatch(
                execution=execution,
                session=self._session(tx, execution),
                new_id=self.ids,
                now=now,
                settings=SETTINGS,
            )

        reply = (await self.command(rule)).reply
        assert not hasattr(reply, "code"), reply
        return reply  # type: ignore[return-value]

    async def deliver(self, execution_id: str, lease: Lease, now: float, *, acked: bool) -> None:
        def rule(tx: Tx) -> Outcome[None]:
            execution = self._get(tx, execution_id)
            return record_delivery(
                execution=execution,
                lease=lease,
                result=DeliveryResult.ACKED if acked else DeliveryResult.REFUSED,
                jitter=0.0,
                session=self._session(tx, execution),
                new_id=self.ids,
                now=now,
                settings=SETTINGS,
            )

        await self.command(rule)

    async def submit_raw(
        self,
        execution_id: str,
        lease: Lease,
        sub: StepSubmission,
        now: float,
        *,
        verdict: Verdict = ALLOW,
    ) -> StepDecision | Refusal:
        def rule(tx: Tx) -> Outcome[StepDecision]:
            execution = self._get(tx, execution_id)
            digest = args_digest(execution_id, sub)
            key = step_key(
                execution_id, sub, tx.counter(execution_id, sub.kind, sub.target, digest)
            )
            existing = tx.step(key.step_id)
            indeterminate = needs_indeterminate_check(
                execution, sub, existing
            ) and tx.has_indeterminate(execution_id, sub.kind, sub.target, digest)
            return decide_submission(
                execution=execution,
                caller=execution.agent_id,
                lease=lease,
                lease_owner=self._owner(tx, execution, lease),
                submission=sub,
                key=key,
                existing=existing,
                has_indeterminate_failure=indeterminate,
                verdict=verdict,
                new_id=self.ids,
                now=now,
            )

        return (await self.command(rule)).reply

    async def submit(
        self,
        execution_id: str,
        lease: Lease,
        sub: StepSubmission,
        now: float,
        *,
        verdict: Verdict = ALLOW,
    ) -> StepDecision:
        reply = await self.submit_raw(execution_id, lease, sub, now, verdict=verdict)
        assert isinstance(reply, StepDecision), reply
        return reply

    async def finish_step(
        self,
        execution_id: str,
        lease: Lease,
        step_id: str,
        now: float,
        *,
        result: str | None = None,
        error: str | None = None,
    ) -> StepDecision:
        def rule(tx: Tx) -> Outcome[StepDecision]:
            execution = self._get(tx, execution_id)
            common: dict[str, Any] = {
                "execution": execution,
                "caller": execution.agent_id,
                "lease": lease,
                "lease_owner": self._owner(tx, execution, lease),
                "step": tx.step(step_id),
                "now": now,
            }
            if error is None:
                return complete_step(result=result or "null", **common)
            return fail_step(error=error, **common)

        reply = (await self.command(rule)).reply
        assert isinstance(reply, StepDecision), reply
        return reply

    async def end(
        self,
        execution_id: str,
        lease: Lease,
        now: float,
        *,
        output: str = "null",
        state: str | None = None,
        failure: str | None = None,
    ) -> None:
        def rule(tx: Tx) -> Outcome[None]:
            execution = self._get(tx, execution_id)
            common: dict[str, Any] = {
                "execution": execution,
                "caller": execution.agent_id,
                "lease": lease,
                "lease_owner": self._owner(tx, execution, lease),
                "session": self._session(tx, execution),
                "pending": self._pending(tx, execution),
                "new_id": self.ids,
                "now": now,
                "settings": SETTINGS,
            }
            if failure is None:
                return end_execution(
                    ending=ExecutionCompletion(output=output, state=state), **common
                )
            return end_execution(ending=ExecutionFailure(error=failure), **common)

        reply = (await self.command(rule)).reply
        assert reply is None, reply

    async def cancel(self, execution_id: str, now: float) -> None:
        def rule(tx: Tx) -> Outcome[None]:
            execution = self._get(tx, execution_id)
            return cancel_execution(
                execution=execution,
                session=self._session(tx, execution),
                pending=self._pending(tx, execution),
                active_steps=tuple(tx.active_steps(execution_id)),
                new_id=self.ids,
                now=now,
                settings=SETTINGS,
            )

        reply = (await self.command(rule)).reply
        assert reply is None, reply

    async def reclaim(self, execution_id: str, now: float) -> bool:
        def rule(tx: Tx) -> Outcome[bool]:
            return reclaim_lease(execution=self._get(tx, execution_id), now=now, settings=SETTINGS)

        return bool((await self.command(rule)).reply)

    def _approval_inputs(self, tx: Tx, approval_id: str) -> tuple[Approval, Execution, Step]:
        approval = tx.approval(approval_id)
        assert approval is not None
        step = tx.step(approval.step_id)
        assert step is not None
        return approval, self._get(tx, approval.execution_id), step

    async def decide(self, approval_id: str, choice: ApprovalChoice, now: float) -> None:
        def rule(tx: Tx) -> Outcome[None]:
            approval, execution, step = self._approval_inputs(tx, approval_id)
            return decide_approval(
                approval=approval,
                execution=execution,
                step=step,
                choice=choice,
                decided_by="alice",
                rationale="looks fine",
                new_id=self.ids,
                now=now,
                settings=SETTINGS,
            )

        reply = (await self.command(rule)).reply
        assert reply is None, reply

    async def expire(self, approval_id: str, now: float) -> bool:
        def rule(tx: Tx) -> Outcome[bool]:
            approval, execution, step = self._approval_inputs(tx, approval_id)
            return expire_approval(
                approval=approval,
                execution=execution,
                step=step,
                new_id=self.ids,
                now=now,
                settings=SETTINGS,
            )

        return bool((await self.command(rule)).reply)


async def register(store: Store, *agent_ids: str) -> None:
    def fn(tx: Tx) -> None:
        for agent_id in agent_ids:
            tx.put_agent(
                Agent(
                    id=agent_id,
                    webhook_url=f"http://agents.test/{agent_id}",
                    secret="s3cret",
                    registered_at=1.0,
                )
            )

    await store.run(fn)


async def get(store: Store, execution_id: str) -> Execution:
    found = await store.run(lambda tx: tx.execution(execution_id))
    assert found is not None
    return found


async def due_dispatches(store: Store, now: float) -> list[str]:
    return await store.run(lambda tx: tx.due_dispatches(now, 100))


# == executions ================================================================


async def test_execution_insert_and_lookup(store: Store) -> None:
    full = Execution(
        id=uid(1),
        agent_id=AGENT,
        status=ExecutionStatus.RUNNING,
        created_at=1_712_345_678.123456,
        updated_at=1_712_345_679.000001,
        input='{"q":"caf\u00e9 \U0001f600","n":[1,2.5,null]}',
        output='{"answer":42}',
        state='{"turn":3}',
        failure_reason="",
        session="chat-\u00e9",
        parent_execution_id=uid(0),
        idempotency_key="key-1",
        last_event_seq=17,
        dispatch=DispatchRecord(
            id=uid(77),
            status=DispatchStatus.IN_FLIGHT,
            attempt=3,
            max_attempts=7,
            next_attempt_at=0.1 + 0.2,
            locked_at=1_712_345_680.5,
        ),
    )
    bare = make_execution(2)  # every optional field at its default, no dispatch
    await apply(store, executions=(full, bare))

    assert await get(store, full.id) == full
    assert await get(store, bare.id) == bare
    assert (await get(store, bare.id)).dispatch is None
    assert await store.run(lambda tx: tx.execution(uid(3))) is None


async def test_execution_upsert_replaces_the_whole_record(store: Store) -> None:
    v1 = make_execution(1, status=ExecutionStatus.PENDING)
    v2 = Execution(
        id=v1.id,
        agent_id=OTHER_AGENT,
        status=ExecutionStatus.BLOCKED,
        created_at=11.25,
        updated_at=12.125,
        input="[1,2]",
        output='{"answer":42}',
        state='{"turn":2}',
        failure_reason="why\x00not",
        session="chat-1",
        parent_execution_id=uid(0),
        idempotency_key="key-1",
        last_event_seq=7,
        dispatch=DispatchRecord(
            id=uid(99),
            status=DispatchStatus.IN_FLIGHT,
            attempt=2,
            max_attempts=9,
            next_attempt_at=13.5,
            locked_at=14.75,
        ),
    )
    assert v2.dispatch is not None
    # Values back to None, and the dispatch record changed in place, then dropped.
    v3 = dataclasses.replace(
        v2,
        output=None,
        state=None,
        parent_execution_id=None,
        dispatch=dataclasses.replace(
            v2.dispatch, status=DispatchStatus.FAILED, locked_at=None, attempt=3
        ),
    )
    v4 = dataclasses.replace(v3, dispatch=None, status=ExecutionStatus.FAILED)

    await apply(store, executions=(v1,))
    for version in (v2, v3, v4):
        await apply(store, executions=(version,))
        assert await get(store, v1.id) == version
    listed = await store.run(
        lambda tx: tx.executions(agent_id="", status="", before_id="", limit=10)
    )
    assert listed == [v4]


async def test_execution_listing_newest_first_with_filters_and_paging(store: Store) -> None:
    statuses = [
        ExecutionStatus.RUNNING,
        ExecutionStatus.COMPLETED,
        ExecutionStatus.PENDING,
        ExecutionStatus.RUNNING,
        ExecutionStatus.FAILED,
        ExecutionStatus.RUNNING,
        ExecutionStatus.BLOCKED,
        ExecutionStatus.RUNNING,
    ]
    executions = [
        make_execution(n, agent=AGENT if n % 2 else OTHER_AGENT, status=statuses[n - 1])
        for n in range(1, 9)
    ]
    # Stored out of order: listing order comes from the ids, not from insertion.
    await apply(store, executions=tuple(executions[4:] + executions[:4]))
    newest_first = sorted(executions, key=lambda e: e.id, reverse=True)

    def listing(agent_id: str = "", status: str = "", before_id: str = "", limit: int = 100):
        return store.run(
            lambda tx: tx.executions(
                agent_id=agent_id, status=status, before_id=before_id, limit=limit
            )
        )

    assert await listing() == newest_first
    assert await listing(agent_id=AGENT) == [e for e in newest_first if e.agent_id == AGENT]
    assert await listing(status="running") == [
        e for e in newest_first if e.status is ExecutionStatus.RUNNING
    ]
    assert await listing(agent_id=OTHER_AGENT, status="running") == [
        e for e in newest_first if e.agent_id == OTHER_AGENT and e.status is ExecutionStatus.RUNNING
    ]
    assert await listing(agent_id="nobody") == []
    assert await listing(limit=3) == newest_first[:3]
    assert await listing(before_id=uid(5)) == [e for e in newest_first if e.id < uid(5)]
    assert await listing(before_id=uid(1)) == []

    # Cursor paging visits every execution once, newest first.
    pages: list[list[Execution]] = []
    cursor = ""
    while True:
        page = await listing(before_id=cursor, limit=3)
        if not page:
            break
        pages.append(page)
        cursor = page[-1].id
    assert [len(p) for p in pages] == [3, 3, 2]
    assert [e for p in pages for e in p] == newest_first

    # Paging under a filter.
    running = await listing(status="running", limit=2)
    rest = await listing(status="running", before_id=running[-1].id, limit=2)
    assert running + rest == [e for e in newest_first if e.status is ExecutionStatus.RUNNING]


async def test_execution_by_agent_and_idempotency_key(store: Store) -> None:
    a1 = make_execution(1, agent=AGENT, idempotency_key="k1")
    b1 = make_execution(2, agent=OTHER_AGENT, idempotency_key="k1")
    a2 = make_execution(3, agent=AGENT, idempotency_key="k2")
    await apply(store, executions=(a1, b1, a2, make_execution(4)))

    def by_key(agent_id: str, key: str) -> Awaitable[Execution | None]:
        return store.run(lambda tx: tx.execution_by_key(agent_id, key))

    assert await by_key(AGENT, "k1") == a1
    assert await by_key(OTHER_AGENT, "k1") == b1
    assert await by_key(AGENT, "k2") == a2
    assert await by_key(OTHER_AGENT, "k2") is None
    assert await by_key(AGENT, "k3") is None

    done = dataclasses.replace(a1, status=ExecutionStatus.COMPLETED, output="1", updated_at=9.0)
    await apply(store, executions=(done,))
    assert await by_key(AGENT, "k1") == done


async def test_create_with_idempotency_key_through_the_rules(store: Store) -> None:
    await register(store, AGENT)
    kernel = Driver(store)
    first = await kernel.create(AGENT, 10.0, key="order-7", input='{"n":1}')
    again = await kernel.create(AGENT, 11.0, key="order-7", input='{"n":1}')
    assert again == first
    listed = await store.run(
        lambda tx: tx.executions(agent_id=AGENT, status="", before_id="", limit=10)
    )
    assert listed == [first]
    await kernel.assert_store_matches()


# == steps =====================================================================


async def test_steps_by_id_and_by_execution(store: Store) -> None:
    e1, e2 = uid(1), uid(2)
    steps = [
        make_step(e1, "s-c", status=StepStatus.SUCCEEDED),
        make_step(e1, "s-a", status=StepStatus.EXECUTING),
        make_step(e1, "s-e", status=StepStatus.FAILED, error='{"message":"x"}'),
        make_step(e1, "s-b", status=StepStatus.AWAITING_APPROVAL),
        make_step(e1, "s-d", status=StepStatus.DENIED),
        make_step(e1, "s-g", status=StepStatus.CANCELLED),
        make_step(e1, "s-f", status=StepStatus.ALLOWED),
        make_step(e2, "s-0", status=StepStatus.SUCCEEDED),
        make_step(e2, "s-z", status=StepStatus.EXECUTING),
    ]
    await apply(store, steps=tuple(steps))

    assert await store.run(lambda tx: [tx.step(s.step_id) for s in steps]) == steps
    assert await store.run(lambda tx: tx.step("s-missing")) is None

    of_e1 = sorted((s for s in steps if s.execution_id == e1), key=lambda s: s.step_id)
    assert await store.run(lambda tx: tx.steps(e1)) == of_e1
    assert await store.run(lambda tx: tx.steps(e1, terminal_only=True)) == [
        s for s in of_e1 if s.status.is_terminal
    ]
    assert [s.step_id for s in await store.run(lambda tx: tx.steps(e1, terminal_only=True))] == [
        "s-c",
        "s-d",
        "s-e",
        "s-g",
    ]
    assert await store.run(lambda tx: tx.steps(uid(3))) == []

    active = await store.run(lambda tx: tx.active_steps(e1))
    assert sorted(s.step_id for s in active) == ["s-a", "s-f"]
    assert {s.step_id: s for s in active} == {
        s.step_id: s for s in steps if s.step_id in ("s-a", "s-f")
    }
    assert [s.step_id for s in await store.run(lambda tx: tx.active_steps(e2))] == ["s-z"]


async def test_step_upsert_replaces_the_whole_record(store: Store) -> None:
    v1 = make_step(uid(1), "s-1")
    v2 = Step(
        step_id="s-1",
        execution_id=uid(2),
        kind=StepKind.LLM_CALL,
        target="gpt-x",
        args_hash="hash-9",
        occurrence=4,
        status=StepStatus.FAILED,
        idempotency=Idempotency.AT_MOST_ONCE,
        args='{"model":"gpt-x"}',
        result=None,
        error='{"reason":"boom"}',
        started_at=5.5,
        completed_at=6.25,
        approval_id=uid(3),
        rule_id="rule-1",
    )
    v3 = dataclasses.replace(
        v2, status=StepStatus.SUCCEEDED, result='"ok"', error=None, approval_id=None
    )
    await apply(store, steps=(v1,))
    for version in (v2, v3):
        await apply(store, steps=(version,))
        assert await store.run(lambda tx: tx.step("s-1")) == version
    assert await store.run(lambda tx: tx.steps(uid(2))) == [v3]
    assert await store.run(lambda tx: tx.steps(uid(1))) == []


INDETERMINATE_CASES = [
    # (what the stored step is, what the query asks, expected)
    ("kernel's indeterminate failure", {}, {}, True),
    ("agent failed it with that reason", {"error": '{"reason":"indeterminate"}'}, {}, True),
    ("another kind", {}, {"kind": StepKind.LOCAL}, False),
    ("another target", {}, {"target": "other"}, False),
    ("other arguments", {}, {"args_hash": "hash-1"}, False),
    ("another execution", {}, {"execution": 2}, False),
    ("still executing", {"status": StepStatus.EXECUTING}, {}, False),
    ("denied, not failed", {"status": StepStatus.DENIED}, {}, False),
    ("failed for another reason", {"error": '{"message":"boom","reason":"tool"}'}, {}, False),
    ("failed without an error", {"error": None}, {}, False),
    (
        "only a nested object says indeterminate",
        {"error": '{"detail":{"reason":"indeterminate"},"reason":"tool_error"}'},
        {},
        False,
    ),
    ("the word in a message", {"error": '{"message":"reason: indeterminate"}'}, {}, False),
]


@pytest.mark.parametrize(
    ("stored", "query", "expected"),
    [pytest.param(s, q, x, id=name) for name, s, q, x in INDETERMINATE_CASES],
)
async def test_has_indeterminate(
    store: Store, stored: dict[str, Any], query: dict[str, Any], expected: bool
) -> None:
    fields: dict[str, Any] = {"status": StepStatus.FAILED, "error": INDETERMINATE_ERROR}
    fields.update(stored)
    await apply(store, steps=(make_step(uid(1), "s-1", **fields),))
    execution = uid(query.get("execution", 1))
    kind = query.get("kind", StepKind.TOOL_CALL)
    target = query.get("target", "search")
    digest = query.get("args_hash", "hash-0")
    found = await store.run(lambda tx: tx.has_indeterminate(execution, kind, target, digest))
    assert found is expected


# == occurrence counters ===========================================================


async def test_counters_missing_written_and_monotonic(store: Store) -> None:
    e1 = uid(1)
    assert await store.run(lambda tx: read_counter(tx, e1)) is None
    await apply(store, counters=(counter_write(e1, 2),))
    assert await store.run(lambda tx: read_counter(tx, e1)) == 2
    await apply(store, counters=(counter_write(e1, 0),))  # lower: ignored
    assert await store.run(lambda tx: read_counter(tx, e1)) == 2
    await apply(store, counters=(counter_write(e1, 5), counter_write(e1, 3)))
    assert await store.run(lambda tx: read_counter(tx, e1)) == 5

    # The key is (execution, kind, target, args_hash): every part counts.
    def others(tx: Tx) -> list[int | None]:
        return [
            tx.counter(e1, StepKind.LOCAL, "search", "hash-0"),
            tx.counter(e1, StepKind.TOOL_CALL, "other", "hash-0"),
            tx.counter(e1, StepKind.TOOL_CALL, "search", "hash-1"),
            tx.counter(uid(2), StepKind.TOOL_CALL, "search", "hash-0"),
        ]

    assert await store.run(others) == [None, None, None, None]


async def test_cleared_counters_clear_one_execution_then_new_writes_apply(store: Store) -> None:
    e1, e2 = uid(1), uid(2)
    await apply(
        store,
        counters=(
            counter_write(e1, 4),
            counter_write(e1, 1, target="other"),
            counter_write(e2, 6),
        ),
    )
    await apply(store, cleared_counters=(e1,))
    assert await store.run(lambda tx: read_counter(tx, e1)) is None
    assert await store.run(lambda tx: read_counter(tx, e1, target="other")) is None
    assert await store.run(lambda tx: read_counter(tx, e2)) == 6

    # Clearing and writing in one Change: the clear comes first, so a lower
    # value than the one cleared is what remains.
    await apply(store, counters=(counter_write(e1, 9),))
    await apply(store, cleared_counters=(e1,), counters=(counter_write(e1, 0),))
    assert await store.run(lambda tx: read_counter(tx, e1)) == 0
    assert await store.run(lambda tx: read_counter(tx, e2)) == 6


# == dispatch claims and leases =======================================================


async def test_due_dispatches_and_next_dispatch_at(store: Store) -> None:
    assert await store.run(lambda tx: tx.due_dispatches(1e12, 10)) == []
    assert await store.run(lambda tx: tx.next_dispatch_at()) is None
    await apply(
        store,
        executions=(
            make_execution(1, dispatch=make_dispatch(1, DispatchStatus.PENDING, at=5.0)),
            make_execution(2, dispatch=make_dispatch(2, DispatchStatus.FAILED, at=3.0)),
            make_execution(
                3, dispatch=make_dispatch(3, DispatchStatus.IN_FLIGHT, at=1.0, locked_at=9.0)
            ),
            make_execution(
                4,
                status=ExecutionStatus.BLOCKED,
                dispatch=make_dispatch(4, DispatchStatus.EXHAUSTED, at=0.5),
            ),
            make_execution(5, dispatch=make_dispatch(5, DispatchStatus.PENDING, at=50.0)),
            make_execution(6),  # no dispatch at all
            make_execution(7, dispatch=make_dispatch(7, DispatchStatus.PENDING, at=4.0)),
        ),
    )

    def due(now: float, limit: int = 10) -> Awaitable[list[str]]:
        return store.run(lambda tx: tx.due_dispatches(now, limit))

    assert await due(10.0) == [uid(2), uid(7), uid(1)]  # oldest first
    assert await due(10.0, limit=2) == [uid(2), uid(7)]
    assert await due(5.0) == [uid(2), uid(7), uid(1)]  # due exactly now counts
    assert await due(4.999) == [uid(2), uid(7)]
    assert await due(2.0) == []
    assert await due(1e9) == [uid(2), uid(7), uid(1), uid(5)]
    assert await store.run(lambda tx: tx.next_dispatch_at()) == 3.0

    # Claiming the oldest moves it out of the queue.
    claimed = make_execution(
        2, dispatch=make_dispatch(2, DispatchStatus.IN_FLIGHT, at=3.0, locked_at=10.0, attempt=1)
    )
    await apply(store, executions=(claimed,))
    assert await due(10.0) == [uid(7), uid(1)]
    assert await store.run(lambda tx: tx.next_dispatch_at()) == 4.0


async def test_lapsed_leases_and_oldest_lease_at(store: Store) -> None:
    assert await store.run(lambda tx: tx.lapsed_leases(1e12, 10)) == []
    assert await store.run(lambda tx: tx.oldest_lease_at()) is None
    await apply(
        store,
        executions=(
            make_execution(
                1, dispatch=make_dispatch(1, DispatchStatus.IN_FLIGHT, at=0.0, locked_at=20.0)
            ),
            make_execution(
                2, dispatch=make_dispatch(2, DispatchStatus.IN_FLIGHT, at=0.0, locked_at=7.0)
            ),
            make_execution(3, dispatch=make_dispatch(3, DispatchStatus.PENDING, at=1.0)),
            make_execution(4, dispatch=make_dispatch(4, DispatchStatus.FAILED, at=1.0)),
            make_execution(
                5,
                status=ExecutionStatus.COMPLETED,
                dispatch=make_dispatch(5, DispatchStatus.EXHAUSTED, at=0.0, locked_at=1.0),
            ),
            make_execution(
                6, dispatch=make_dispatch(6, DispatchStatus.IN_FLIGHT, at=0.0, locked_at=12.0)
            ),
        ),
    )

    def lapsed(before: float, limit: int = 10) -> Awaitable[list[str]]:
        return store.run(lambda tx: tx.lapsed_leases(before, limit))

    assert await lapsed(100.0) == [uid(2), uid(6), uid(1)]  # oldest lease first
    assert await lapsed(100.0, limit=1) == [uid(2)]
    assert await lapsed(12.0) == [uid(2), uid(6)]  # locked exactly then counts
    assert await lapsed(6.9) == []
    assert await store.run(lambda tx: tx.oldest_lease_at()) == 7.0

    renewed = make_execution(
        2, dispatch=make_dispatch(2, DispatchStatus.IN_FLIGHT, at=0.0, locked_at=30.0)
    )
    await apply(store, executions=(renewed,))
    assert await store.run(lambda tx: tx.oldest_lease_at()) == 12.0
    assert await lapsed(25.0) == [uid(6), uid(1)]


async def test_dispatch_owner(store: Store) -> None:
    e1, e2 = uid(1), uid(2)
    await apply(store, new_dispatches=((uid(11), e1), (uid(21), e2)))
    await apply(store, new_dispatches=((uid(12), e1),))

    def owners(tx: Tx) -> list[str | None]:
        return [tx.dispatch_owner(d) for d in (uid(11), uid(12), uid(21), uid(99))]

    assert await store.run(owners) == [e1, e1, e2, None]


# == events ==========================================================================


async def test_events_append_in_order_and_page(store: Store) -> None:
    e1 = uid(1)
    log = [make_event(e1, seq, f"type-{seq}") for seq in range(1, 8)]
    await apply(store, events=tuple(log[:3]))
    await apply(store, events=(log[3],))
    await apply(store, events=tuple(log[4:]))

    def events(after: int, limit: int) -> Awaitable[list[Event]]:
        return store.run(lambda tx: tx.events(e1, after_seq=after, limit=limit))

    assert await events(0, 100) == log
    assert await events(0, 3) == log[:3]
    assert await events(3, 3) == log[3:6]
    assert await events(6, 3) == log[6:]
    assert await events(7, 3) == []
    assert await events(2, 0) == []
    assert await events(0, 100) == log  # reads do not consume
    assert await store.run(lambda tx: tx.events(uid(2), after_seq=0, limit=10)) == []

    pages: list[Event] = []
    after = 0
    while page := await events(after, 2):
        pages.extend(page)
        after = page[-1].seq
    assert pages == log


async def test_events_of_two_executions_interleave_independently(store: Store) -> None:
    e1, e2 = uid(1), uid(2)
    await apply(store, events=(make_event(e1, 1), make_event(e2, 1), make_event(e1, 2)))
    await apply(store, events=(make_event(e2, 2), make_event(e1, 3), make_event(e2, 3)))
    assert await store.run(lambda tx: tx.events(e1, after_seq=0, limit=10)) == [
        make_event(e1, n) for n in (1, 2, 3)
    ]
    assert await store.run(lambda tx: tx.events(e2, after_seq=1, limit=10)) == [
        make_event(e2, n) for n in (2, 3)
    ]


def _partial_change(bad_events: tuple[Event, ...]) -> Change:
    """A Change that writes a bit of everything and then events that break the log."""
    return Change(
        executions=(make_execution(9, dispatch=make_dispatch(9)),),
        steps=(make_step(uid(9), "s-9"),),
        approvals=(make_approval(9, uid(9), "s-9", created_at=1.0, timeout_at=2.0),),
        counters=(counter_write(uid(9), 3), counter_write(uid(1), 8)),
        cleared_counters=(uid(1),),
        new_dispatches=((uid(99), uid(9)),),
        rate_buckets=(RateBucket(key="bucket-9", window_start=1.0, count=1),),
        events=(make_event(uid(9), 1), *bad_events),
    )


def _nothing_of_partial_change(tx: Tx) -> None:
    assert tx.execution(uid(9)) is None
    assert tx.step("s-9") is None
    assert tx.approval(uid(500_009)) is None
    assert read_counter(tx, uid(9)) is None
    assert read_counter(tx, uid(1)) == 2  # not cleared
    assert tx.dispatch_owner(uid(99)) is None
    assert tx.rate_bucket("bucket-9") is None
    assert tx.events(uid(9), after_seq=0, limit=10) == []
    assert tx.events(uid(1), after_seq=0, limit=10) == [
        make_event(uid(1), 1),
        make_event(uid(1), 2),
    ]


BAD_SEQUENCES = {
    "reuses a stored seq": (make_event(uid(1), 2),),
    "skips a seq": (make_event(uid(1), 4),),
    "starts a new log at 2": (make_event(uid(2), 2),),
    "repeats a seq within the change": (make_event(uid(1), 3), make_event(uid(1), 3)),
    "goes backwards within the change": (make_event(uid(1), 3), make_event(uid(1), 2)),
}


@pytest.mark.parametrize("bad", list(BAD_SEQUENCES.values()), ids=list(BAD_SEQUENCES))
async def test_event_seq_gap_or_reuse_raises_and_writes_nothing(
    store: Store, bad: tuple[Event, ...]
) -> None:
    await apply(store, events=(make_event(uid(1), 1), make_event(uid(1), 2)))
    await apply(store, counters=(counter_write(uid(1), 2),))

    with pytest.raises(ValueError, match="seq"):
        await store.run(lambda tx: tx.apply(_partial_change(bad)))
    await store.run(_nothing_of_partial_change)

    # `apply` itself is atomic: a command that catches the error keeps its
    # other writes, and nothing of the refused Change.
    def catches(tx: Tx) -> str:
        tx.apply(Change(executions=(make_execution(5),)))
        try:
            tx.apply(_partial_change(bad))
        except ValueError:
            return "refused"
        return "applied"

    assert await store.run(catches) == "refused"
    assert await get(store, uid(5)) == make_execution(5)
    await store.run(_nothing_of_partial_change)

    # The log goes on from where it was.
    await apply(store, events=(make_event(uid(1), 3),))
    assert [e.seq for e in await store.run(lambda tx: tx.events(uid(1), after_seq=0, limit=9))] == [
        1,
        2,
        3,
    ]


# == atomicity and concurrency ==========================================================


async def test_reads_see_earlier_writes_of_the_same_command(store: Store) -> None:
    def fn(tx: Tx) -> None:
        tx.apply(Change(executions=(make_execution(1),), counters=(counter_write(uid(1), 1),)))
        assert tx.execution(uid(1)) == make_execution(1)
        tx.apply(Change(events=(make_event(uid(1), 1),), counters=(counter_write(uid(1), 2),)))
        assert tx.events(uid(1), after_seq=0, limit=5) == [make_event(uid(1), 1)]
        assert read_counter(tx, uid(1)) == 2
        tx.apply(Change(events=(make_event(uid(1), 2),), cleared_counters=(uid(1),)))
        assert read_counter(tx, uid(1)) is None
        tx.put_agent(Agent(id="x", webhook_url="http://x.test", secret="s", registered_at=0.0))
        assert tx.agent("x") is not None
        assert tx.delete_agent("x") is True
        assert tx.agent("x") is None

    await store.run(fn)
    assert len(await store.run(lambda tx: tx.events(uid(1), after_seq=0, limit=5))) == 2


async def test_a_command_that_raises_leaves_nothing_and_its_error_propagates(
    store: Store,
) -> None:
    before = make_execution(1, dispatch=make_dispatch(1))
    agent = Agent(id=AGENT, webhook_url="http://a.test", secret="s", registered_at=0.0)
    await apply(
        store,
        executions=(before,),
        steps=(make_step(uid(1), "s-1"),),
        events=(make_event(uid(1), 1),),
        counters=(counter_write(uid(1), 4),),
        rate_buckets=(RateBucket(key="b", window_start=1.0, count=1),),
    )
    await store.run(lambda tx: tx.put_agent(agent))
    boom = Boom("on purpose")

    def fn(tx: Tx) -> None:
        tx.apply(
            Change(
                executions=(
                    dataclasses.replace(before, status=ExecutionStatus.FAILED, dispatch=None),
                    make_execution(2),
                ),
                steps=(
                    dataclasses.replace(make_step(uid(1), "s-1"), status=StepStatus.SUCCEEDED),
                    make_step(uid(2), "s-2"),
                ),
                approvals=(make_approval(1, uid(1), "s-1", created_at=1.0, timeout_at=2.0),),
                events=(make_event(uid(1), 2), make_event(uid(2), 1)),
                cleared_counters=(uid(1),),
                counters=(counter_write(uid(2), 1),),
                new_dispatches=((uid(77), uid(2)),),
                rate_buckets=(
                    RateBucket(key="b", window_start=2.0, count=9),
                    RateBucket(key="c", window_start=2.0, count=1),
                ),
            )
        )
        tx.put_agent(dataclasses.replace(agent, secret="changed"))
        tx.put_agent(dataclasses.replace(agent, id="new-agent"))
        assert tx.execution(uid(2)) is not None  # it was there, for a moment
        raise boom

    with pytest.raises(Boom) as caught:
        await store.run(fn)
    assert caught.value is boom

    def unchanged(tx: Tx) -> None:
        assert tx.execution(uid(1)) == before
        assert tx.execution(uid(2)) is None
        assert tx.step("s-1") == make_step(uid(1), "s-1")
        assert tx.step("s-2") is None
        assert tx.approval(uid(500_001)) is None
        assert tx.events(uid(1), after_seq=0, limit=9) == [make_event(uid(1), 1)]
        assert tx.events(uid(2), after_seq=0, limit=9) == []
        assert read_counter(tx, uid(1)) == 4
        assert read_counter(tx, uid(2)) is None
        assert tx.dispatch_owner(uid(77)) is None
        assert tx.rate_bucket("b") == RateBucket(key="b", window_start=1.0, count=1)
        assert tx.rate_bucket("c") is None
        assert tx.agents() == [agent]

    await store.run(unchanged)
    # And the store goes on: the same writes commit when nothing raises.
    await apply(store, events=(make_event(uid(1), 2),))
    assert len(await store.run(lambda tx: tx.events(uid(1), after_seq=0, limit=9))) == 2


async def _run_catching(store: Store, fn: Callable[[Tx], Any], results: dict[int, Any], i: int):
    try:
        results[i] = await store.run(fn)
    except Boom as err:
        results[i] = err


def _insert_then_maybe_raise(i: int) -> Callable[[Tx], int]:
    def fn(tx: Tx) -> int:
        tx.apply(
            Change(
                executions=(make_execution(i),),
                events=(make_event(uid(i), 1),),
                counters=(counter_write(uid(0), i),),
            )
        )
        if i % 3 == 0:
            raise Boom(i)
        return i

    return fn


async def _assert_only_non_raising_persisted(store: Store, results: dict[int, Any], n: int) -> None:
    kept = [i for i in range(1, n + 1) if i % 3]
    for i in range(1, n + 1):
        if i % 3:
            assert results[i] == i
        else:
            assert isinstance(results[i], Boom)
            assert results[i].args == (i,)
    listed = await store.run(
        lambda tx: tx.executions(agent_id="", status="", before_id="", limit=100)
    )
    assert sorted(e.id for e in listed) == [uid(i) for i in kept]

    def events(tx: Tx) -> dict[int, int]:
        return {i: len(tx.events(uid(i), after_seq=0, limit=9)) for i in range(1, n + 1)}

    assert await store.run(events) == {i: (1 if i % 3 else 0) for i in range(1, n + 1)}
    assert await store.run(lambda tx: read_counter(tx, uid(0))) == max(kept)


async def test_concurrent_commands_some_raising_only_the_others_persist(store: Store) -> None:
    results: dict[int, Any] = {}
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(1, 21):
                tg.start_soon(_run_catching, store, _insert_then_maybe_raise(i), results, i)
    await _assert_only_non_raising_persisted(store, results, 20)


async def test_commands_are_serialised(store: Store) -> None:
    e1 = uid(1)
    seen: list[int] = []

    def increment(tx: Tx) -> int:
        current = read_counter(tx, e1)
        value = 0 if current is None else current + 1
        bucket = tx.rate_bucket("calls")
        count = 1 if bucket is None else bucket.count + 1
        tx.apply(
            Change(
                counters=(counter_write(e1, value),),
                rate_buckets=(RateBucket(key="calls", window_start=0.0, count=count),),
            )
        )
        return value

    async def one() -> None:
        seen.append(await store.run(increment))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(200):
                tg.start_soon(one)
    assert sorted(seen) == list(range(200))  # each command saw the one before it
    assert await store.run(lambda tx: read_counter(tx, e1)) == 199
    assert await store.run(lambda tx: tx.rate_bucket("calls")) == RateBucket(
        key="calls", window_start=0.0, count=200
    )


async def test_cancelled_callers_never_wedge_the_store(store: Store) -> None:
    """Callers cancelled while other commands are in flight: each command is
    all-or-nothing, every caller that was not cancelled gets its answer, and
    the store keeps serving."""
    cancelled = {i for i in range(40) if i % 4 == 1}
    results: dict[int, int] = {}
    scopes: dict[int, anyio.CancelScope] = {i: anyio.CancelScope() for i in cancelled}

    def mark(i: int) -> Callable[[Tx], int]:
        def fn(tx: Tx) -> int:
            bucket = tx.rate_bucket("total")
            total = 1 if bucket is None else bucket.count + 1
            tx.apply(
                Change(
                    rate_buckets=(
                        RateBucket(key=f"job-{i}", window_start=0.0, count=1),
                        RateBucket(key="total", window_start=0.0, count=total),
                    )
                )
            )
            return i

        return fn

    async def job(i: int) -> None:
        scope = scopes.get(i)
        if scope is None:
            results[i] = await store.run(mark(i))
            return
        with scope:
            results[i] = await store.run(mark(i))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(job, i)
                if i in cancelled:
                    await anyio.lowlevel.checkpoint()
                    scopes[i].cancel()
        # Later commands still complete.
        assert await store.run(mark(99)) == 99

    for i in range(40):
        if i not in cancelled:
            assert results[i] == i

    def tally(tx: Tx) -> tuple[int, int]:
        marks = sum(tx.rate_bucket(f"job-{i}") is not None for i in [*range(40), 99])
        total = tx.rate_bucket("total")
        assert total is not None
        return marks, total.count

    marks, total = await store.run(tally)
    assert marks == total  # no command half-applied
    assert 40 - len(cancelled) + 1 <= total <= 41


async def test_run_after_close_raises_store_error(tmp_path: Path, anyio_backend: str) -> None:
    for kind in STORE_KINDS:
        (tmp_path / kind).mkdir()
        closed = await open_store(kind, tmp_path / kind)
        await closed.close()
        await closed.close()  # closing twice is harmless
        with pytest.raises(StoreError):
            await closed.run(lambda tx: tx.execution(uid(1)))


# == sessions =========================================================================


async def test_session_busy(store: Store) -> None:
    await apply(
        store,
        executions=(
            *tuple(
                make_execution(n, status=status, session=f"s-{status.value}")
                for n, status in enumerate(ExecutionStatus, start=1)
            ),
            make_execution(20, status=ExecutionStatus.COMPLETED, session="mixed"),
            make_execution(21, status=ExecutionStatus.BLOCKED, session="mixed"),
        ),
    )

    def busy(tx: Tx) -> dict[str, bool]:
        names = [f"s-{s.value}" for s in ExecutionStatus] + ["mixed", "unknown"]
        return {name: tx.session_busy(name) for name in names}

    assert await store.run(busy) == {
        "s-pending": True,
        "s-running": True,
        "s-blocked": True,
        "s-completed": False,
        "s-failed": False,
        "s-cancelled": False,
        "mixed": True,
        "unknown": False,
    }


async def test_session_head_and_next(store: Store) -> None:
    done = ExecutionStatus.COMPLETED
    await apply(
        store,
        executions=(
            make_execution(1, status=done, session="chat", updated_at=10.0),
            make_execution(2, status=done, session="chat", updated_at=20.0),
            make_execution(3, status=ExecutionStatus.FAILED, session="chat", updated_at=30.0),
            make_execution(4, status=ExecutionStatus.CANCELLED, session="chat", updated_at=40.0),
            make_execution(5, status=ExecutionStatus.RUNNING, session="chat", updated_at=45.0),
            make_execution(6, agent=OTHER_AGENT, status=done, session="chat", updated_at=50.0),
            make_execution(7, status=done, session="elsewhere", updated_at=60.0),
            make_execution(9, status=ExecutionStatus.PENDING, session="chat"),
            make_execution(8, status=ExecutionStatus.PENDING, session="chat"),
            make_execution(10, agent=OTHER_AGENT, status=ExecutionStatus.PENDING, session="chat"),
            make_execution(11, status=ExecutionStatus.PENDING, session="elsewhere"),
        ),
    )

    def heads(tx: Tx) -> list[str | None]:
        found = [
            tx.session_head("chat", AGENT),
            tx.session_head("chat", OTHER_AGENT),
            tx.session_head("chat", "agent-c"),
            tx.session_head("elsewhere", OTHER_AGENT),
            tx.session_head("nowhere", AGENT),
        ]
        return [None if e is None else e.id for e in found]

    assert await store.run(heads) == [uid(2), uid(6), None, None, None]
    head = await store.run(lambda tx: tx.session_head("chat", AGENT))
    assert head == make_execution(2, status=done, session="chat", updated_at=20.0)

    def nexts(tx: Tx) -> list[str | None]:
        found = [
            tx.session_next("chat", ""),
            tx.session_next("chat", uid(5)),
            tx.session_next("chat", uid(8)),
            tx.session_next("elsewhere", ""),
            tx.session_next("elsewhere", uid(11)),
            tx.session_next("nowhere", ""),
        ]
        return [None if e is None else e.id for e in found]

    assert await store.run(nexts) == [uid(8), uid(8), uid(9), uid(11), None, None]

    # A newer completion becomes the head; a later failure does not.
    await apply(
        store,
        executions=(
            make_execution(5, status=done, session="chat", updated_at=70.0),
            make_execution(9, status=ExecutionStatus.FAILED, session="chat", updated_at=80.0),
        ),
    )
    assert await store.run(heads) == [uid(5), uid(6), None, None, None]
    assert await store.run(nexts) == [uid(8), uid(8), uid(10), uid(11), None, None]


async def test_sessions_through_the_rules(store: Store) -> None:
    await register(store, AGENT, OTHER_AGENT)
    kernel = Driver(store)
    a = await kernel.create(AGENT, 100.0, session="chat")
    b = await kernel.create(AGENT, 101.0, session="chat", input='{"turn":2}')
    c = await kernel.create(OTHER_AGENT, 102.0, session="chat")
    other = await kernel.create(AGENT, 103.0, session="elsewhere")
    assert a.status is ExecutionStatus.RUNNING
    assert a.parent_execution_id is None
    assert b.status is ExecutionStatus.PENDING
    assert b.dispatch is None
    assert c.status is ExecutionStatus.PENDING
    assert other.status is ExecutionStatus.RUNNING
    assert await store.run(lambda tx: tx.session_busy("chat")) is True
    assert await store.run(lambda tx: tx.session_next("chat", a.id)) == b
    assert await store.run(lambda tx: tx.due_dispatches(1e9, 10)) == [a.id, other.id]

    delivery = await kernel.claim(a.id, 110.0)
    assert delivery is not None
    await kernel.end(a.id, delivery.lease(), 120.0, output='"hi"', state='{"n":1}')

    # a completed: it is agent a's head, and b (same agent) continues it.
    b = await get(store, b.id)
    assert b.status is ExecutionStatus.RUNNING
    assert b.parent_execution_id == a.id
    assert await store.run(lambda tx: tx.session_head("chat", AGENT)) == await get(store, a.id)
    assert await store.run(lambda tx: tx.session_next("chat", b.id)) == c
    assert [e.type for e in kernel.events_of(b.id)] == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
    ]

    delivery = await kernel.claim(b.id, 130.0)
    assert delivery is not None
    await kernel.end(b.id, delivery.lease(), 140.0, failure="agent_error: boom")

    # b failed: never a head. c (another agent) starts with no parent.
    assert await store.run(lambda tx: tx.session_head("chat", AGENT)) == await get(store, a.id)
    c = await get(store, c.id)
    assert c.status is ExecutionStatus.RUNNING
    assert c.parent_execution_id is None
    assert await store.run(lambda tx: tx.session_head("chat", OTHER_AGENT)) is None

    delivery = await kernel.claim(c.id, 150.0)
    assert delivery is not None
    await kernel.end(c.id, delivery.lease(), 160.0, output="3")
    assert await store.run(lambda tx: tx.session_head("chat", OTHER_AGENT)) == await get(
        store, c.id
    )
    assert await store.run(lambda tx: tx.session_head("chat", AGENT)) == await get(store, a.id)
    assert await store.run(lambda tx: tx.session_busy("chat")) is False
    assert await store.run(lambda tx: tx.session_busy("elsewhere")) is True

    # A new execution in the session continues agent a's head at once.
    d = await kernel.create(AGENT, 170.0, session="chat")
    assert d.status is ExecutionStatus.RUNNING
    assert d.parent_execution_id == a.id
    await kernel.assert_store_matches()


# == approvals ==========================================================================


async def test_approvals(store: Store) -> None:
    e1, e2 = uid(1), uid(2)
    s1 = make_step(e1, "s-1", status=StepStatus.AWAITING_APPROVAL)
    s2 = make_step(e1, "s-2", status=StepStatus.AWAITING_APPROVAL, target="deploy")
    s3 = make_step(e1, "s-3", status=StepStatus.ALLOWED)
    s4 = make_step(e2, "s-4", status=StepStatus.AWAITING_APPROVAL)
    a1 = dataclasses.replace(
        make_approval(1, e1, "s-1", created_at=10.0, timeout_at=100.0),
        approvers=("alice", "b\u00f6b"),
        message="ok to search?",
        rule_id="rule-7",
    )
    a2 = make_approval(2, e1, "s-2", created_at=5.0, timeout_at=200.0)
    a3 = dataclasses.replace(
        make_approval(3, e1, "s-3", status=ApprovalStatus.GRANTED, created_at=1.0, timeout_at=9.0),
        decided_by="alice",
        decided_at=3.5,
        rationale="fine",
    )
    a4 = make_approval(4, e2, "s-4", created_at=20.0, timeout_at=50.0)
    await apply(store, steps=(s1, s2, s3, s4), approvals=(a1, a2, a3, a4))

    assert await store.run(lambda tx: [tx.approval(a.id) for a in (a1, a2, a3, a4)]) == [
        a1,
        a2,
        a3,
        a4,
    ]
    assert await store.run(lambda tx: tx.approval(uid(1))) is None

    def listing(status: str, limit: int = 10) -> Awaitable[list[Approval]]:
        return store.run(lambda tx: tx.approvals(status=status, limit=limit))

    assert await listing("pending") == [a2, a1, a4]  # oldest first
    assert await listing("pending", limit=2) == [a2, a1]
    assert await listing("granted") == [a3]
    assert await listing("denied") == []
    assert await listing("") == [a3, a2, a1, a4]

    pending = await store.run(lambda tx: tx.pending_approvals(e1))
    assert sorted(pending, key=lambda pair: pair[0].id) == [(a1, s1), (a2, s2)]
    assert await store.run(lambda tx: tx.pending_approvals(e2)) == [(a4, s4)]
    assert await store.run(lambda tx: tx.pending_approvals(uid(3))) == []

    def due(now: float, limit: int = 10) -> Awaitable[list[str]]:
        return store.run(lambda tx: tx.due_approvals(now, limit))

    assert await due(1_000.0) == [a4.id, a1.id, a2.id]  # soonest timeout first
    assert await due(100.0) == [a4.id, a1.id]  # timing out exactly now counts
    assert await due(100.0, limit=1) == [a4.id]
    assert await due(49.0) == []
    assert await store.run(lambda tx: tx.next_approval_at()) == 50.0

    decided = dataclasses.replace(
        a4, status=ApprovalStatus.DENIED, decided_by="carol", decided_at=30.0
    )
    await apply(store, approvals=(decided,))
    assert await store.run(lambda tx: tx.approval(a4.id)) == decided
    assert await store.run(lambda tx: tx.pending_approvals(e2)) == []
    assert await due(1_000.0) == [a1.id, a2.id]
    assert await store.run(lambda tx: tx.next_approval_at()) == 100.0
    assert await listing("denied") == [decided]

    expired = (
        dataclasses.replace(a1, status=ApprovalStatus.EXPIRED),
        dataclasses.replace(a2, status=ApprovalStatus.EXPIRED),
    )
    await apply(store, approvals=expired)
    assert await store.run(lambda tx: tx.next_approval_at()) is None
    assert await due(1e12) == []


# == agents and rate buckets ================================================================


async def test_agents(store: Store) -> None:
    full = Agent(
        id="agent-b",
        webhook_url="http://b.test/hook",
        secret="s-b",
        registered_at=2.5,
        description="B \u00e9",
        input_schema='{"type":"object"}',
        output_schema='{"type":"string"}',
        policy="rules: []\n",
    )
    bare = Agent(id="agent-c", webhook_url="http://c.test", secret="s-c", registered_at=3.0)
    first = Agent(id="agent-a", webhook_url="http://a.test", secret="s-a", registered_at=1.0)

    def put(*agents: Agent) -> Awaitable[None]:
        def fn(tx: Tx) -> None:
            for agent in agents:
                tx.put_agent(agent)

        return store.run(fn)

    assert await store.run(lambda tx: tx.agents()) == []
    await put(full, bare, first)
    assert await store.run(lambda tx: tx.agents()) == [first, full, bare]  # sorted by id
    assert await store.run(lambda tx: tx.agent("agent-b")) == full
    assert await store.run(lambda tx: tx.agent("agent-x")) is None

    replaced = Agent(id="agent-b", webhook_url="http://b2.test", secret="new", registered_at=9.0)
    await put(replaced)
    assert await store.run(lambda tx: tx.agent("agent-b")) == replaced  # None fields too

    assert await store.run(lambda tx: tx.delete_agent("agent-b")) is True
    assert await store.run(lambda tx: tx.delete_agent("agent-b")) is False
    assert await store.run(lambda tx: tx.delete_agent("never")) is False
    assert await store.run(lambda tx: tx.agent("agent-b")) is None
    assert await store.run(lambda tx: tx.agents()) == [first, bare]


async def test_rate_buckets(store: Store) -> None:
    assert await store.run(lambda tx: tx.rate_bucket("k")) is None
    first = RateBucket(key="k", window_start=60.0, count=1)
    other = RateBucket(key="agent-a:rule-1", window_start=0.5, count=7)
    await apply(store, rate_buckets=(first, other))
    assert await store.run(lambda tx: tx.rate_bucket("k")) == first
    assert await store.run(lambda tx: tx.rate_bucket("agent-a:rule-1")) == other
    later = RateBucket(key="k", window_start=120.0, count=0)
    await apply(store, rate_buckets=(later,))
    assert await store.run(lambda tx: tx.rate_bucket("k")) == later
    assert await store.run(lambda tx: tx.rate_bucket("agent-a:rule-1")) == other


# == the kernel's rules end to end ==============================================================


async def test_lifecycle_through_the_rules(store: Store) -> None:
    await register(store, AGENT)
    kernel = Driver(store)

    ex = await kernel.create(AGENT, 1_000.0, input='{"task":"book"}')
    assert await get(store, ex.id) == ex
    assert ex.status is ExecutionStatus.RUNNING
    assert ex.dispatch is not None
    first_dispatch = ex.dispatch.id
    assert [e.type for e in kernel.events_of(ex.id)] == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
    ]
    assert await store.run(lambda tx: tx.dispatch_owner(first_dispatch)) == ex.id
    assert await store.run(lambda tx: tx.due_dispatches(1_000.0, 10)) == [ex.id]
    assert await store.run(lambda tx: tx.due_dispatches(999.0, 10)) == []
    assert await store.run(lambda tx: tx.next_dispatch_at()) == 1_000.0

    # Claim and deliver: the lease is held while the handler runs.
    delivery = await kernel.claim(ex.id, 1_001.0)
    assert delivery is not None
    assert delivery.attempt == 1
    lease = delivery.lease()
    assert await store.run(lambda tx: tx.due_dispatches(1e9, 10)) == []
    assert await store.run(lambda tx: tx.next_dispatch_at()) is None
    assert await store.run(lambda tx: tx.oldest_lease_at()) == 1_001.0
    assert await store.run(lambda tx: tx.lapsed_leases(1_000.5, 10)) == []
    assert await store.run(lambda tx: tx.lapsed_leases(1_001.0, 10)) == [ex.id]
    await kernel.deliver(ex.id, lease, 1_002.0, acked=True)
    assert await store.run(lambda tx: tx.oldest_lease_at()) == 1_002.0

    # Two identical calls get occurrences 0 and 1.
    search = submission("search", '{"q":"flights"}')
    digest = args_digest(ex.id, search)
    d0 = await kernel.submit(ex.id, lease, search, 1_003.0)
    d1 = await kernel.submit(ex.id, lease, search, 1_004.0)
    assert (d0.decision, d1.decision) == (Decision.PROCEED, Decision.PROCEED)
    assert d0.step_id != d1.step_id
    assert await store.run(lambda tx: tx.counter(ex.id, StepKind.TOOL_CALL, "search", digest)) == 1
    active = await store.run(lambda tx: tx.active_steps(ex.id))
    assert sorted(s.step_id for s in active) == sorted([d0.step_id, d1.step_id])
    assert {s.occurrence for s in active} == {0, 1}

    recorded = await kernel.finish_step(ex.id, lease, d0.step_id, 1_005.0, result='{"hits":3}')
    assert recorded.decision is Decision.RECORDED
    terminal = await store.run(lambda tx: tx.steps(ex.id, terminal_only=True))
    assert [(s.step_id, s.status, s.result) for s in terminal] == [
        (d0.step_id, StepStatus.SUCCEEDED, '{"hits":3}')
    ]
    assert [s.step_id for s in await store.run(lambda tx: tx.active_steps(ex.id))] == [d1.step_id]

    pay = submission("pay", '{"amount":5}', Idempotency.AT_MOST_ONCE)
    pay_digest = args_digest(ex.id, pay)
    dp = await kernel.submit(ex.id, lease, pay, 1_006.0)
    assert dp.decision is Decision.PROCEED

    # The lease lapses; the reaper requeues; the next claim clears the counters.
    assert await kernel.reclaim(ex.id, 2_000.0)
    assert await store.run(lambda tx: tx.due_dispatches(2_000.0, 10)) == [ex.id]
    delivery = await kernel.claim(ex.id, 2_001.0)
    assert delivery is not None
    assert delivery.attempt == 2
    assert delivery.dispatch_id == first_dispatch
    lease = delivery.lease()
    assert (
        await store.run(lambda tx: tx.counter(ex.id, StepKind.TOOL_CALL, "search", digest)) is None
    )
    assert (
        await store.run(lambda tx: tx.counter(ex.id, StepKind.TOOL_CALL, "pay", pay_digest)) is None
    )

    # Replay from occurrence 0: the recorded result comes back.
    replay = await kernel.submit(ex.id, lease, search, 2_002.0)
    assert (replay.decision, replay.step_id, replay.result) == (
        Decision.REPLAY,
        d0.step_id,
        '{"hits":3}',
    )
    assert await store.run(lambda tx: tx.counter(ex.id, StepKind.TOOL_CALL, "search", digest)) == 0

    # The orphaned at_most_once step becomes indeterminate; a retry is refused.
    assert not await store.run(
        lambda tx: tx.has_indeterminate(ex.id, StepKind.TOOL_CALL, "pay", pay_digest)
    )
    orphan = await kernel.submit(ex.id, lease, pay, 2_003.0)
    assert (orphan.decision, orphan.error) == (Decision.REPLAY, INDETERMINATE_ERROR)
    assert await store.run(
        lambda tx: tx.has_indeterminate(ex.id, StepKind.TOOL_CALL, "pay", pay_digest)
    )
    retry = await kernel.submit(ex.id, lease, pay, 2_004.0)
    assert retry.decision is Decision.DENIED
    assert retry.rule_id == "__indeterminate_retry"
    assert (await store.run(lambda tx: tx.step(retry.step_id))).status is StepStatus.DENIED  # type: ignore[union-attr]

    # A step held for approval blocks the execution and retires the dispatch.
    deploy = submission("deploy", '{"env":"prod"}')
    held = await kernel.submit(
        ex.id,
        lease,
        deploy,
        2_010.0,
        verdict=Verdict(action=Action.REQUIRE_APPROVAL, rule_id="ask", approval_timeout_s=60.0),
    )
    assert held.decision is Decision.BLOCKED
    assert held.approval_id is not None
    approval_id = held.approval_id
    blocked = await get(store, ex.id)
    assert blocked.status is ExecutionStatus.BLOCKED
    assert blocked.dispatch is not None
    assert blocked.dispatch.status is DispatchStatus.EXHAUSTED
    assert await store.run(lambda tx: tx.lapsed_leases(1e12, 10)) == []
    assert await store.run(lambda tx: tx.due_dispatches(1e12, 10)) == []
    pending = await store.run(lambda tx: tx.pending_approvals(ex.id))
    assert [(a.id, s.step_id, s.status) for a, s in pending] == [
        (approval_id, held.step_id, StepStatus.AWAITING_APPROVAL)
    ]
    assert await store.run(lambda tx: tx.next_approval_at()) == 2_070.0
    assert await store.run(lambda tx: tx.due_approvals(2_070.0, 10)) == [approval_id]

    # Granted: the step is allowed, the execution resumes with a new dispatch.
    await kernel.decide(approval_id, ApprovalChoice.GRANT, 2_020.0)
    resumed = await get(store, ex.id)
    assert resumed.status is ExecutionStatus.RUNNING
    assert resumed.dispatch is not None
    assert resumed.dispatch.id != first_dispatch
    assert await store.run(lambda tx: tx.dispatch_owner(resumed.dispatch.id)) == ex.id  # type: ignore[union-attr]
    assert await store.run(lambda tx: tx.dispatch_owner(first_dispatch)) == ex.id
    assert await store.run(lambda tx: tx.pending_approvals(ex.id)) == []
    assert await store.run(lambda tx: tx.next_approval_at()) is None
    assert held.step_id in {s.step_id for s in await store.run(lambda tx: tx.active_steps(ex.id))}
    assert (await store.run(lambda tx: tx.approval(approval_id))).status is ApprovalStatus.GRANTED  # type: ignore[union-attr]

    delivery = await kernel.claim(ex.id, 2_021.0)
    assert delivery is not None
    assert delivery.attempt == 1
    lease = delivery.lease()
    # The first dispatch's lease is superseded now; an id never issued is unknown.
    stale = await kernel.submit_raw(
        ex.id, Lease(dispatch_id=first_dispatch, attempt=2), search, 2_021.5
    )
    assert isinstance(stale, Refusal)
    assert stale.code is ErrorCode.LEASE_SUPERSEDED
    unknown = await kernel.submit_raw(ex.id, Lease(dispatch_id=uid(1), attempt=1), search, 2_021.5)
    assert isinstance(unknown, Refusal)
    assert unknown.code is ErrorCode.VALIDATION_ERROR
    for sub in (search, pay, pay):
        await kernel.submit(ex.id, lease, sub, 2_022.0)
    run = await kernel.submit(ex.id, lease, deploy, 2_023.0)
    assert (run.decision, run.step_id) == (Decision.PROCEED, held.step_id)
    await kernel.finish_step(ex.id, lease, held.step_id, 2_024.0, error='{"message":"503"}')

    await kernel.end(ex.id, lease, 2_100.0, output='{"booked":true}')
    done = await get(store, ex.id)
    assert done.status is ExecutionStatus.COMPLETED
    assert done.output == '{"booked":true}'
    assert done.dispatch is not None
    assert done.dispatch.status is DispatchStatus.EXHAUSTED
    assert kernel.events_of(ex.id)[-1].type == "execution.completed"
    await kernel.assert_store_matches()


async def test_cancel_through_the_rules(store: Store) -> None:
    await register(store, AGENT)
    kernel = Driver(store)
    ex = await kernel.create(AGENT, 10.0)
    delivery = await kernel.claim(ex.id, 11.0)
    assert delivery is not None
    lease = delivery.lease()
    running = await kernel.submit(ex.id, lease, submission("long_job"), 12.0)
    held = await kernel.submit(
        ex.id,
        lease,
        submission("deploy"),
        13.0,
        verdict=Verdict(action=Action.REQUIRE_APPROVAL, approval_timeout_s=100.0),
    )
    assert held.decision is Decision.BLOCKED
    assert len(await store.run(lambda tx: tx.pending_approvals(ex.id))) == 1
    assert [s.step_id for s in await store.run(lambda tx: tx.active_steps(ex.id))] == [
        running.step_id
    ]

    await kernel.cancel(ex.id, 20.0)
    cancelled = await get(store, ex.id)
    assert cancelled.status is ExecutionStatus.CANCELLED
    assert await store.run(lambda tx: tx.active_steps(ex.id)) == []
    assert await store.run(lambda tx: tx.pending_approvals(ex.id)) == []
    assert await store.run(lambda tx: tx.next_approval_at()) is None
    steps = {s.step_id: s for s in await store.run(lambda tx: tx.steps(ex.id))}
    assert steps[running.step_id].status is StepStatus.CANCELLED
    assert steps[held.step_id].status is StepStatus.DENIED
    assert [e.type for e in kernel.events_of(ex.id)][-4:] == [
        "execution.cancelled",
        "approval.expired",
        "step.denied",
        "step.cancelled",
    ]
    await kernel.assert_store_matches()


async def test_approval_expiry_through_the_rules(store: Store) -> None:
    await register(store, AGENT)
    kernel = Driver(store)
    ex = await kernel.create(AGENT, 10.0)
    delivery = await kernel.claim(ex.id, 11.0)
    assert delivery is not None
    held = await kernel.submit(
        ex.id,
        delivery.lease(),
        submission("deploy"),
        12.0,
        verdict=Verdict(action=Action.REQUIRE_APPROVAL, approval_timeout_s=30.0),
    )
    assert held.approval_id is not None
    assert await store.run(lambda tx: tx.due_approvals(41.9, 10)) == []
    assert await store.run(lambda tx: tx.due_approvals(42.0, 10)) == [held.approval_id]
    assert await kernel.expire(held.approval_id, 42.0)
    assert await store.run(lambda tx: tx.due_approvals(1e9, 10)) == []
    assert (await store.run(lambda tx: tx.step(held.step_id))).status is StepStatus.DENIED  # type: ignore[union-attr]
    resumed = await get(store, ex.id)
    assert resumed.status is ExecutionStatus.RUNNING
    assert await store.run(lambda tx: tx.due_dispatches(42.0, 10)) == [ex.id]
    await kernel.assert_store_matches()


async def test_delivery_retries_until_exhausted_through_the_rules(store: Store) -> None:
    await register(store, AGENT)
    kernel = Driver(store)
    ex = await kernel.create(AGENT, 0.0)
    now = 0.0
    for attempt in range(1, SETTINGS.max_attempts + 1):
        delivery = await kernel.claim(ex.id, now)
        assert delivery is not None
        assert delivery.attempt == attempt
        await kernel.deliver(ex.id, delivery.lease(), now, acked=False)
        if attempt == SETTINGS.max_attempts:
            break
        due_at = await store.run(lambda tx: tx.next_dispatch_at())
        assert due_at is not None
        assert due_at > now
        assert await due_dispatches(store, due_at - 0.001) == []
        assert await due_dispatches(store, due_at) == [ex.id]
        now = due_at
    failed = await get(store, ex.id)
    assert failed.status is ExecutionStatus.FAILED
    assert failed.failure_reason == "dispatch_exhausted"
    assert await store.run(lambda tx: tx.next_dispatch_at()) is None
    assert await store.run(lambda tx: tx.oldest_lease_at()) is None
    await kernel.assert_store_matches()


# == SQLite only ===========================================================================


def _latest_migration() -> int:
    folder = resources.files("rebuno_anyio").joinpath("migrations")
    return max(int(f.name[:4]) for f in folder.iterdir() if f.name.endswith(".sql"))


async def _populate(store: Store) -> Driver:
    await register(store, AGENT, OTHER_AGENT)
    kernel = Driver(store)
    ex = await kernel.create(AGENT, 10.0, session="chat", key="k-1")
    queued = await kernel.create(OTHER_AGENT, 11.0, session="chat")
    delivery = await kernel.claim(ex.id, 12.0)
    assert delivery is not None
    lease = delivery.lease()
    step = await kernel.submit(ex.id, lease, submission("search", '{"q":"x"}'), 13.0)
    await kernel.finish_step(ex.id, lease, step.step_id, 14.0, result='"found"')
    await kernel.submit(ex.id, lease, submission("search", '{"q":"x"}'), 15.0)
    await kernel.submit(
        ex.id,
        lease,
        submission("deploy"),
        16.0,
        verdict=Verdict(action=Action.REQUIRE_APPROVAL, approval_timeout_s=60.0),
    )
    await apply(store, rate_buckets=(RateBucket(key="r", window_start=1.5, count=3),))
    assert queued.status is ExecutionStatus.PENDING
    return kernel


def _snapshot(tx: Tx) -> dict[str, Any]:
    executions = tx.executions(agent_id="", status="", before_id="", limit=100)
    return {
        "executions": executions,
        "steps": {e.id: tx.steps(e.id) for e in executions},
        "events": {e.id: tx.events(e.id, after_seq=0, limit=1_000) for e in executions},
        "counters": {
            s.step_id: tx.counter(s.execution_id, s.kind, s.target, s.args_hash)
            for e in executions
            for s in tx.steps(e.id)
        },
        "owners": {
            e.dispatch.id: tx.dispatch_owner(e.dispatch.id) for e in executions if e.dispatch
        },
        "approvals": tx.approvals(status="", limit=100),
        "pending": {e.id: tx.pending_approvals(e.id) for e in executions},
        "agents": tx.agents(),
        "bucket": tx.rate_bucket("r"),
        "due": (tx.due_dispatches(1e12, 100), tx.next_dispatch_at()),
        "leases": (tx.lapsed_leases(1e12, 100), tx.oldest_lease_at()),
        "timers": (tx.due_approvals(1e12, 100), tx.next_approval_at()),
        "sessions": (
            tx.session_busy("chat"),
            tx.session_head("chat", AGENT),
            tx.session_next("chat", ""),
        ),
        "by_key": tx.execution_by_key(AGENT, "k-1"),
    }


async def test_sqlite_survives_reopen(tmp_path: Path, anyio_backend: str) -> None:
    path = str(tmp_path / "k.db")
    store = await SQLiteStore.open(path)
    try:
        kernel = await _populate(store)
        before = await store.run(_snapshot)
    finally:
        await store.close()

    reopened = await SQLiteStore.open(path)
    try:
        assert reopened.schema_version() == _latest_migration()
        # A clean close saved the in-memory occurrence counters too: the next
        # kernel resumes with every lease in force.
        assert reopened.resumed_cleanly
        assert any(v is not None for v in before["counters"].values())
        assert await reopened.run(_snapshot) == before
        assert before["executions"]
        assert before["approvals"]
        assert before["pending"]
        kernel.store = reopened
        await kernel.assert_store_matches()
        # And it keeps working where it left off.
        ex = before["by_key"]
        await apply(reopened, events=(make_event(ex.id, ex.last_event_seq + 1),))
        events = await reopened.run(lambda tx: tx.events(ex.id, after_seq=0, limit=999))
        assert [e.seq for e in events] == list(range(1, ex.last_event_seq + 2))
    finally:
        await reopened.close()


async def test_sqlite_one_kernel_per_file(tmp_path: Path, anyio_backend: str) -> None:
    path = str(tmp_path / "k.db")
    first = await SQLiteStore.open(path)
    try:
        await apply(first, executions=(make_execution(1),))
        with pytest.raises(StoreError, match="in use"):
            await SQLiteStore.open(path)
        # The failed attempt did not disturb the first store.
        await apply(first, executions=(make_execution(2),))
        assert await get(first, uid(2)) == make_execution(2)
    finally:
        await first.close()
    second = await SQLiteStore.open(path)
    try:
        assert await get(second, uid(1)) == make_execution(1)
    finally:
        await second.close()

    # `:memory:` databases are private to their store.
    one, two = await SQLiteStore.open(":memory:"), await SQLiteStore.open(":memory:")
    try:
        await apply(one, executions=(make_execution(1),))
        assert await two.run(lambda tx: tx.execution(uid(1))) is None
    finally:
        await one.close()
        await two.close()


@pytest.mark.parametrize(("mode", "pragma"), [("FULL", 2), ("NORMAL", 1), ("normal", 1)])
async def test_sqlite_synchronous_setting(
    tmp_path: Path, anyio_backend: str, mode: str, pragma: int
) -> None:
    store = await SQLiteStore.open(str(tmp_path / "k.db"), synchronous=mode)
    try:
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == pragma
        await apply(store, executions=(make_execution(1),))
        assert await get(store, uid(1)) == make_execution(1)
    finally:
        await store.close()
    default = await SQLiteStore.open(str(tmp_path / "k.db"))
    try:
        assert default._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    finally:
        await default.close()


@pytest.mark.parametrize("mode", ["OFF", "fast", "", "FULL; DROP TABLE executions", "2"])
async def test_sqlite_synchronous_garbage_is_rejected(
    tmp_path: Path, anyio_backend: str, mode: str
) -> None:
    path = tmp_path / "k.db"
    with pytest.raises(ValueError, match="synchronous"):
        await SQLiteStore.open(str(path), synchronous=mode)
    assert not path.exists()


async def test_sqlite_refuses_files_it_cannot_use(tmp_path: Path, anyio_backend: str) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_bytes(b"These are my notes, not a database.\n" * 200)
    for _ in range(2):  # a failed open leaves nothing locked behind
        with pytest.raises(StoreError, match=r"notes\.txt"):
            await SQLiteStore.open(str(junk))
    assert junk.read_bytes() == b"These are my notes, not a database.\n" * 200

    with pytest.raises(StoreError):
        await SQLiteStore.open(str(tmp_path / "missing-dir" / "k.db"))
    with pytest.raises(StoreError):
        await SQLiteStore.open(str(tmp_path))  # a directory


async def test_sqlite_refuses_a_newer_schema(tmp_path: Path, anyio_backend: str) -> None:
    path = str(tmp_path / "k.db")
    store = await SQLiteStore.open(path)
    await apply(store, executions=(make_execution(1),))
    await store.close()
    newer = _latest_migration() + 1
    with sqlite3.connect(path) as raw:
        raw.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?, 0)", (newer,))
    raw.close()

    for _ in range(2):  # and the refused open does not leave the file locked
        with pytest.raises(StoreError, match="newer"):
            await SQLiteStore.open(path)

    with sqlite3.connect(path) as raw:
        raw.execute("DELETE FROM schema_migrations WHERE version = ?", (newer,))
    raw.close()
    store = await SQLiteStore.open(path)
    try:
        assert store.schema_version() == _latest_migration()
        assert await get(store, uid(1)) == make_execution(1)
    finally:
        await store.close()


async def test_sqlite_a_failed_commit_is_reported_and_the_store_recovers(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Another process holds the write lock (a backup tool, the sqlite3 shell):
    the waiting commands fail with StoreError instead of hanging, and the store
    works again once the lock is gone."""
    path = str(tmp_path / "k.db")
    store = await SQLiteStore.open(path)
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        store._conn.execute("PRAGMA busy_timeout = 20")  # fail fast for the test
        raw.execute("BEGIN IMMEDIATE")
        errors: list[BaseException] = []

        async def attempt(n: int) -> None:
            try:
                await apply(store, executions=(make_execution(n),))
            except StoreError as err:
                errors.append(err)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for n in range(1, 6):
                    tg.start_soon(attempt, n)
        assert len(errors) == 5
        raw.execute("ROLLBACK")
        with anyio.fail_after(10):
            await apply(store, executions=(make_execution(9),))
        assert await get(store, uid(9)) == make_execution(9)
        assert await store.run(lambda tx: tx.execution(uid(1))) is None
    finally:
        raw.close()
        await store.close()


class _HeldLeader:
    """Makes the SQLite store's group-commit leader wait inside its batch, so
    the test can queue commands behind it deterministically."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, tx: Tx) -> str:
        self.started.set()
        if not self.release.wait(10):
            raise TimeoutError("the test never released the leader")
        tx.apply(Change(executions=(make_execution(1_000),)))
        return "leader"

    async def wait_started(self) -> None:
        assert await anyio.to_thread.run_sync(self.started.wait, 10)


@pytest.fixture
def held() -> Iterator[_HeldLeader]:
    leader = _HeldLeader()
    yield leader
    leader.release.set()


async def test_sqlite_group_commit_rolls_back_each_failing_command_alone(
    sqlite_store: SQLiteStore, held: _HeldLeader
) -> None:
    results: dict[int, Any] = {}

    async def queue(i: int, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        await _run_catching(sqlite_store, _insert_then_maybe_raise(i), results, i)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_run_catching, sqlite_store, held, results, 0)
            await held.wait_started()
            for i in range(1, 21):
                await tg.start(queue, i)  # queued: all twenty share the next batch
            held.release.set()
    assert results[0] == "leader"
    del results[0]
    await _assert_only_non_raising_persisted_with_leader(sqlite_store, results)


async def _assert_only_non_raising_persisted_with_leader(
    store: Store, results: dict[int, Any]
) -> None:
    assert await get(store, uid(1_000)) == make_execution(1_000)
    kept = [i for i in range(1, 21) if i % 3]
    for i in range(1, 21):
        if i % 3:
            assert results[i] == i
        else:
            assert isinstance(results[i], Boom)
            assert results[i].args == (i,)
    listed = await store.run(
        lambda tx: tx.executions(agent_id="", status="", before_id=uid(1_000), limit=100)
    )
    assert sorted(e.id for e in listed) == [uid(i) for i in kept]
    assert await store.run(lambda tx: read_counter(tx, uid(0))) == max(kept)


def _insert(n: int) -> Callable[[Tx], int]:
    def fn(tx: Tx) -> int:
        tx.apply(Change(executions=(make_execution(n),)))
        return n

    return fn


async def test_sqlite_cancelled_waiters_do_not_wedge_the_queue(
    sqlite_store: SQLiteStore, held: _HeldLeader
) -> None:
    """Cancel callers queued behind the leader (all of them, then the one
    chosen to lead next): later commands still run."""
    results: dict[Any, Any] = {}
    scopes = {i: anyio.CancelScope() for i in (1, 2, 3)}

    async def queue(i: int, *, task_status: TaskStatus[None]) -> None:
        with scopes[i]:
            task_status.started()
            results[i] = await sqlite_store.run(_insert(10 + i))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_run_catching, sqlite_store, held, results, 0)
            await held.wait_started()
            for i in (1, 2, 3):
                await tg.start(queue, i)
            for scope in scopes.values():
                scope.cancel()  # every waiter is gone before the leader finishes
            held.release.set()
        assert all(scope.cancelled_caught for scope in scopes.values())
        assert results == {0: "leader"}
        assert await sqlite_store.run(lambda tx: tx.execution(uid(1_000))) is not None

        # Now cancel the caller chosen to lead the next batch, after it was
        # chosen but before it ran: the one queued behind it still gets served.
        second = _HeldLeader()
        successor = anyio.CancelScope()

        async def leader_then_cancel() -> None:
            results["leader"] = await sqlite_store.run(second)
            successor.cancel()  # runs before the woken successor does

        async def chosen(*, task_status: TaskStatus[None]) -> None:
            with successor:
                task_status.started()
                results["chosen"] = await sqlite_store.run(_insert(41))

        async def behind(*, task_status: TaskStatus[None]) -> None:
            task_status.started()
            results["behind"] = await sqlite_store.run(_insert(52))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(leader_then_cancel)
                await second.wait_started()
                await tg.start(chosen)
                await tg.start(behind)
                second.release.set()
        finally:
            second.release.set()
        assert results["leader"] == "leader"
        assert results["behind"] == 52
        assert await get(sqlite_store, uid(52)) == make_execution(52)
        assert await sqlite_store.run(lambda tx: tx.execution(uid(99))) is None
        await apply(sqlite_store, executions=(make_execution(99),))
        assert await get(sqlite_store, uid(99)) == make_execution(99)


async def test_sqlite_after_a_crash_counters_are_gone_and_nothing_resumes(
    tmp_path: Path, anyio_backend: str
) -> None:
    path = str(tmp_path / "k.db")
    store = await SQLiteStore.open(path)
    assert not store.resumed_cleanly  # a new file
    await apply(store, counters=(counter_write(uid(1), 4),))
    store._close_sync()  # the process dies: no clean close, nothing saved

    crashed = await SQLiteStore.open(path)
    try:
        assert not crashed.resumed_cleanly
        assert await crashed.run(lambda tx: read_counter(tx, uid(1))) is None
        await apply(crashed, counters=(counter_write(uid(1), 2),))
    finally:
        await crashed.close()

    resumed = await SQLiteStore.open(path)
    assert resumed.resumed_cleanly
    assert await resumed.run(lambda tx: read_counter(tx, uid(1))) == 2
    resumed._close_sync()  # and a crash after a clean resume: no stale counters
    again = await SQLiteStore.open(path)
    try:
        assert not again.resumed_cleanly
        assert await again.run(lambda tx: read_counter(tx, uid(1))) is None
    finally:
        await again.close()

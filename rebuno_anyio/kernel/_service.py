"""The kernel service: every command as one transaction over the pure core.

For each command (DESIGN.md, "How the kernel core meets storage"): the store
runs a synchronous function in one exclusive transaction; it loads exactly the
records the core needs, calls the core rule, writes the returned `Change`, and
the service acts on the wake-ups only after the commit (wake the dispatcher,
re-arm the approval timer, notify event watchers).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections.abc import Callable
from operator import methodcaller
from typing import Any, TypeVar

import anyio

from rebuno_proto import (
    Agent,
    ApprovalChoice,
    Created,
    CreateExecution,
    Delivery,
    DeliveryResult,
    DispatchSettings,
    ErrorCode,
    Event,
    Execution,
    ExecutionCompletion,
    ExecutionFailure,
    KernelCommands,
    Lease,
    Outcome,
    Refusal,
    StepDecision,
    StepSubmission,
    allow_all,
    check_owner,
    lease_owner,
    lease_refusal,
    previous_state,
    submission_hash,
)

from .._ids import uuid7
from ..policy import PolicyHook
from ..store import Store, Tx
from ._metrics import KernelMetrics

__all__ = ["Kernel"]

R = TypeVar("R")


def _not_found(what: str = "execution") -> Refusal:
    return Refusal(ErrorCode.NOT_FOUND, f"{what} not found")


class _Waiters:
    """The long polls waiting for an execution's next event: one event they
    all wait on, and how many they are (the last to leave removes it)."""

    __slots__ = ("count", "event")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.count = 0


class Kernel:
    """Runs kernel commands against a store.

    Args:
        store: where records live.
        settings: lease timeout, delivery attempts, backoff.
        clock: wall-clock Unix seconds (leases and timeouts survive restarts).
        new_id: source of new UUIDv7 ids.
        jitter: source of backoff jitter in [0, 1).
        policy: evaluates policy for new steps; allows everything by default.
    """

    def __init__(
        self,
        store: Store,
        *,
        settings: DispatchSettings | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = uuid7,
        jitter: Callable[[], float] = random.random,
        policy: PolicyHook = allow_all,
    ) -> None:
        self.store = store
        self.settings = settings or DispatchSettings()
        self.clock = clock
        self.new_id = new_id
        self.jitter = jitter
        self.policy = policy
        self.commands = KernelCommands(settings=self.settings, new_id=new_id, policy=policy)
        self.metrics = KernelMetrics()
        self._agents: dict[str, Agent] = {}
        self._agent_writes = 0  # agent writes completed (tells a read its value is stale)
        self._event_waiters: dict[str, _Waiters] = {}  # long polls, by execution
        self.on_dispatch_due: Callable[[float], None] = lambda at: None
        self.on_timer_due: Callable[[float], None] = lambda at: None

    # -- plumbing ------------------------------------------------------------------

    async def _command(self, rule: Callable[[Tx, float], Outcome[R]]) -> R | Refusal:
        now = self.clock()

        def run(tx: Tx) -> Outcome[R]:
            outcome = rule(tx, now)
            if not outcome.change.is_empty:
                tx.apply(outcome.change)
            return outcome

        # Shielded: once the command is queued it commits whether or not its
        # caller is still waiting (the SQLite store shields its batch and runs
        # abandoned commands too), so the caller must stay for the wake-ups
        # after the commit -- a cancelled request would otherwise leave a new
        # dispatch unannounced until the next poll, an approval timer unarmed
        # and long polls asleep. Nothing here awaits anything else.
        with anyio.CancelScope(shield=True):
            try:
                outcome = await self.store.run(run)
            except Exception:
                self.metrics.command(ok=False)
                raise
            self.metrics.command(ok=True)
            self._after_commit(outcome)
        return outcome.reply

    def _after_commit(self, outcome: Outcome[Any]) -> None:
        if outcome.dispatch_due_at is not None:
            self.on_dispatch_due(outcome.dispatch_due_at)
        if outcome.timer_due_at is not None:
            self.on_timer_due(outcome.timer_due_at)
        if outcome.change.events:
            self.metrics.committed(outcome.change.events)
            for execution_id in {e.execution_id for e in outcome.change.events}:
                waiter = self._event_waiters.pop(execution_id, None)
                if waiter is not None:
                    waiter.event.set()

    async def read(self, fn: Callable[[Tx], R]) -> R:
        """Run a read-only query in a transaction."""
        return await self.store.run(fn)

    # -- agents ----------------------------------------------------------------------

    async def agent(self, agent_id: str) -> Agent | None:
        """The registered agent. Cached (the kernel is the only writer); unknown
        ids are not cached, so made-up ids in requests cannot grow the cache."""
        cached = self._agents.get(agent_id)
        if cached is not None:
            return cached
        writes = self._agent_writes
        found = await self.store.run(lambda tx: tx.agent(agent_id))
        if found is not None and writes == self._agent_writes:
            # No agent write completed while this read ran, so `found` is current.
            self._agents[agent_id] = found
        return found

    async def _write_agent(self, agent_id: str, fn: Callable[[Tx], R]) -> R:
        """Run an agent write, then forget the cached agent (the next read
        reloads it); a read still in flight will not cache what it saw before.
        Shielded like `_command`: a write that committed must not leave the
        old agent (its old secret, URL or policy) in the cache."""
        with anyio.CancelScope(shield=True):
            try:
                result = await self.store.run(fn)
            finally:
                self._agent_writes += 1
                self._agents.pop(agent_id, None)
        return result

    async def put_agent(self, agent: Agent) -> None:
        await self._write_agent(agent.id, lambda tx: tx.put_agent(agent))

    async def register_agent(self, agent_id: str, *, webhook_url: str, secret: str) -> Agent:
        """Register an agent, or change its URL and secret, in one transaction:
        a re-registration keeps the registration time, metadata and policy."""
        now = self.clock()

        def run(tx: Tx) -> Agent:
            existing = tx.agent(agent_id)
            if existing is None:
                agent = Agent(
                    id=agent_id, webhook_url=webhook_url, secret=secret, registered_at=now
                )
            else:
                agent = dataclasses.replace(existing, webhook_url=webhook_url, secret=secret)
            tx.put_agent(agent)
            return agent

        return await self._write_agent(agent_id, run)

    async def delete_agent(self, agent_id: str) -> bool:
        return await self._write_agent(agent_id, lambda tx: tx.delete_agent(agent_id))

    async def update_agent(self, agent_id: str, **fields: Any) -> Agent | None:
        """Change fields of a registered agent (metadata, policy); `None` if unknown."""

        def run(tx: Tx) -> Agent | None:
            agent = tx.agent(agent_id)
            if agent is None:
                return None
            agent = dataclasses.replace(agent, **fields)
            tx.put_agent(agent)
            return agent

        return await self._write_agent(agent_id, run)

    # -- client commands ---------------------------------------------------------------

    async def create(self, request: CreateExecution) -> Created | Refusal:
        return await self._command(lambda tx, now: self.commands.create(tx, request, now))

    async def cancel(self, execution_id: str) -> Refusal | None:
        return await self._command(lambda tx, now: self.commands.cancel(tx, execution_id, now))

    async def decide_approval(
        self, approval_id: str, choice: ApprovalChoice, *, decided_by: str, rationale: str
    ) -> Refusal | None:
        return await self._command(
            lambda tx, now: self.commands.decide_approval(
                tx, approval_id, choice, decided_by=decided_by, rationale=rationale, now=now
            )
        )

    # -- agent commands ------------------------------------------------------------------

    async def submit(
        self, execution_id: str, caller: str, lease: Lease, submission: StepSubmission
    ) -> StepDecision | Refusal:
        digest = submission_hash(submission)  # outside the transaction
        return await self._command(
            lambda tx, now: self.commands.submit(
                tx, execution_id, caller, lease, submission, now, args_hash=digest
            )
        )

    async def finish_step(
        self,
        execution_id: str,
        step_id: str,
        caller: str,
        lease: Lease,
        *,
        result: str | None = None,
        error: str | None = None,
    ) -> StepDecision | Refusal:
        """Record a step's result (`result`) or failure (`error`)."""
        return await self._command(
            lambda tx, now: self.commands.finish_step(
                tx, execution_id, step_id, caller, lease, now, result=result, error=error
            )
        )

    async def heartbeat(self, execution_id: str, caller: str, lease: Lease) -> Refusal | None:
        return await self._command(
            lambda tx, now: self.commands.heartbeat(tx, execution_id, caller, lease, now)
        )

    async def end(
        self,
        execution_id: str,
        caller: str,
        lease: Lease,
        ending: ExecutionCompletion | ExecutionFailure,
    ) -> Refusal | None:
        """The agent completes or fails its execution."""
        return await self._command(
            lambda tx, now: self.commands.end(tx, execution_id, caller, lease, ending, now)
        )

    async def check_lease(self, execution_id: str, caller: str, lease: Lease) -> Refusal | None:
        """Read-only: may this lease act (used for best-effort stream deltas)?"""

        def run(tx: Tx) -> Refusal | None:
            execution = tx.execution(execution_id)
            if execution is None:
                return _not_found()
            refusal = check_owner(execution, caller)
            if refusal is not None:
                return refusal
            return lease_refusal(
                execution, lease, lease_owner(tx, execution, lease), allow_retired=True
            )

        return await self.store.run(run)

    # -- reads -------------------------------------------------------------------------

    async def execution(self, execution_id: str, caller: str | None = None) -> Execution | Refusal:
        def run(tx: Tx) -> Execution | Refusal:
            execution = tx.execution(execution_id)
            if execution is None:
                return _not_found()
            return check_owner(execution, caller) or execution

        return await self.store.run(run)

    async def previous(self, execution_id: str, caller: str | None) -> str | Refusal:
        def run(tx: Tx) -> str | Refusal:
            execution = tx.execution(execution_id)
            if execution is None:
                return _not_found()
            refusal = check_owner(execution, caller)
            if refusal is not None:
                return refusal
            parent = (
                tx.execution(execution.parent_execution_id)
                if execution.parent_execution_id
                else None
            )
            return previous_state(parent)

        return await self.store.run(run)

    async def events(
        self, execution_id: str, *, after_seq: int, limit: int, wait_s: float = 0.0
    ) -> list[Event] | Refusal:
        """Events after `after_seq`; with `wait_s`, wait up to that long for the
        first new one (a long poll) instead of returning an empty page."""

        def run(tx: Tx) -> list[Event] | Refusal:
            if tx.execution(execution_id) is None:
                return _not_found()
            return tx.events(execution_id, after_seq=after_seq, limit=limit)

        if wait_s <= 0:  # only a long poll registers a waiter: plain reads leave no trace
            return await self.store.run(run)
        deadline = anyio.current_time() + wait_s
        while True:
            # Registered before the read, so an event committed between the
            # read and the wait still wakes this poll.
            waiters = self._event_waiters.get(execution_id)
            if waiters is None:
                waiters = self._event_waiters[execution_id] = _Waiters()
            waiters.count += 1
            try:
                found = await self.store.run(run)
                if isinstance(found, Refusal) or found or anyio.current_time() >= deadline:
                    return found
                with anyio.move_on_after(deadline - anyio.current_time()):
                    await waiters.event.wait()
            finally:
                # The last poll to leave takes the entry away (unless an event
                # already did, and another poll registered a new one since).
                waiters.count -= 1
                if waiters.count == 0 and self._event_waiters.get(execution_id) is waiters:
                    del self._event_waiters[execution_id]

    # -- background work: the dispatcher, reaper and timers call these -----------------------

    async def claim(self, execution_id: str) -> Delivery | None:
        reply = await self._command(lambda tx, now: self.commands.claim(tx, execution_id, now))
        return None if isinstance(reply, Refusal) else reply

    async def delivered(self, delivery: Delivery, result: DeliveryResult) -> None:
        """Record how a webhook POST went (see `rebuno_proto.record_delivery`)."""
        jitter = self.jitter()
        await self._command(
            lambda tx, now: self.commands.delivered(
                tx, delivery, result=result, jitter=jitter, now=now
            )
        )

    async def reclaim(self, execution_id: str) -> bool:
        reply = await self._command(lambda tx, now: self.commands.reclaim(tx, execution_id, now))
        return reply is True

    async def retire_leases(self) -> int:
        """At start: retire every lease granted before (see
        `rebuno_proto.retire_lease_after_restart`); returns how many."""
        count, after = 0, ""
        while True:
            page: list[str] = await self.store.run(methodcaller("leased", after, 200))
            for execution_id in page:
                retired = await self._command(
                    functools.partial(self.commands.retire_after_restart, execution_id=execution_id)
                )
                count += retired is True
            if len(page) < 200:
                return count
            after = page[-1]

    async def expire(self, approval_id: str) -> bool:
        reply = await self._command(lambda tx, now: self.commands.expire(tx, approval_id, now))
        return reply is True

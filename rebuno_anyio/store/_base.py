"""The store contract: what the kernel reads and writes, and how a command runs.

A store is dumb persistence. The kernel runs each command as a synchronous
function `fn(tx)` inside one transaction (`Store.run`): it reads the records the
pure core asks for through `tx`, calls the core, and writes the returned
`Change` with `tx.apply`. Stores serialise commands (SQLite has one writer;
memory runs them one at a time), which is the per-execution lock DESIGN.md asks
for, and a command that raises leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from rebuno_proto import (
    Agent,
    Approval,
    Change,
    Event,
    Execution,
    RateBucket,
    Step,
    StepKind,
)

__all__ = ["Store", "StoreError", "Tx"]

T = TypeVar("T")


class StoreError(Exception):
    """The store could not do what was asked (I/O error, corrupt file, wrong schema)."""


class Tx(Protocol):
    """One transaction: reads see every earlier write of the same transaction."""

    # -- executions, steps, counters ----------------------------------------
    def execution(self, execution_id: str) -> Execution | None: ...
    def step(self, step_id: str) -> Step | None: ...
    def counter(
        self, execution_id: str, kind: StepKind, target: str, args_hash: str
    ) -> int | None: ...
    def dispatch_owner(self, dispatch_id: str) -> str | None: ...
    def has_indeterminate(
        self, execution_id: str, kind: StepKind, target: str, args_hash: str
    ) -> bool: ...
    def steps(self, execution_id: str, *, terminal_only: bool = False) -> list[Step]: ...
    def active_steps(self, execution_id: str) -> list[Step]: ...
    def events(self, execution_id: str, *, after_seq: int, limit: int) -> list[Event]: ...
    def executions(
        self, *, agent_id: str, status: str, before_id: str, limit: int
    ) -> list[Execution]: ...
    def execution_by_key(self, agent_id: str, idempotency_key: str) -> Execution | None: ...

    # -- sessions ---------------------------------------------------------------
    def session_busy(self, session: str) -> bool: ...
    def session_head(self, session: str, agent_id: str) -> Execution | None: ...
    def session_next(self, session: str, excluding: str) -> Execution | None: ...

    # -- approvals ----------------------------------------------------------------
    def approval(self, approval_id: str) -> Approval | None: ...
    def approvals(self, *, status: str, limit: int) -> list[Approval]: ...
    def pending_approvals(self, execution_id: str) -> list[tuple[Approval, Step]]: ...

    # -- background work ------------------------------------------------------------
    def due_dispatches(self, now: float, limit: int) -> list[str]: ...
    def next_dispatch_at(self) -> float | None: ...
    def lapsed_leases(self, locked_before: float, limit: int) -> list[str]: ...
    def oldest_lease_at(self) -> float | None: ...
    def leased(self, after_id: str, limit: int) -> list[str]:
        """Unfinished executions (ids above `after_id`, ascending) whose dispatch
        may hold a lease (`rebuno_proto.holds_lease`)."""
        ...

    def due_approvals(self, now: float, limit: int) -> list[str]: ...
    def next_approval_at(self) -> float | None: ...

    # -- agents and rate limits --------------------------------------------------------
    def agent(self, agent_id: str) -> Agent | None: ...
    def agents(self) -> list[Agent]: ...
    def put_agent(self, agent: Agent) -> None: ...
    def delete_agent(self, agent_id: str) -> bool: ...
    def rate_bucket(self, key: str) -> RateBucket | None: ...

    # -- writes -------------------------------------------------------------------------
    def apply(self, change: Change) -> None: ...


class Store(Protocol):
    """Runs commands as transactions."""

    async def run(self, fn: Callable[[Tx], T]) -> T:
        """Run `fn` in one exclusive transaction and commit; return its result.

        If `fn` raises, nothing it wrote is kept and the exception propagates.
        The commit is durable (under the store's durability setting) before this
        returns.
        """
        ...

    async def close(self) -> None:
        """Close; a clean close lets the next open resume (`resumed_cleanly`)."""
        ...

    @property
    def resumed_cleanly(self) -> bool:
        """Whether the previous kernel shut down cleanly and everything in
        memory it needed (the occurrence counters) was restored: then the leases
        it granted stay in force across the restart."""
        ...

    @property
    def description(self) -> str: ...

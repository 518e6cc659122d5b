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
    Records,
    Step,
)

__all__ = ["Store", "StoreError", "Tx"]

T = TypeVar("T")


class StoreError(Exception):
    """The store could not do what was asked (I/O error, corrupt file, wrong schema)."""


class Tx(Records, Protocol):
    """One transaction: reads see every earlier write of the same transaction.

    It reads what the kernel commands need (`rebuno_proto.Records`), and what
    the API, the dispatcher and the CLI list and page through.
    """

    def steps(self, execution_id: str, *, terminal_only: bool = False) -> list[Step]: ...
    def events(self, execution_id: str, *, after_seq: int, limit: int) -> list[Event]: ...
    def executions(
        self, *, agent_id: str, status: str, before_id: str, limit: int
    ) -> list[Execution]: ...
    def approvals(self, *, status: str, limit: int) -> list[Approval]: ...

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

    # -- agents -------------------------------------------------------------------------
    def agents(self) -> list[Agent]: ...
    def put_agent(self, agent: Agent) -> None: ...
    def delete_agent(self, agent_id: str) -> bool: ...

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

"""One command's reads and writes on the SQLite store's connection."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

from rebuno_proto import Agent, Approval, Change, Event, Execution, RateBucket, Step, StepKind

from ._counters import Counters
from ._sqlite_rows import (
    ACTIVE,
    AGENT_COLS,
    APPROVAL_COLS,
    APPROVAL_SELECT,
    EXEC_SELECT,
    EXEC_UPSERT,
    STEP_SELECT,
    STEP_UPSERT,
    agent_of,
    approval_of,
    approval_row,
    execution_of,
    execution_row,
    step_of,
    step_row,
)


class SQLiteTx:
    """Reads and writes of one command, on the store's connection."""

    __slots__ = ("_c", "_counters")

    def __init__(self, conn: sqlite3.Connection, counters: Counters) -> None:
        self._c = conn
        self._counters = counters

    def _one(self, sql: str, args: Iterable[Any]) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._c.execute(sql, tuple(args)).fetchone()
        return row

    def _all(self, sql: str, args: Iterable[Any]) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._c.execute(sql, tuple(args)).fetchall()
        return rows

    def execution(self, execution_id: str) -> Execution | None:
        row = self._one(f"{EXEC_SELECT} WHERE id = ?", (execution_id,))
        return None if row is None else execution_of(row)

    def step(self, step_id: str) -> Step | None:
        row = self._one(f"{STEP_SELECT} WHERE step_id = ?", (step_id,))
        return None if row is None else step_of(row)

    def counter(self, execution_id: str, kind: StepKind, target: str, args_hash: str) -> int | None:
        return self._counters.get((execution_id, kind.value, target, args_hash))

    def dispatch_owner(self, dispatch_id: str) -> str | None:
        row = self._one("SELECT execution_id FROM dispatches WHERE id = ?", (dispatch_id,))
        return None if row is None else str(row[0])

    def has_indeterminate(
        self, execution_id: str, kind: StepKind, target: str, args_hash: str
    ) -> bool:
        # The error's top-level `reason`, not the text anywhere in it.
        row = self._one(
            "SELECT 1 FROM steps WHERE execution_id = ? AND args_hash = ? AND kind = ? "
            "AND target = ? AND status = 'failed' AND CASE WHEN json_valid(error) "
            "THEN json_extract(error, '$.reason') END = 'indeterminate' LIMIT 1",
            (execution_id, args_hash, kind.value, target),
        )
        return row is not None

    def steps(self, execution_id: str, *, terminal_only: bool = False) -> list[Step]:
        where = (
            " AND status IN ('succeeded', 'failed', 'denied', 'cancelled')" if terminal_only else ""
        )
        rows = self._all(
            f"{STEP_SELECT} WHERE execution_id = ?{where} ORDER BY step_id", (execution_id,)
        )
        return [step_of(r) for r in rows]

    def active_steps(self, execution_id: str) -> list[Step]:
        rows = self._all(
            f"{STEP_SELECT} WHERE execution_id = ? AND status IN ('executing', 'allowed')",
            (execution_id,),
        )
        return [step_of(r) for r in rows]

    def events(self, execution_id: str, *, after_seq: int, limit: int) -> list[Event]:
        rows = self._all(
            "SELECT execution_id, seq, type, payload, occurred_at FROM events "
            "WHERE execution_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (execution_id, after_seq, limit),
        )
        return [
            Event(execution_id=r[0], seq=r[1], type=r[2], payload=r[3], occurred_at=r[4])
            for r in rows
        ]

    def executions(
        self, *, agent_id: str, status: str, before_id: str, limit: int
    ) -> list[Execution]:
        clauses, args = [], []
        if agent_id:
            clauses.append("agent_id = ?")
            args.append(agent_id)
        if status:
            clauses.append("status = ?")
            args.append(status)
        if before_id:
            clauses.append("id < ?")
            args.append(before_id)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._all(f"{EXEC_SELECT}{where} ORDER BY id DESC LIMIT ?", (*args, limit))
        return [execution_of(r) for r in rows]

    def execution_by_key(self, agent_id: str, idempotency_key: str) -> Execution | None:
        row = self._one(
            f"{EXEC_SELECT} WHERE agent_id = ? AND idempotency_key = ? "
            "AND idempotency_key != '' LIMIT 1",
            (agent_id, idempotency_key),
        )
        return None if row is None else execution_of(row)

    def session_busy(self, session: str) -> bool:
        row = self._one(
            f"SELECT 1 FROM executions WHERE session = ? AND session != '' "
            f"AND status IN {ACTIVE} LIMIT 1",
            (session,),
        )
        return row is not None

    def session_head(self, session: str, agent_id: str) -> Execution | None:
        row = self._one(
            f"{EXEC_SELECT} WHERE session = ? AND session != '' AND status = 'completed' "
            "AND agent_id = ? "
            "ORDER BY updated_at DESC, id DESC LIMIT 1",
            (session, agent_id),
        )
        return None if row is None else execution_of(row)

    def session_next(self, session: str, excluding: str) -> Execution | None:
        row = self._one(
            f"{EXEC_SELECT} WHERE session = ? AND session != '' AND status = 'pending' "
            "AND id != ? "
            "ORDER BY created_at, id LIMIT 1",
            (session, excluding),
        )
        return None if row is None else execution_of(row)

    def approval(self, approval_id: str) -> Approval | None:
        row = self._one(f"{APPROVAL_SELECT} WHERE id = ?", (approval_id,))
        return None if row is None else approval_of(row)

    def approvals(self, *, status: str, limit: int) -> list[Approval]:
        if status:
            rows = self._all(
                f"{APPROVAL_SELECT} WHERE status = ? ORDER BY created_at, id LIMIT ?",
                (status, limit),
            )
        else:
            rows = self._all(f"{APPROVAL_SELECT} ORDER BY created_at, id LIMIT ?", (limit,))
        return [approval_of(r) for r in rows]

    def pending_approvals(self, execution_id: str) -> list[tuple[Approval, Step]]:
        rows = self._all(
            f"{APPROVAL_SELECT} WHERE execution_id = ? AND status = 'pending'", (execution_id,)
        )
        found = []
        for row in rows:
            approval = approval_of(row)
            step = self.step(approval.step_id)
            if step is not None:
                found.append((approval, step))
        return found

    def due_dispatches(self, now: float, limit: int) -> list[str]:
        rows = self._all(
            "SELECT id FROM executions WHERE dispatch_status IN ('pending', 'failed') "
            "AND dispatch_next_attempt_at <= ? ORDER BY dispatch_next_attempt_at LIMIT ?",
            (now, limit),
        )
        return [r[0] for r in rows]

    def next_dispatch_at(self) -> float | None:
        row = self._one(
            "SELECT min(dispatch_next_attempt_at) FROM executions "
            "WHERE dispatch_status IN ('pending', 'failed')",
            (),
        )
        return None if row is None or row[0] is None else float(row[0])

    def lapsed_leases(self, locked_before: float, limit: int) -> list[str]:
        rows = self._all(
            "SELECT id FROM executions WHERE dispatch_status = 'in_flight' "
            "AND dispatch_locked_at <= ? ORDER BY dispatch_locked_at LIMIT ?",
            (locked_before, limit),
        )
        return [r[0] for r in rows]

    def oldest_lease_at(self) -> float | None:
        row = self._one(
            "SELECT min(dispatch_locked_at) FROM executions WHERE dispatch_status = 'in_flight'",
            (),
        )
        return None if row is None or row[0] is None else float(row[0])

    def leased(self, after_id: str, limit: int) -> list[str]:
        rows = self._all(
            "SELECT id FROM executions WHERE id > ? "
            "AND status NOT IN ('completed', 'failed', 'cancelled') "
            "AND (dispatch_status IN ('in_flight', 'pending', 'failed') "
            "OR (status = 'blocked' AND dispatch_status = 'exhausted')) ORDER BY id LIMIT ?",
            (after_id, limit),
        )
        return [r[0] for r in rows]

    def due_approvals(self, now: float, limit: int) -> list[str]:
        rows = self._all(
            "SELECT id FROM approvals WHERE status = 'pending' AND timeout_at <= ? "
            "ORDER BY timeout_at LIMIT ?",
            (now, limit),
        )
        return [r[0] for r in rows]

    def next_approval_at(self) -> float | None:
        row = self._one("SELECT min(timeout_at) FROM approvals WHERE status = 'pending'", ())
        return None if row is None or row[0] is None else float(row[0])

    def agent(self, agent_id: str) -> Agent | None:
        row = self._one(f"SELECT {AGENT_COLS} FROM agents WHERE id = ?", (agent_id,))
        return None if row is None else agent_of(row)

    def agents(self) -> list[Agent]:
        return [agent_of(r) for r in self._all(f"SELECT {AGENT_COLS} FROM agents ORDER BY id", ())]

    def put_agent(self, agent: Agent) -> None:
        self._c.execute(
            f"INSERT OR REPLACE INTO agents ({AGENT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                agent.id,
                agent.webhook_url,
                agent.secret,
                agent.registered_at,
                agent.description,
                agent.input_schema,
                agent.output_schema,
                agent.policy,
            ),
        )

    def delete_agent(self, agent_id: str) -> bool:
        return self._c.execute("DELETE FROM agents WHERE id = ?", (agent_id,)).rowcount > 0

    def rate_bucket(self, key: str) -> RateBucket | None:
        row = self._one("SELECT key, window_start, count FROM rate_buckets WHERE key = ?", (key,))
        return None if row is None else RateBucket(key=row[0], window_start=row[1], count=row[2])

    def _check_events(self, events: Iterable[Event]) -> None:
        """Refuse, before anything is written, events that would not continue
        their execution's log gap-free (the primary key alone lets a gap through)."""
        expected: dict[str, int] = {}
        for event in events:
            seq = expected.get(event.execution_id)
            if seq is None:
                row = self._one(
                    "SELECT coalesce(max(seq), 0) FROM events WHERE execution_id = ?",
                    (event.execution_id,),
                )
                seq = (0 if row is None else int(row[0])) + 1
            if event.seq != seq:
                raise ValueError(f"event seq {event.seq} of {event.execution_id} is not {seq}")
            expected[event.execution_id] = seq + 1

    def apply(self, change: Change) -> None:
        """Write a change atomically: all of it, or (if it raises) none of it."""
        c = self._c
        if change.events:
            self._check_events(change.events)
        c.execute("SAVEPOINT apply")
        try:
            self._write(change)
        except BaseException:
            c.execute("ROLLBACK TO apply")
            c.execute("RELEASE apply")
            raise
        c.execute("RELEASE apply")
        # Counters last: they are in memory and cannot fail.
        for execution_id in change.cleared_counters:
            self._counters.job.clear(execution_id)
        for w in change.counters:
            self._counters.put((w.execution_id, w.kind.value, w.target, w.args_hash), w.value)

    def _write(self, change: Change) -> None:
        c = self._c
        if change.executions:
            c.executemany(EXEC_UPSERT, [execution_row(e) for e in change.executions])
        if change.steps:
            c.executemany(STEP_UPSERT, [step_row(s) for s in change.steps])
        if change.approvals:
            c.executemany(
                f"INSERT OR REPLACE INTO approvals ({APPROVAL_COLS}) "
                f"VALUES ({', '.join('?' * 12)})",
                [approval_row(a) for a in change.approvals],
            )
        if change.new_dispatches:
            c.executemany(
                "INSERT INTO dispatches (id, execution_id) VALUES (?, ?)", change.new_dispatches
            )
        if change.rate_buckets:
            c.executemany(
                "INSERT OR REPLACE INTO rate_buckets (key, window_start, count) VALUES (?, ?, ?)",
                [(b.key, b.window_start, b.count) for b in change.rate_buckets],
            )
        if change.events:
            c.executemany(
                "INSERT INTO events (execution_id, seq, type, payload, occurred_at) "
                "VALUES (?, ?, ?, ?, ?)",
                [(e.execution_id, e.seq, e.type, e.payload, e.occurred_at) for e in change.events],
            )

"""The SQLite store: the embedded default (standard-library `sqlite3`, WAL).

Durability: `synchronous=FULL` by default, so every acknowledged command is on
disk before the kernel answers (WAL + FULL fsyncs the log at each commit);
`NORMAL` is an explicit opt-in that can lose the last commits on power loss
(never on a process crash).

Throughput: group commit. Commands queue up; one caller at a time is the
*leader* and runs everything queued so far in one transaction on a worker
thread (each command inside its own SAVEPOINT, so one that raises is rolled
back alone), commits once, wakes every waiter, and hands leadership to the next
waiting caller. Under load many commands share one fsync; alone, a command pays
one. The leader's batch is shielded from cancellation so no waiter is stranded.

One kernel per database file: the store holds an advisory `flock` on a lock
file beside it (`<db>.lock`), so a second kernel on the same file fails fast
with a clear message while backups and read-only tools still work. The lock is
on a separate file because closing any descriptor of the database file itself
would drop the POSIX locks SQLite holds on it in this process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
from collections import deque
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread

from rebuno_proto import (
    Agent,
    Approval,
    ApprovalStatus,
    Change,
    DispatchRecord,
    DispatchStatus,
    Event,
    Execution,
    ExecutionStatus,
    Idempotency,
    RateBucket,
    Step,
    StepKind,
    StepStatus,
)

from ._base import StoreError

__all__ = ["SQLiteStore"]

T = TypeVar("T")

_EXEC_STATUS: Final = {s.value: s for s in ExecutionStatus}
_STEP_STATUS: Final = {s.value: s for s in StepStatus}
_DISPATCH_STATUS: Final = {s.value: s for s in DispatchStatus}
_APPROVAL_STATUS: Final = {s.value: s for s in ApprovalStatus}
_KIND: Final = {k.value: k for k in StepKind}
_IDEMPOTENCY: Final = {i.value: i for i in Idempotency}
_SYNCHRONOUS: Final = ("FULL", "NORMAL", "EXTRA")


def _upsert(table: str, columns: str) -> str:
    """An upsert of whole records: every column but the key (the first) is replaced."""
    names = [c.strip() for c in columns.split(",")]
    updates = ", ".join(f"{c}=excluded.{c}" for c in names[1:])
    return (
        f"INSERT INTO {table} ({columns}) VALUES ({', '.join('?' * len(names))}) "
        f"ON CONFLICT({names[0]}) DO UPDATE SET {updates}"
    )


_EXEC_COLS: Final = (
    "id, agent_id, status, input, output, state, failure_reason, session, parent_execution_id, "
    "idempotency_key, created_at, updated_at, last_event_seq, dispatch_id, dispatch_status, "
    "dispatch_attempt, dispatch_max_attempts, dispatch_next_attempt_at, dispatch_locked_at"
)
_EXEC_SELECT: Final = f"SELECT {_EXEC_COLS} FROM executions"
_EXEC_UPSERT: Final = _upsert("executions", _EXEC_COLS)
_STEP_COLS: Final = (
    "step_id, execution_id, kind, target, args_hash, occurrence, status, idempotency, args, "
    "result, error, started_at, completed_at, approval_id, rule_id"
)
_STEP_SELECT: Final = f"SELECT {_STEP_COLS} FROM steps"
_STEP_UPSERT: Final = _upsert("steps", _STEP_COLS)
_APPROVAL_COLS: Final = (
    "id, execution_id, step_id, status, approvers, message, rule_id, decided_by, decided_at, "
    "rationale, created_at, timeout_at"
)
_APPROVAL_SELECT: Final = f"SELECT {_APPROVAL_COLS} FROM approvals"
_AGENT_COLS: Final = (
    "id, webhook_url, secret, registered_at, description, input_schema, output_schema, policy"
)
_ACTIVE: Final = "('pending', 'running', 'blocked')"


def _execution(row: tuple[Any, ...]) -> Execution:
    dispatch = None
    if row[13] is not None:
        dispatch = DispatchRecord(
            id=row[13],
            status=_DISPATCH_STATUS[row[14]],
            attempt=row[15],
            max_attempts=row[16],
            next_attempt_at=row[17],
            locked_at=row[18],
        )
    return Execution(
        id=row[0],
        agent_id=row[1],
        status=_EXEC_STATUS[row[2]],
        input=row[3],
        output=row[4],
        state=row[5],
        failure_reason=row[6],
        session=row[7],
        parent_execution_id=row[8],
        idempotency_key=row[9],
        created_at=row[10],
        updated_at=row[11],
        last_event_seq=row[12],
        dispatch=dispatch,
    )


def _execution_row(e: Execution) -> tuple[Any, ...]:
    d = e.dispatch
    return (
        e.id,
        e.agent_id,
        e.status.value,
        e.input,
        e.output,
        e.state,
        e.failure_reason,
        e.session,
        e.parent_execution_id,
        e.idempotency_key,
        e.created_at,
        e.updated_at,
        e.last_event_seq,
        None if d is None else d.id,
        None if d is None else d.status.value,
        None if d is None else d.attempt,
        None if d is None else d.max_attempts,
        None if d is None else d.next_attempt_at,
        None if d is None else d.locked_at,
    )


def _step(row: tuple[Any, ...]) -> Step:
    return Step(
        step_id=row[0],
        execution_id=row[1],
        kind=_KIND[row[2]],
        target=row[3],
        args_hash=row[4],
        occurrence=row[5],
        status=_STEP_STATUS[row[6]],
        idempotency=_IDEMPOTENCY[row[7]],
        args=row[8],
        result=row[9],
        error=row[10],
        started_at=row[11],
        completed_at=row[12],
        approval_id=row[13],
        rule_id=row[14],
    )


def _step_row(s: Step) -> tuple[Any, ...]:
    return (
        s.step_id,
        s.execution_id,
        s.kind.value,
        s.target,
        s.args_hash,
        s.occurrence,
        s.status.value,
        s.idempotency.value,
        s.args,
        s.result,
        s.error,
        s.started_at,
        s.completed_at,
        s.approval_id,
        s.rule_id,
    )


def _approval(row: tuple[Any, ...]) -> Approval:
    return Approval(
        id=row[0],
        execution_id=row[1],
        step_id=row[2],
        status=_APPROVAL_STATUS[row[3]],
        approvers=tuple(json.loads(row[4])),
        message=row[5],
        rule_id=row[6],
        decided_by=row[7],
        decided_at=row[8],
        rationale=row[9],
        created_at=row[10],
        timeout_at=row[11],
    )


def _approval_row(a: Approval) -> tuple[Any, ...]:
    return (
        a.id,
        a.execution_id,
        a.step_id,
        a.status.value,
        json.dumps(list(a.approvers)),
        a.message,
        a.rule_id,
        a.decided_by,
        a.decided_at,
        a.rationale,
        a.created_at,
        a.timeout_at,
    )


def _agent(row: tuple[Any, ...]) -> Agent:
    return Agent(
        id=row[0],
        webhook_url=row[1],
        secret=row[2],
        registered_at=row[3],
        description=row[4],
        input_schema=row[5],
        output_schema=row[6],
        policy=row[7],
    )


CounterKey = tuple[str, str, str, str]


class _CounterLayer:
    """Counter writes not yet committed: values set, executions cleared."""

    __slots__ = ("cleared", "values")

    def __init__(self) -> None:
        self.values: dict[CounterKey, int] = {}
        self.cleared: set[str] = set()

    def clear(self, execution_id: str) -> None:
        for key in [k for k in self.values if k[0] == execution_id]:
            del self.values[key]
        self.cleared.add(execution_id)

    def merge_into(self, lower: _CounterLayer) -> None:
        for execution_id in self.cleared:
            lower.clear(execution_id)
        lower.values.update(self.values)


class _Counters:
    """Occurrence counters, in memory only.

    They count the effects of one dispatch *attempt*, every claim clears them,
    and a kernel restart retires every lease granted before it
    (`rebuno_proto.retire_lease_after_restart`), so no counter ever needs to
    outlive the process: keeping them out of the file spares every submission a
    durable write. Writes follow the transaction: a command's own layer (its
    savepoint), the batch's layer, then the committed map.
    """

    __slots__ = ("batch", "by_execution", "committed", "job")

    def __init__(self) -> None:
        self.committed: dict[CounterKey, int] = {}
        self.by_execution: dict[str, set[CounterKey]] = {}
        self.batch = _CounterLayer()
        self.job = _CounterLayer()

    def get(self, key: CounterKey) -> int | None:
        for layer in (self.job, self.batch):
            if key in layer.values:
                return layer.values[key]
            if key[0] in layer.cleared:
                return None
        return self.committed.get(key)

    def put(self, key: CounterKey, value: int) -> None:
        current = self.get(key)
        self.job.values[key] = value if current is None else max(current, value)

    def end_job(self, *, keep: bool) -> None:
        if keep:
            self.job.merge_into(self.batch)
        self.job = _CounterLayer()

    def end_batch(self, *, keep: bool) -> None:
        self.end_job(keep=False)
        if keep:
            for execution_id in self.batch.cleared:
                for key in self.by_execution.pop(execution_id, ()):
                    self.committed.pop(key, None)
            for key, value in self.batch.values.items():
                self.committed[key] = value
                self.by_execution.setdefault(key[0], set()).add(key)
        self.batch = _CounterLayer()


class _SQLiteTx:
    """Reads and writes of one command, on the store's connection."""

    __slots__ = ("_c", "_counters")

    def __init__(self, conn: sqlite3.Connection, counters: _Counters) -> None:
        self._c = conn
        self._counters = counters

    def _one(self, sql: str, args: Iterable[Any]) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._c.execute(sql, tuple(args)).fetchone()
        return row

    def _all(self, sql: str, args: Iterable[Any]) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._c.execute(sql, tuple(args)).fetchall()
        return rows

    def execution(self, execution_id: str) -> Execution | None:
        row = self._one(f"{_EXEC_SELECT} WHERE id = ?", (execution_id,))
        return None if row is None else _execution(row)

    def step(self, step_id: str) -> Step | None:
        row = self._one(f"{_STEP_SELECT} WHERE step_id = ?", (step_id,))
        return None if row is None else _step(row)

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
            f"{_STEP_SELECT} WHERE execution_id = ?{where} ORDER BY step_id", (execution_id,)
        )
        return [_step(r) for r in rows]

    def active_steps(self, execution_id: str) -> list[Step]:
        rows = self._all(
            f"{_STEP_SELECT} WHERE execution_id = ? AND status IN ('executing', 'allowed')",
            (execution_id,),
        )
        return [_step(r) for r in rows]

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
        rows = self._all(f"{_EXEC_SELECT}{where} ORDER BY id DESC LIMIT ?", (*args, limit))
        return [_execution(r) for r in rows]

    def execution_by_key(self, agent_id: str, idempotency_key: str) -> Execution | None:
        row = self._one(
            f"{_EXEC_SELECT} WHERE agent_id = ? AND idempotency_key = ? "
            "AND idempotency_key != '' LIMIT 1",
            (agent_id, idempotency_key),
        )
        return None if row is None else _execution(row)

    def session_busy(self, session: str) -> bool:
        row = self._one(
            f"SELECT 1 FROM executions WHERE session = ? AND session != '' "
            f"AND status IN {_ACTIVE} LIMIT 1",
            (session,),
        )
        return row is not None

    def session_head(self, session: str, agent_id: str) -> Execution | None:
        row = self._one(
            f"{_EXEC_SELECT} WHERE session = ? AND session != '' AND status = 'completed' "
            "AND agent_id = ? "
            "ORDER BY updated_at DESC, id DESC LIMIT 1",
            (session, agent_id),
        )
        return None if row is None else _execution(row)

    def session_next(self, session: str, excluding: str) -> Execution | None:
        row = self._one(
            f"{_EXEC_SELECT} WHERE session = ? AND session != '' AND status = 'pending' "
            "AND id != ? "
            "ORDER BY created_at, id LIMIT 1",
            (session, excluding),
        )
        return None if row is None else _execution(row)

    def approval(self, approval_id: str) -> Approval | None:
        row = self._one(f"{_APPROVAL_SELECT} WHERE id = ?", (approval_id,))
        return None if row is None else _approval(row)

    def approvals(self, *, status: str, limit: int) -> list[Approval]:
        if status:
            rows = self._all(
                f"{_APPROVAL_SELECT} WHERE status = ? ORDER BY created_at, id LIMIT ?",
                (status, limit),
            )
        else:
            rows = self._all(f"{_APPROVAL_SELECT} ORDER BY created_at, id LIMIT ?", (limit,))
        return [_approval(r) for r in rows]

    def pending_approvals(self, execution_id: str) -> list[tuple[Approval, Step]]:
        rows = self._all(
            f"{_APPROVAL_SELECT} WHERE execution_id = ? AND status = 'pending'", (execution_id,)
        )
        found = []
        for row in rows:
            approval = _approval(row)
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
            "SELECT id FROM executions WHERE id > ? AND (dispatch_status = 'in_flight' "
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
        row = self._one(f"SELECT {_AGENT_COLS} FROM agents WHERE id = ?", (agent_id,))
        return None if row is None else _agent(row)

    def agents(self) -> list[Agent]:
        return [_agent(r) for r in self._all(f"SELECT {_AGENT_COLS} FROM agents ORDER BY id", ())]

    def put_agent(self, agent: Agent) -> None:
        self._c.execute(
            f"INSERT OR REPLACE INTO agents ({_AGENT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
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
            c.executemany(_EXEC_UPSERT, [_execution_row(e) for e in change.executions])
        if change.steps:
            c.executemany(_STEP_UPSERT, [_step_row(s) for s in change.steps])
        if change.approvals:
            c.executemany(
                f"INSERT OR REPLACE INTO approvals ({_APPROVAL_COLS}) "
                f"VALUES ({', '.join('?' * 12)})",
                [_approval_row(a) for a in change.approvals],
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


class _Job:
    __slots__ = ("abandoned", "error", "finished", "fn", "is_leader", "result", "wake")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.wake = anyio.Event()
        self.is_leader = False
        self.finished = False
        self.abandoned = False
        self.result: Any = None
        self.error: BaseException | None = None


def _migrations() -> list[tuple[int, str]]:
    folder = resources.files("rebuno_anyio").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        name = entry.name
        if name.endswith(".sql") and name[:4].isdigit():
            found.append((int(name[:4]), entry.read_text(encoding="utf-8")))
    return sorted(found)


class SQLiteStore:
    """A store in one SQLite file (or `:memory:`). Open with `await SQLiteStore.open(...)`."""

    def __init__(self, conn: sqlite3.Connection, *, path: str, lock_fd: int | None) -> None:
        self._conn = conn
        self._path = path
        self._lock_fd = lock_fd
        self._counters = _Counters()
        self._tx = _SQLiteTx(conn, self._counters)
        self._queue: deque[_Job] = deque()
        self._busy = False
        self._closed = False

    @property
    def description(self) -> str:
        return f"sqlite:{self._path}"

    @classmethod
    async def open(cls, path: str, *, synchronous: str = "FULL") -> SQLiteStore:
        """Open (and create or migrate) the database at `path`.

        Args:
            path: a file path, or `:memory:`.
            synchronous: `FULL` (default: every commit survives power loss) or
                `NORMAL` (faster; the last commits may be lost on power loss).

        Raises:
            StoreError: another kernel holds the file, or it is not a usable
                rebuno database.
        """
        mode = synchronous.upper()
        if mode not in _SYNCHRONOUS:
            raise ValueError(
                f"synchronous must be one of {', '.join(_SYNCHRONOUS)}, got {synchronous!r}"
            )
        return await anyio.to_thread.run_sync(cls._open_sync, path, mode)

    @classmethod
    def _open_sync(cls, path: str, synchronous: str) -> SQLiteStore:
        lock_fd = None
        if path != ":memory:":
            directory = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(directory):
                raise StoreError(f"cannot create {path}: directory {directory} does not exist")
            if os.path.isdir(path):
                raise StoreError(f"cannot open {path}: it is a directory")
            try:
                lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as err:
                raise StoreError(f"cannot open {path}: {err.strerror or err}") from err
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(lock_fd)
                raise StoreError(
                    f"{path} is in use by another rebuno kernel; stop it or use another --db"
                ) from None
        conn = None
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {synchronous}")
            conn.execute("PRAGMA busy_timeout = 5000")
            conn.execute("PRAGMA foreign_keys = OFF")
            conn.execute("PRAGMA cache_size = -65536")
            cls._migrate(conn)
        except BaseException as err:
            # Whatever went wrong (a file that is not a database, a newer schema),
            # leave nothing open: the file must not stay locked by this process.
            if conn is not None:
                conn.close()
            if lock_fd is not None:
                os.close(lock_fd)
            if isinstance(err, sqlite3.DatabaseError):
                raise StoreError(f"cannot open {path} as a rebuno database: {err}") from err
            raise
        return cls(conn, path=path, lock_fd=lock_fd)

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
        )
        applied = {r[0] for r in conn.execute("SELECT version FROM schema_migrations")}
        known = _migrations()
        newest = max((v for v, _ in known), default=0)
        if applied and max(applied) > newest:
            raise StoreError(
                f"database schema version {max(applied)} is newer than this kernel "
                f"understands ({newest}); upgrade rebuno-sansio"
            )
        for version, script in known:
            if version in applied:
                continue
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in script.split(";\n"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, applied_at) "
                    "VALUES (?, julianday('now'))",
                    (version,),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def schema_version(self) -> int:
        row = self._conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    # -- group commit --------------------------------------------------------------

    def _execute(self, batch: list[_Job]) -> None:
        conn = self._conn
        tx = self._tx
        try:
            # Inside the try: if the transaction cannot even begin (another
            # process holds the write lock past busy_timeout, the store was
            # closed), every job must still get an answer, or its caller and
            # every later one would wait forever.
            conn.execute("BEGIN IMMEDIATE")
            for job in batch:
                conn.execute("SAVEPOINT job")
                try:
                    job.result = job.fn(tx)
                except BaseException as err:
                    conn.execute("ROLLBACK TO job")
                    self._counters.end_job(keep=False)
                    job.error = err
                else:
                    self._counters.end_job(keep=True)
                conn.execute("RELEASE job")
            conn.execute("COMMIT")
            self._counters.end_batch(keep=True)
        except BaseException as err:
            self._counters.end_batch(keep=False)
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            failure = StoreError(f"commit failed: {err}")
            for job in batch:
                job.result = None
                job.error = failure

    async def _lead(self) -> None:
        with anyio.CancelScope(shield=True):
            while True:
                batch = list(self._queue)
                self._queue.clear()
                await anyio.to_thread.run_sync(self._execute, batch)
                for job in batch:
                    job.finished = True
                    job.wake.set()
                successor = next((j for j in self._queue if not j.abandoned), None)
                if successor is not None:
                    successor.is_leader = True
                    successor.wake.set()
                    return
                if not self._queue:
                    self._busy = False
                    return
                # Only abandoned (cancelled) commands wait: run them ourselves.

    async def run(self, fn: Callable[[Any], T]) -> T:
        if self._closed:
            raise StoreError("store is closed")
        job = _Job(fn)
        self._queue.append(job)
        if not self._busy:
            self._busy = True
            job.is_leader = True
        else:
            try:
                await job.wake.wait()
            except BaseException:
                if not job.is_leader and not job.finished:
                    job.abandoned = True
                raise
            finally:
                if job.is_leader and not job.finished:
                    await self._lead()
        if job.is_leader and not job.finished:
            await self._lead()
        if job.error is not None:
            raise job.error
        result: T = job.result
        return result

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await anyio.to_thread.run_sync(self._close_sync)

    def _close_sync(self) -> None:
        try:
            self._conn.close()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

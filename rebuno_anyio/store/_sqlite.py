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
import os
import sqlite3
from collections import deque
from collections.abc import Callable
from importlib import resources
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from ._base import StoreError
from ._counters import Counters
from ._sqlite_rows import SYNCHRONOUS
from ._sqlite_tx import SQLiteTx

__all__ = ["SQLiteStore"]

T = TypeVar("T")


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
        self._counters = Counters()
        self._tx = SQLiteTx(conn, self._counters)
        self._queue: deque[_Job] = deque()
        self._busy = False
        self._closed = False
        self.resumed_cleanly = self._restore_counters()

    @property
    def description(self) -> str:
        return f"sqlite:{self._path}"

    # `resumed_cleanly` (set at open): the previous kernel on this file shut down
    # cleanly and its occurrence counters were restored, so the leases it
    # granted may stay in force.

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
        if mode not in SYNCHRONOUS:
            raise ValueError(
                f"synchronous must be one of {', '.join(SYNCHRONOUS)}, got {synchronous!r}"
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

    def _restore_counters(self) -> bool:
        """After a clean shutdown: load the saved counters, and drop them and the
        marker at once, so a crash later never reuses stale ones."""
        conn = self._conn
        if conn.execute("SELECT 1 FROM clean_shutdown").fetchone() is None:
            return False
        rows = conn.execute(
            "SELECT execution_id, kind, target, args_hash, value FROM saved_counters"
        ).fetchall()
        for execution_id, kind, target, args_hash, value in rows:
            key = (execution_id, kind, target, args_hash)
            self._counters.committed[key] = value
            self._counters.by_execution.setdefault(execution_id, set()).add(key)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM saved_counters")
        conn.execute("DELETE FROM clean_shutdown")
        conn.execute("COMMIT")
        return True

    def _save_counters(self, tx: Any) -> None:
        # Runs as the last command: every earlier one has committed.
        conn = self._conn
        conn.execute("DELETE FROM saved_counters")
        conn.executemany(
            "INSERT INTO saved_counters (execution_id, kind, target, args_hash, value) "
            "VALUES (?, ?, ?, ?, ?)",
            [(*key, value) for key, value in self._counters.committed.items()],
        )
        conn.execute(
            "INSERT OR REPLACE INTO clean_shutdown (id, at) VALUES (1, strftime('%s', 'now'))"
        )

    async def close(self) -> None:
        """Close cleanly: save the occurrence counters and mark the shutdown
        clean (see `resumed_cleanly`), then release the file."""
        if self._closed:
            return
        try:
            with anyio.CancelScope(shield=True):
                await self.run(self._save_counters)
        except StoreError:
            pass  # the file is unusable: the next start treats this as a crash
        self._closed = True
        await anyio.to_thread.run_sync(self._close_sync)

    def _close_sync(self) -> None:
        try:
            self._conn.close()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

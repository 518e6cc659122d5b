"""Stores: where the kernel keeps executions, steps, events, agents.

`open_store` picks one from a `--db` value: a file path (SQLite, the default),
`:memory:` (SQLite in memory), or `memory://` (plain dictionaries).
"""

from __future__ import annotations

from ._base import Store, StoreError, Tx
from ._memory import MemoryStore
from ._sqlite import SQLiteStore

__all__ = ["MemoryStore", "SQLiteStore", "Store", "StoreError", "Tx", "open_store"]


async def open_store(db: str, *, synchronous: str = "FULL") -> Store:
    """Open the store a `--db` value names.

    Args:
        db: a SQLite file path, `:memory:`, or `memory://`.
        synchronous: SQLite durability: `FULL` (default) or `NORMAL`.

    Raises:
        StoreError: the database cannot be used.
        ValueError: the value names a store this build does not have.
    """
    if db == "memory://":
        return MemoryStore()
    if db.startswith(("postgres://", "postgresql://")):
        raise ValueError(
            "PostgreSQL is not supported by this build yet; use a SQLite file path for --db"
        )
    if "://" in db:
        raise ValueError(f"--db must be a file path, ':memory:' or 'memory://', got {db!r}")
    return await SQLiteStore.open(db, synchronous=synchronous)

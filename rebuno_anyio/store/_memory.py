"""The in-memory store: for tests, the offline harness, and `rebuno dev --db :memory:`.

The tables are `rebuno_proto.MemoryRecords`. Commands run one at a time on the
event loop (they are synchronous), so each is atomic by construction; the
transaction's undo log rolls back the writes of a command that raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from rebuno_proto import MemoryRecords

from ._base import StoreError

__all__ = ["MemoryStore"]

T = TypeVar("T")


class MemoryStore:
    """Keeps everything in dictionaries; nothing survives the process."""

    def __init__(self) -> None:
        self.records = MemoryRecords()
        self._closed = False

    @property
    def description(self) -> str:
        return "memory"

    @property
    def resumed_cleanly(self) -> bool:
        return False  # nothing survives the process

    async def run(self, fn: Callable[[Any], T]) -> T:
        if self._closed:
            raise StoreError("store is closed")
        tx = self.records.begin()
        try:
            return fn(tx)
        except BaseException:
            tx.rollback()
            raise

    async def close(self) -> None:
        self._closed = True

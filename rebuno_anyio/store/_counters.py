"""Occurrence counters held in memory, following the SQLite transaction."""

from __future__ import annotations

CounterKey = tuple[str, str, str, str]


class CounterLayer:
    """Counter writes not yet committed: values set, executions cleared."""

    __slots__ = ("cleared", "values")

    def __init__(self) -> None:
        self.values: dict[CounterKey, int] = {}
        self.cleared: set[str] = set()

    def clear(self, execution_id: str) -> None:
        for key in [k for k in self.values if k[0] == execution_id]:
            del self.values[key]
        self.cleared.add(execution_id)

    def merge_into(self, lower: CounterLayer) -> None:
        for execution_id in self.cleared:
            lower.clear(execution_id)
        lower.values.update(self.values)


class Counters:
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
        self.batch = CounterLayer()
        self.job = CounterLayer()

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
        self.job = CounterLayer()

    def end_batch(self, *, keep: bool) -> None:
        self.end_job(keep=False)
        if keep:
            for execution_id in self.batch.cleared:
                for key in self.by_execution.pop(execution_id, ()):
                    self.committed.pop(key, None)
            for key, value in self.batch.values.items():
                self.committed[key] = value
                self.by_execution.setdefault(key[0], set()).add(key)
        self.batch = CounterLayer()

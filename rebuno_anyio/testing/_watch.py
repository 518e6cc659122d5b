"""How the harness waits, and how it says what went wrong.

A wait re-checks its condition whenever the execution logs an event (a kernel
long poll) or the harness records something (a delivery, a handler run, an
error): never on a timer. An error inside the kernel ends every wait at once
as a `HarnessError`; a wait that runs out raises `HarnessTimeout` with what
the caller describes.

The runtime logs to the process-wide `rebuno` loggers, which every harness
open at once listens to; each keeps only the lines logged inside it: by the
tasks of its own task group (and their worker threads), which carry it in a
context variable.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Final, TypeVar

import anyio
from anyio.abc import TaskGroup

from rebuno_proto import Execution, Refusal

from ..kernel import Kernel
from ._records import Delivery, HandlerRun, HarnessError, HarnessTimeout

__all__ = ["Watch"]

T = TypeVar("T")
_FOREVER_S: Final = 24 * 3600.0  # a long poll's limit; the wait's own timeout ends it first
_LOGGERS: Final = ("rebuno", "rebuno_anyio")
#: The watch of the harness whose task (or worker thread) is running now.
_CURRENT: ContextVar[Watch | None] = ContextVar("rebuno_harness_watch", default=None)


class Watch:
    """The harness's notice board: changes, errors and recent log lines."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.log: deque[str] = deque(maxlen=20)
        self._changed: anyio.Event | None = None
        self._loop_thread: int | None = None

    def notify(self) -> None:
        """Something was recorded: every wait looks again."""
        if self._changed is not None:
            self._changed.set()
        self._changed = anyio.Event()

    def record_error(self, what: str, err: BaseException | None) -> None:
        detail = "" if err is None else "".join(traceback.format_exception(err))
        self.errors.append(f"{what}\n{detail}".rstrip())
        if threading.get_ident() == self._loop_thread:  # events belong to the loop
            self.notify()

    def raise_errors(self) -> None:
        if self.errors:
            raise HarnessError("the kernel failed inside the harness:\n" + "\n".join(self.errors))

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Arm the board on this event loop, and keep the runtime's log lines:
        those logged in this context (by this task, and the tasks and worker
        threads it starts from here on, which copy it)."""
        self._loop_thread = threading.get_ident()
        self.notify()
        capture = _LogCapture(self)
        token = _CURRENT.set(self)
        for name in _LOGGERS:
            logging.getLogger(name).addHandler(capture)
        try:
            yield
        finally:
            for name in _LOGGERS:
                logging.getLogger(name).removeHandler(capture)
            # Left in another context than it was entered (a fixture's
            # teardown, say): that one never saw the value, nothing to undo.
            with suppress(ValueError):
                _CURRENT.reset(token)

    async def until(
        self,
        kernel: Kernel,
        execution_id: str,
        check: Callable[[Execution], Awaitable[T | None]],
        *,
        timeout_s: float,
        explain: Callable[[], Awaitable[str]],
    ) -> T:
        """Return the first non-None `check(execution)`.

        Raises:
            HarnessError: the kernel failed, or the execution does not exist.
            HarnessTimeout: `timeout_s` passed first; the message is `explain()`.
        """
        with anyio.move_on_after(timeout_s):
            while True:
                changed = self._changed  # taken before the check: nothing slips between
                assert changed is not None, "the harness is not running"
                self.raise_errors()
                record = await execution_record(kernel, execution_id)
                found = await check(record)
                if found is not None:
                    return found
                await _next_change(kernel, execution_id, record.last_event_seq, changed)
        self.raise_errors()
        raise HarnessTimeout(await explain())

    async def explain(
        self,
        kernel: Kernel,
        execution_id: str,
        what: str,
        runs: list[HandlerRun],
        deliveries: list[Delivery],
    ) -> str:
        """Where the execution stands: status, last events, runs, deliveries, log."""
        record = await execution_record(kernel, execution_id)
        reason = f", {record.failure_reason}" if record.failure_reason else ""
        lines = [
            f"execution {execution_id} did not reach {what}: it is {record.status.value}{reason}",
            "last events:",
        ]
        events = await kernel.events(
            execution_id, after_seq=max(0, record.last_event_seq - 12), limit=12
        )
        for event in events if isinstance(events, list) else []:
            lines.append(f"  {event.seq:>3} {event.type} {event.payload}")
        lines.append("handler runs:")
        lines += [f"  {run}" for run in runs] or ["  none"]
        lines.append("deliveries:")
        lines += [f"  {delivery}" for delivery in deliveries] or ["  none"]
        if self.log:
            lines.append("logged:")
            lines += [f"  {line}" for line in self.log]
        return "\n".join(lines)


async def execution_record(kernel: Kernel, execution_id: str) -> Execution:
    """The kernel's record of the execution.

    Raises:
        HarnessError: there is no such execution.
    """
    found = await kernel.execution(execution_id)
    if isinstance(found, Refusal):
        raise HarnessError(f"no execution {execution_id}: {found.message}")
    return found


async def _next_change(
    kernel: Kernel, execution_id: str, after_seq: int, changed: anyio.Event
) -> None:
    """Return once the execution logs an event after `after_seq`, or `changed` is set."""

    async def on_event(tg: TaskGroup) -> None:
        await kernel.events(execution_id, after_seq=after_seq, limit=1, wait_s=_FOREVER_S)
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(on_event, tg)
        await changed.wait()
        tg.cancel_scope.cancel()


class _LogCapture(logging.Handler):
    """Keeps the runtime's warnings for timeout messages; an error that the
    kernel's background work logs is an error of the harness."""

    def __init__(self, watch: Watch) -> None:
        super().__init__(logging.WARNING)
        self._watch = watch

    def filter(self, record: logging.LogRecord) -> bool:
        # Logged on behalf of another harness (or of none): not ours to keep.
        return _CURRENT.get() is self._watch and bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = f"{record.levelname} {record.name}: {record.getMessage()}"
        except Exception:
            line = f"{record.levelname} {record.name}: {record.msg!r}"
        self._watch.log.append(line)
        if record.levelno >= logging.ERROR and record.name.startswith("rebuno.kernel"):
            self._watch.record_error(line, record.exc_info[1] if record.exc_info else None)

"""The execution context: one per dispatch, ambient for the handler's life.

Every recording primitive (`@tool`, `wrap_tool`, `step`, `http_client`) finds
it through a context variable, submits its effect to the kernel and obeys the
decision (PROTOCOL.md §5.2, as `rebuno_proto.interpret` reads it): run the body
and record its outcome, return the recorded result, or raise.

`Blocked` and `Terminated` are remembered here, so the agent re-raises them even
if the handler swallowed them. A `LeaseSuperseded` from any call cancels the
handler: nothing more is written under a lease the kernel has moved past. So does
a `KernelUnreachable` (the kernel did not answer even after the kernel client's
retries): the dispatch unwinds without reporting, and the kernel delivers the
execution again once the lease lapses.

Kernel calls always run on the event loop the context was activated on (the
"owner" loop), whose thread owns the kernel client's pooled connections and
locks. A tool may run on another loop -- frameworks run a sync tool in a worker
thread that calls `asyncio.run(async_tool())`, and the context variable follows
it there -- so a call made on another thread is handed to the owner loop.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from rebuno_proto import Lease, Meaning, interpret, may_start_body

from ..errors import (
    Blocked,
    KernelUnreachable,
    LeaseSuperseded,
    PolicyError,
    RateLimited,
    RebunoError,
    Terminated,
    ToolError,
)
from ._kernel_client import KernelClient, encode_json

__all__ = ["ExecutionContext", "Result", "current", "execution", "offload", "previous"]


def _boot_clock() -> float:
    """Seconds on a clock that keeps counting while the machine or VM is
    suspended (Linux `CLOCK_BOOTTIME`): a frozen process must see the time it
    lost. Elsewhere, the monotonic clock."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


#: The clock a `proceed`'s age is measured on (a test may replace it).
_monotonic = _boot_clock if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic
log = logging.getLogger("rebuno.agent")
T = TypeVar("T")


@dataclass
class Result:
    """A handler's return value that keeps `state` for the session.

    `output` goes to callers; `state` is what the next execution in the session
    gets from `previous()`. Both must be JSON-serializable.
    """

    output: Any = None
    state: Any = None


def error_message(error: Any) -> str:
    """The message of a recorded step error (an object with `message` or `reason`)."""
    if isinstance(error, dict):
        return str(error.get("message") or error.get("reason") or json.dumps(error))
    return str(error)


def is_async_callable(fn: object) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    if inspect.iscoroutinefunction(fn):
        return True
    return inspect.iscoroutinefunction(inspect.getattr_static(type(fn), "__call__", None))


async def offload(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call `fn`; a synchronous function runs in a worker thread so it cannot
    starve the heartbeat. An awaitable result is awaited."""
    if is_async_callable(fn):
        return await fn(*args, **kwargs)
    result = await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    if inspect.isawaitable(result):
        return await result
    return result


class ExecutionContext:
    """What the recording primitives need: the kernel, the execution, the lease.

    Attributes:
        id: the execution id.
        agent_id: this agent.
        input: the execution's input, as fetched.
        status: the execution's status, as fetched at dispatch (`running`...).
        lease: the `(dispatch_id, attempt)` this dispatch works under.
        suspension: a `Blocked` or `Terminated` met during the dispatch.
        is_superseded: the kernel said the lease is superseded.
        is_unreachable: a kernel call raised `KernelUnreachable`.
    """

    def __init__(
        self,
        *,
        kernel: KernelClient,
        execution_id: str,
        agent_id: str,
        lease: Lease,
        input: Any,
        on_lease_lost: Callable[[], None],
        status: str = "running",
        on_unreachable: Callable[[], None] | None = None,
        lease_timeout_s: float = 120.0,
    ) -> None:
        self._kernel = kernel
        self.id = execution_id
        self.agent_id = agent_id
        self.lease = lease
        self.input = input
        self.status = status
        self.suspension: Blocked | Terminated | None = None
        self.is_superseded = False
        self.is_unreachable = False
        self._on_lease_lost = on_lease_lost
        self.lease_timeout_s = lease_timeout_s
        self._on_unreachable = on_unreachable
        self._owner_thread: int | None = None
        self._owner_token: anyio.lowlevel.EventLoopToken | None = None

    @property
    def dispatch_id(self) -> str:
        return self.lease.dispatch_id

    @property
    def dispatch_attempt(self) -> int:
        return self.lease.attempt

    def lease_lost(self) -> None:
        """The kernel said this lease is superseded: stop the handler."""
        if not self.is_superseded:
            self.is_superseded = True
            self._on_lease_lost()

    def unreachable(self) -> None:
        """A kernel call failed for good: stop the handler, report nothing."""
        if not self.is_unreachable:
            self.is_unreachable = True
            if self._on_unreachable is not None:
                self._on_unreachable()

    def bind_owner(self) -> None:
        """Remember the thread and event loop the handler runs on (see `activate`)."""
        self._owner_thread = threading.get_ident()
        try:
            self._owner_token = anyio.lowlevel.current_token()
        except anyio.NoEventLoopError:  # activated outside any loop: calls run where made
            self._owner_token = None

    async def _on_owner_loop(self, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Await `call()` on the owner loop.

        On the owner thread that is a plain await. From another thread -- a loop
        of its own, typically `asyncio.run` in a sync tool's worker thread -- the
        pooled connections and locks of the kernel client must not be touched:
        a worker thread of *this* loop blocks on `anyio.from_thread.run`, which
        runs the call on the owner loop, while this loop keeps running.
        """
        token = self._owner_token
        if token is None or threading.get_ident() == self._owner_thread:
            return await call()
        return await anyio.to_thread.run_sync(lambda: anyio.from_thread.run(call, token=token))

    async def _kernel_call(self, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run a kernel call on the owner loop; a lost lease or an unreachable
        kernel stops the handler (on the owner loop too: cancel scopes are not
        thread-safe)."""

        async def guarded() -> T:
            try:
                return await call()
            except LeaseSuperseded:
                self.lease_lost()
                raise
            except KernelUnreachable:
                self.unreachable()
                raise

        return await self._on_owner_loop(guarded)

    async def previous(self) -> Any:
        """The state the session's previous execution left (None on the first)."""
        return await self._kernel_call(lambda: self._kernel.previous_state(self.id))

    async def submit(
        self, *, kind: str, target: str, args: Any, idempotency: str
    ) -> tuple[str, dict[str, Any]]:
        """Submit a step. A `proceed` that came back too late to act on (see
        `rebuno_proto.may_start_body`) stops the handler as a lost lease does."""
        asked_at = _monotonic()

        async def call() -> dict[str, Any]:
            # On the owner loop (`_kernel_call`), so the `LeaseSuperseded`
            # raised here stops the handler from the loop that owns its scope.
            decision = await self._kernel.submit_step(
                self.id, self.lease, kind=kind, target=target, args=args, idempotency=idempotency
            )
            answered_at = _monotonic()
            if decision.get("decision") == "proceed" and not may_start_body(
                asked_at=asked_at, now=answered_at, lease_timeout_s=self.lease_timeout_s
            ):
                raise LeaseSuperseded(
                    f"the kernel's proceed for {target!r} came back after "
                    f"{answered_at - asked_at:.1f} s: the lease may have lapsed"
                )
            return decision

        decision = await self._kernel_call(call)
        return str(decision.get("step_id") or ""), decision

    def _refuse(self, meaning: Meaning, decision: dict[str, Any]) -> None:
        """Raise what a non-`proceed` decision means (never returns)."""
        if meaning is Meaning.RAISE_POLICY_ERROR:
            raise PolicyError(
                str(decision.get("reason") or "policy_denied"), str(decision.get("rule_id") or "")
            )
        if meaning is Meaning.RAISE_RATE_LIMITED:
            raise RateLimited(str(decision.get("reason") or "rate_limit_exceeded"))
        if meaning is Meaning.RAISE_BLOCKED:
            self.suspension = Blocked()
            raise self.suspension
        if meaning is Meaning.RAISE_TERMINATED:
            self.suspension = Terminated("execution is terminal")
            raise self.suspension
        raise RebunoError(f"unexpected step decision: {decision.get('decision')!r}")

    async def invoke(
        self,
        *,
        kind: str,
        target: str,
        args: Any,
        idempotency: str,
        run: Callable[[], Awaitable[Any]],
    ) -> Any:
        """Submit an effect; run `run` only if the kernel says `proceed`.

        Returns the result (fresh or replayed). Raises `ToolError` for a failed
        body (fresh or replayed), or the control-flow error the decision means.
        """
        step_id, decision = await self.submit(
            kind=kind, target=target, args=args, idempotency=idempotency
        )
        error = decision.get("error")
        meaning = interpret(str(decision.get("decision")), has_error=error is not None)
        if meaning is Meaning.RETURN_RESULT:
            return decision.get("result")
        if meaning is Meaning.RAISE_RECORDED_ERROR:
            raise ToolError(error_message(error), tool_id=target, step_id=step_id)
        if meaning is not Meaning.RUN_BODY:
            self._refuse(meaning, decision)
        try:
            result = await run()
            encoded = encode_json(result, f"the result of {target!r}")
        except (Blocked, Terminated, PolicyError, RateLimited, LeaseSuperseded):
            raise
        except Exception as err:
            if isinstance(err, KernelUnreachable) and self.is_unreachable:
                raise  # a nested step's kernel call failed, not the body itself
            # A result that cannot be recorded fails the step too: the next
            # attempt replays the same ToolError instead of finding it stuck.
            await self.fail_step_quietly(step_id, err)
            if isinstance(err, ToolError):
                raise
            raise ToolError(str(err), tool_id=target, step_id=step_id) from err
        await self._kernel_call(
            lambda: self._kernel.complete_step_json(self.id, step_id, self.lease, result=encoded)
        )
        return result

    async def begin_llm(self, target: str, request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Submit an `llm_call` step: returns (step_id, decision) for `proceed`
        and `replay`; raises for refusals (and `RebunoError` for a replayed error)."""
        step_id, decision = await self.submit(
            kind="llm_call", target=target, args=request, idempotency="safe_to_retry"
        )
        error = decision.get("error")
        meaning = interpret(str(decision.get("decision")), has_error=error is not None)
        if meaning is Meaning.RAISE_RECORDED_ERROR:
            raise RebunoError(error_message(error))
        if meaning not in (Meaning.RUN_BODY, Meaning.RETURN_RESULT):
            self._refuse(meaning, decision)
        return step_id, decision

    async def record_llm(self, step_id: str, result: Any) -> None:
        await self._kernel_call(
            lambda: self._kernel.complete_step(self.id, step_id, self.lease, result=result)
        )

    async def publish_delta(self, step_id: str, seq: int, data: str) -> None:
        """Best effort: a live delta that fails is dropped."""

        async def send() -> None:
            try:
                await self._kernel.stream_delta(self.id, step_id, self.lease, seq=seq, data=data)
            except LeaseSuperseded:
                self.lease_lost()  # stop the handler now; the delta itself does not matter
            except Exception:  # deltas are best effort by design (unreachable kernel too)
                log.debug("stream delta for step %s dropped", step_id, exc_info=True)

        await self._on_owner_loop(send)

    async def fail_step_quietly(self, step_id: str, error: BaseException) -> None:
        """Record a body's failure; a lost lease or an unreachable kernel
        propagates, other errors are logged."""
        try:
            await self._kernel_call(
                lambda: self._kernel.fail_step(
                    self.id, step_id, self.lease, error={"message": str(error)}
                )
            )
        except (LeaseSuperseded, KernelUnreachable):
            raise
        except Exception:  # the body's own error is what the caller sees
            log.exception("recording the failure of step %s failed", step_id)


_current: ContextVar[ExecutionContext | None] = ContextVar("rebuno_execution", default=None)


def current() -> ExecutionContext | None:
    """The active execution context, or None outside a handler."""
    return _current.get()


class _ExecutionAccessor:
    """`execution()`: the active execution context.

    A callable object rather than a function so that `execution.id` (the call
    forgotten) says what is wrong instead of "'function' object has no
    attribute 'id'".

    Raises:
        RuntimeError: called outside a handler's execution.
    """

    __slots__ = ()

    def __call__(self) -> ExecutionContext:
        ctx = _current.get()
        if ctx is None:
            raise RuntimeError(
                "execution() called outside an execution: recording primitives work only "
                "inside a handler run by Agent (agent.run(), agent.app)"
            )
        return ctx

    def __repr__(self) -> str:
        return "<rebuno_anyio.execution: call it, execution(), for the active context>"

    if not TYPE_CHECKING:  # at runtime only: type checkers still flag `execution.id`

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)  # protocol lookups (copy, pickle, inspect)
            raise AttributeError(f"execution must be called: use execution().{name}")


execution = _ExecutionAccessor()


async def previous() -> Any:
    """The state the session's previous execution completed with (None on the first)."""
    return await execution().previous()


def activate(ctx: ExecutionContext) -> Any:
    """Make `ctx` the ambient context; returns the token to reset it.

    Called on the event loop the handler runs on, which becomes the context's
    owner loop: kernel calls made from other threads are run there.
    """
    ctx.bind_owner()
    return _current.set(ctx)


def deactivate(token: Any) -> None:
    _current.reset(token)

"""The execution context: one per dispatch, ambient for the handler's life.

Every recording primitive (`@tool`, `wrap_tool`, `step`, `http_client`) finds
it through a context variable, submits its effect to the kernel and obeys the
decision (PROTOCOL.md §5.2, as `rebuno_proto.interpret` reads it): run the body
and record its outcome, return the recorded result, or raise.

`Blocked` and `Terminated` are remembered here, so the agent re-raises them even
if the handler swallowed them. A `LeaseSuperseded` from any call cancels the
handler: nothing more is written under a lease the kernel has moved past.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from rebuno_proto import Lease, Meaning, interpret

from ..errors import (
    Blocked,
    LeaseSuperseded,
    PolicyError,
    RateLimited,
    RebunoError,
    Terminated,
    ToolError,
)
from ._kernel_client import KernelClient, encode_json

__all__ = ["ExecutionContext", "Result", "current", "execution", "offload", "previous"]

log = logging.getLogger("rebuno.agent")


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


async def offload(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call `fn`; a synchronous function runs in a worker thread so it cannot
    starve the heartbeat. An awaitable result is awaited."""
    if inspect.iscoroutinefunction(fn):
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
        lease: the `(dispatch_id, attempt)` this dispatch works under.
        suspension: a `Blocked` or `Terminated` met during the dispatch.
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
    ) -> None:
        self._kernel = kernel
        self.id = execution_id
        self.agent_id = agent_id
        self.lease = lease
        self.input = input
        self.suspension: Blocked | Terminated | None = None
        self.is_superseded = False
        self._on_lease_lost = on_lease_lost

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

    async def _kernel_call(self, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except LeaseSuperseded:
            self.lease_lost()
            raise

    async def previous(self) -> Any:
        """The state the session's previous execution left (None on the first)."""
        return await self._kernel.previous_state(self.id)

    async def submit(
        self, *, kind: str, target: str, args: Any, idempotency: str
    ) -> tuple[str, dict[str, Any]]:
        decision = await self._kernel_call(
            self._kernel.submit_step(
                self.id, self.lease, kind=kind, target=target, args=args, idempotency=idempotency
            )
        )
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
            # A result that cannot be recorded fails the step too: the next
            # attempt replays the same ToolError instead of finding it stuck.
            await self.fail_step_quietly(step_id, err)
            if isinstance(err, ToolError):
                raise
            raise ToolError(str(err), tool_id=target, step_id=step_id) from err
        await self._kernel_call(
            self._kernel.complete_step_json(self.id, step_id, self.lease, result=encoded)
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
            self._kernel.complete_step(self.id, step_id, self.lease, result=result)
        )

    async def publish_delta(self, step_id: str, seq: int, data: str) -> None:
        """Best effort: a live delta that fails is dropped."""
        try:
            await self._kernel.stream_delta(self.id, step_id, self.lease, seq=seq, data=data)
        except LeaseSuperseded:
            self.lease_lost()  # stop the handler now; the delta itself does not matter
        except Exception:  # deltas are best effort by design
            log.debug("stream delta for step %s dropped", step_id, exc_info=True)

    async def fail_step_quietly(self, step_id: str, error: BaseException) -> None:
        """Record a body's failure; a lost lease propagates, other errors are logged."""
        try:
            await self._kernel_call(
                self._kernel.fail_step(self.id, step_id, self.lease, error={"message": str(error)})
            )
        except LeaseSuperseded:
            raise
        except Exception:  # the body's own error is what the caller sees
            log.exception("recording the failure of step %s failed", step_id)


_current: ContextVar[ExecutionContext | None] = ContextVar("rebuno_execution", default=None)


def current() -> ExecutionContext | None:
    """The active execution context, or None outside a handler."""
    return _current.get()


def execution() -> ExecutionContext:
    """The active execution context.

    Raises:
        RuntimeError: called outside a handler's execution.
    """
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "execution() called outside an execution: recording primitives work only "
            "inside a handler run by Agent (agent.run(), agent.app)"
        )
    return ctx


async def previous() -> Any:
    """The state the session's previous execution completed with (None on the first)."""
    return await execution().previous()


def activate(ctx: ExecutionContext) -> Any:
    """Make `ctx` the ambient context; returns the token to reset it."""
    return _current.set(ctx)


def deactivate(token: Any) -> None:
    _current.reset(token)

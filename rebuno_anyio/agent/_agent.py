"""`Agent`: serves the webhook and runs the handler once per dispatch (SEED 004).

On each verified webhook the agent answers 200 at once and runs the dispatch in
a task group it owns. What a webhook does to a handler already running for the
execution (start, supersede, ignore) is `rebuno_proto.Webhooks`; one dispatch's
life (fetch, run with heartbeats, complete / fail / unwind) is the
`rebuno_proto.Dispatch` machine, driven here: this module only does the I/O.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import sniffio
from anyio.abc import TaskGroup, TaskStatus
from pydantic import BaseModel

from rebuno_proto import (
    CompleteExecution,
    Dispatch,
    DispatchReceived,
    ExecutionFetched,
    ExecutionReported,
    ExecutionStatus,
    FailExecution,
    HandlerFinished,
    HandlerOutcome,
    HeartbeatAcked,
    HeartbeatFailed,
    InputRejected,
    Lease,
    LeaseLost,
    MessageError,
    SendHeartbeat,
    Tick,
    WebhookPayload,
    Webhooks,
    conclude,
    parse_webhook,
    verify_webhook,
)

from .._http import Request, Response
from .._server import HttpServer, ServerLimits
from ..errors import (
    Blocked,
    KernelUnreachable,
    LeaseSuperseded,
    NetworkError,
    PolicyError,
    RateLimited,
    Terminated,
    UnauthorizedError,
    classify,
    raise_for_refusal,
)
from ._binding import InputError, Signature, json_schema_of
from ._context import ExecutionContext, Result, activate, deactivate, offload
from ._kernel_client import KernelClient, Signing

if TYPE_CHECKING:
    from rebuno_asgi import ASGIApp

__all__ = ["Agent"]

log = logging.getLogger("rebuno.agent")
_WEBHOOK_LIMITS = ServerLimits(max_body_bytes=64 * 1024, max_header_bytes=32 * 1024)


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, however nested (or `[exc]`)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for member in exc.exceptions for leaf in _leaves(member)]
    return [exc]


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "<unprintable exception>"


def _is_terminal(status: str) -> bool:
    try:
        return ExecutionStatus(status).is_terminal
    except ValueError:
        return False


class _Running:
    __slots__ = ("execution_id", "lease", "scope")

    def __init__(self, execution_id: str, lease: Lease) -> None:
        self.execution_id = execution_id
        self.lease = lease
        self.scope = anyio.CancelScope()


class Agent:
    """A webhook-driven consumer of executions for one agent id.

    Args:
        agent_id: the agent's id (non-empty).
        secret: the shared secret; defaults to `REBUNO_AGENT_SECRET`.
        base_url: the kernel's URL; defaults to `REBUNO_URL`.
        webhook_path: where the kernel POSTs dispatches.
        kernel_timeout: seconds per call to the kernel.
        description: published to the kernel's agent record.
        output_schema: a JSON Schema dict or a pydantic model, also published.
        signing: `"v1"` (default) or `"body"` (the seeds' body-only signature).
        ssl_context: for an `https://` kernel, the context that verifies it
            (one trusting a private CA, say); default: the system's trusted CAs.
        kernel: the client for calls to the kernel; default: one built from
            the arguments above (`rebuno_anyio.testing` passes one that stays
            in process).

    Raises:
        ValueError: an empty id, or no secret or URL.
    """

    def __init__(
        self,
        agent_id: str,
        *,
        secret: str | None = None,
        base_url: str | None = None,
        webhook_path: str = "/webhook",
        kernel_timeout: float = 35.0,
        description: str | None = None,
        output_schema: dict[str, Any] | type[BaseModel] | None = None,
        signing: Signing = "v1",
        ssl_context: ssl.SSLContext | None = None,
        kernel: KernelClient | None = None,
    ) -> None:
        if not agent_id:
            raise ValueError("agent_id must not be empty")
        self.agent_id = agent_id
        self.secret = secret if secret is not None else os.environ.get("REBUNO_AGENT_SECRET", "")
        if not self.secret:
            raise ValueError("Agent needs a secret: pass secret= or set REBUNO_AGENT_SECRET")
        self.base_url = (base_url or os.environ.get("REBUNO_URL", "")).rstrip("/")
        if not self.base_url:
            raise ValueError("Agent needs the kernel URL: pass base_url= or set REBUNO_URL")
        if not webhook_path.startswith("/"):
            raise ValueError(f"webhook_path must start with '/', got {webhook_path!r}")
        self.webhook_path = webhook_path
        self.description = description
        self.output_schema = json_schema_of(output_schema)
        self.signing: Signing = signing
        self._secret = self.secret.encode("utf-8")
        self._kernel = (
            kernel
            if kernel is not None
            else KernelClient(
                agent_id=agent_id,
                secret=self.secret,
                base_url=self.base_url,
                timeout=kernel_timeout,
                signing=signing,
                ssl_context=ssl_context,
            )
        )
        self._signature: Signature | None = None
        self._process: Callable[..., Any] | None = None
        self._webhooks = Webhooks()
        self._running: dict[str, _Running] = {}
        self._active = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._tg: TaskGroup | None = None
        self._metadata = "unpublished"  # unpublished | publishing | published
        self._closed = False
        self._app: ASGIApp | None = None

    # -- binding and serving ------------------------------------------------------------

    def bind(self, process: Callable[..., Any]) -> None:
        """Attach the handler; its signature is the input schema."""
        self._signature = Signature(process)
        self._process = process

    @property
    def app(self) -> ASGIApp:
        """The agent as an ASGI app (for uvicorn, hypercorn, granian...). Its
        lifespan starts the agent's task group and closes the kernel client.

        Mounted under a prefix in a host app (Starlette's `Mount("/agent", ...)`)
        the webhook is matched below the ASGI `root_path`. Hosts do not pass
        lifespan events to mounted apps: enter `agent.running()` from the host
        app's own lifespan instead (docs/agents.md).
        """
        if self._app is None:
            from rebuno_asgi import asgi_app  # the ASGI layer sits above this package

            self._app = asgi_app(
                self.handle_request,
                max_body_bytes=_WEBHOOK_LIMITS.max_body_bytes,
                lifespan=self.running,
            )
        return self._app

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Agent]:
        """Own the task group the handlers run in; close everything on exit."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._ensure_metadata()
                try:
                    yield self
                finally:
                    self._tg = None
                    tg.cancel_scope.cancel()
        finally:
            self._closed = True
            with anyio.CancelScope(shield=True):
                await self._kernel.aclose()

    async def serve(
        self,
        process: Callable[..., Any] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 5000,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the webhook with the built-in HTTP server until cancelled."""
        if process is not None:
            self.bind(process)
        if self._process is None:
            raise RuntimeError("bind a handler first: agent.serve(process) or agent.bind(process)")
        async with self.running():
            server = HttpServer(self.handle_request, limits=_WEBHOOK_LIMITS)
            await server.serve(host, port, task_status=task_status)

    def run(
        self,
        process: Callable[..., Any],
        *,
        host: str = "0.0.0.0",
        port: int = 5000,
        backend: str = "asyncio",
    ) -> None:
        """Bind `process` and serve the webhook until SIGINT/SIGTERM (blocking).

        Args:
            backend: `"asyncio"` or `"trio"`.
        """
        self.bind(process)

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                bound = await tg.start(
                    lambda task_status: self.serve(host=host, port=port, task_status=task_status)
                )
                print(
                    f"agent {self.agent_id} listening on http://{host}:{bound}{self.webhook_path}",
                    file=sys.stderr,
                    flush=True,
                )
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        break
                tg.cancel_scope.cancel()

        anyio.run(main, backend=backend)

    async def join(self) -> None:
        """Wait until no handler is running."""
        while self._active:
            await self._idle.wait()

    async def close(self) -> None:
        """Cancel the handlers in flight and close the kernel client."""
        if self._closed:
            return
        self._closed = True
        for running in list(self._running.values()):
            running.scope.cancel()
        await self.join()
        await self._kernel.aclose()

    # -- the webhook ------------------------------------------------------------------------

    async def handle_request(self, request: Request) -> Response:
        """The HTTP handler: the webhook route; anything else is 404.

        The route is matched below the mount prefix (`Request.route_path`). A
        closed agent answers 503, so the kernel delivers the dispatch again
        later instead of taking it as accepted.
        """
        if request.route_path != self.webhook_path:
            return Response.error(404, "not_found", f"no route for {request.path}")
        if request.method != "POST":
            return Response.error(405, "method_not_allowed", "the webhook accepts POST only")
        if not verify_webhook(self._secret, request.body, request.header("rebuno-signature")):
            return Response(401)
        if self._closed:
            return Response.error(503, "internal_error", "agent is closed")
        self._ensure_metadata()
        try:
            payload = parse_webhook(request.body)
        except MessageError as err:
            return Response.error(400, "validation_error", f"invalid webhook: {err}")
        if self._tg is None or self._process is None:
            return Response.error(503, "internal_error", "agent is not running a handler yet")
        action = self._webhooks.received(payload)
        if action == "ignore":
            return Response(200)
        previous = self._running.get(payload.execution_id)
        if previous is not None:
            log.info(
                "dispatch of %s superseded by attempt %d",
                payload.execution_id,
                payload.dispatch_attempt,
            )
            previous.scope.cancel()
        running = _Running(
            payload.execution_id,
            Lease(dispatch_id=payload.dispatch_id, attempt=payload.dispatch_attempt),
        )
        self._running[payload.execution_id] = running
        if not self._active:  # a new event only when idle: join() may wait on this one
            self._idle = anyio.Event()
        self._active += 1
        self._tg.start_soon(self._dispatch, payload, running)
        return Response(200)

    def _ensure_metadata(self) -> None:
        if self._metadata == "unpublished" and self._tg is not None:
            self._metadata = "publishing"
            self._tg.start_soon(self._publish_metadata)

    async def _publish_metadata(self) -> None:
        try:
            await self._kernel.set_metadata(
                description=self.description,
                input_schema=None if self._signature is None else self._signature.json_schema(),
                output_schema=self.output_schema,
            )
            self._metadata = "published"
        except NetworkError:
            self._metadata = "unpublished"  # retried on the next dispatch
            log.warning("publishing agent metadata failed: kernel unreachable; will retry")
        except UnauthorizedError:
            # Typically the agent started before it was registered: a dispatch
            # proves it is registered now, so the next one tries again.
            self._metadata = "unpublished"
            log.warning("publishing agent metadata refused (not registered yet?); will retry")
        except Exception:  # metadata is a courtesy, never fatal
            self._metadata = "published"
            log.exception("publishing agent metadata failed")

    # -- one dispatch -------------------------------------------------------------------------

    def _is_our_cancellation(self, exc: BaseException, *scopes: anyio.CancelScope) -> bool:
        """Whether `exc` (or a member of it) is a cancellation meant for this task:
        one of `scopes` (the dispatch's) was cancelled, the agent is closing, or
        the task itself is being cancelled. Anything else that is not an
        `Exception` -- a stray `CancelledError`, a custom `BaseException` -- is
        the handler's own failure, and must not take the agent's task group down.
        """
        cancelled = anyio.get_cancelled_exc_class()
        if not any(isinstance(leaf, cancelled) for leaf in _leaves(exc)):
            return False
        if self._closed or any(scope.cancel_called for scope in scopes):
            return True
        if sniffio.current_async_library() != "asyncio":
            return True  # trio.Cancelled comes from trio's own cancel scopes only
        # asyncio only, and beyond anyio's reach: awaiting a task someone else
        # cancelled raises CancelledError in *this* task, indistinguishable by
        # type from a real cancellation. A real one -- from an anyio cancel scope
        # or a plain task.cancel() -- is counted by Task.cancelling() until it is
        # handled; a stray one is not. anyio has no API for this, so asyncio is
        # imported here, lazily: only ever under the asyncio backend.
        import asyncio

        task = asyncio.current_task()
        return task is None or task.cancelling() > 0

    def _must_propagate(self, exc: BaseException, *scopes: anyio.CancelScope) -> bool:
        """KeyboardInterrupt and SystemExit always propagate; cancellation does
        when it is ours."""
        if any(isinstance(leaf, KeyboardInterrupt | SystemExit) for leaf in _leaves(exc)):
            return True
        return self._is_our_cancellation(exc, *scopes)

    async def _dispatch(self, payload: WebhookPayload, running: _Running) -> None:
        try:
            with running.scope:
                await self._run_dispatch(payload, running.scope)
        except Exception:
            log.exception("dispatch of execution %s failed", payload.execution_id)
        except BaseException as exc:
            # Contained: one dispatch must never cancel or crash the others.
            if self._must_propagate(exc, running.scope):
                raise
            log.exception("dispatch of execution %s failed", payload.execution_id)
        finally:
            self._webhooks.finished(payload.execution_id, running.lease)
            if self._running.get(payload.execution_id) is running:
                del self._running[payload.execution_id]
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def _run_dispatch(
        self, payload: WebhookPayload, dispatch_scope: anyio.CancelScope
    ) -> None:
        machine = Dispatch()
        now = anyio.current_time
        machine.handle(DispatchReceived(payload=payload), now=now())
        try:
            execution = await self._kernel.get_execution(payload.execution_id)
        except (NetworkError, LeaseSuperseded, Terminated) as err:
            log.warning("cannot fetch execution %s: %s", payload.execution_id, err)
            return
        assert self._signature is not None
        status = str(execution.get("status"))
        rejected: InputRejected | None = None
        try:
            kwargs = self._signature.bind(execution.get("input"))
        except InputError as err:
            kwargs, rejected = {}, InputRejected(detail=str(err))
        # The machine takes InputRejected in place of ExecutionFetched; a terminal
        # execution is skipped whatever its input.
        fetched = rejected is None or _is_terminal(status)
        if fetched and not machine.handle(ExecutionFetched(status=status), now=now()):
            return  # already terminal
        lease = machine.lease
        assert lease is not None
        handler_scope = anyio.CancelScope()

        def lease_lost() -> None:
            for _ in machine.handle(LeaseLost(), now=now()):
                handler_scope.cancel()

        ctx = ExecutionContext(
            kernel=self._kernel,
            execution_id=payload.execution_id,
            agent_id=self.agent_id,
            lease=lease,
            input=execution.get("input"),
            status=status,
            on_lease_lost=lease_lost,
            # The kernel stays silent: unwind and let it deliver again later.
            on_unreachable=handler_scope.cancel,
            lease_timeout_s=payload.lease_timeout_seconds,
        )
        if rejected is not None:
            for action in machine.handle(rejected, now=now()):
                await self._report(ctx, machine, action)
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeats, machine, ctx)
            conclusion = await self._run_handler(ctx, kwargs, handler_scope, dispatch_scope)
            for action in machine.handle(HandlerFinished(conclusion=conclusion), now=now()):
                await self._report(ctx, machine, action)
            tg.cancel_scope.cancel()

    async def _run_handler(
        self,
        ctx: ExecutionContext,
        kwargs: dict[str, Any],
        scope: anyio.CancelScope,
        dispatch_scope: anyio.CancelScope,
    ) -> CompleteExecution | FailExecution | None:
        assert self._process is not None
        token = activate(ctx)
        output: Any = None
        try:
            with scope:
                output = await offload(self._process, **kwargs)
        except Exception as exc:
            return self._conclude_error(ctx, exc)
        except BaseException as exc:
            if self._must_propagate(exc, scope, dispatch_scope):
                raise
            return self._conclude_error(ctx, exc)  # a stray cancellation, a custom one
        finally:
            deactivate(token)
        if (
            ctx.is_superseded
            or ctx.is_unreachable
            or scope.cancelled_caught
            or ctx.suspension is not None
        ):
            return None
        state = None
        if isinstance(output, Result):
            output, state = output.output, output.state
        try:
            from ._kernel_client import encode_json

            output_json = encode_json(output, "the handler's return value").decode()
            state_json = None if state is None else encode_json(state, "Result.state").decode()
        except TypeError as err:
            return conclude(HandlerOutcome.OTHER_ERROR, detail=str(err), error_class="TypeError")
        return CompleteExecution(output=output_json, state=state_json)

    def _conclude_error(
        self, ctx: ExecutionContext, exc: BaseException
    ) -> CompleteExecution | FailExecution | None:
        if ctx.suspension is not None or ctx.is_superseded or ctx.is_unreachable:
            return None
        try:
            try:
                raise_for_refusal(exc)
            except (Blocked, Terminated, LeaseSuperseded, KernelUnreachable):
                return None
            except (PolicyError, RateLimited) as refused:
                exc = refused
            outcome, detail, error_class = classify(exc)
        except Exception:
            # Classifying must never keep the execution from being failed: an
            # escape here would leave it to be re-delivered until exhausted.
            log.exception("classifying the error of execution %s failed", ctx.id)
            outcome, detail, error_class = (
                HandlerOutcome.OTHER_ERROR,
                _text(exc),
                type(exc).__name__,
            )
        if outcome is HandlerOutcome.OTHER_ERROR:
            log.error("handler of execution %s raised", ctx.id, exc_info=exc)
        return conclude(outcome, detail=detail, error_class=error_class)

    async def _report(self, ctx: ExecutionContext, machine: Dispatch, action: object) -> None:
        now = anyio.current_time
        try:
            if isinstance(action, CompleteExecution):
                await self._kernel.complete_execution(
                    ctx.id,
                    ctx.lease,
                    output=action.output.encode(),
                    state=None if action.state is None else action.state.encode(),
                )
            elif isinstance(action, FailExecution):
                await self._kernel.fail_execution(ctx.id, ctx.lease, reason=action.reason)
        except LeaseSuperseded:
            machine.handle(LeaseLost(), now=now())
            return
        except Terminated:
            log.info("execution %s ended before this dispatch reported", ctx.id)
        except Exception:
            log.exception("reporting the end of execution %s failed", ctx.id)
        machine.handle(ExecutionReported(), now=now())

    async def _heartbeats(self, machine: Dispatch, ctx: ExecutionContext) -> None:
        while True:
            deadline = machine.next_deadline()
            if deadline is None:
                await anyio.sleep(math.inf)
                return
            await anyio.sleep_until(deadline)
            for action in machine.handle(Tick(), now=anyio.current_time()):
                if not isinstance(action, SendHeartbeat):
                    continue
                try:
                    await self._kernel.heartbeat(ctx.id, ctx.lease)
                except LeaseSuperseded:
                    ctx.lease_lost()
                    return
                except Exception as err:
                    log.warning("heartbeat for %s failed: %s", ctx.id, err)
                    machine.handle(HeartbeatFailed(), now=anyio.current_time())
                else:
                    machine.handle(HeartbeatAcked(), now=anyio.current_time())

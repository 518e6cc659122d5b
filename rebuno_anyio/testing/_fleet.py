"""The agent side of the harness: instances of the user's agent, in memory.

Each *instance* is a fresh `Agent` built from the user's configuration (id,
secret, webhook path, metadata, signing) and bound to the user's handler. It
is what one agent process would be: its calls to the kernel go straight into
the kernel's HTTP handler, and webhooks reach it only while it is the newest
instance. A crash takes an instance down; a lease expiry stalls one handler
run and cuts its instance off from the webhooks but leaves it running (a
stalled or partitioned process), so what that run sends afterwards meets the
kernel's fencing.

The fleet also knows which leases the agent side would still be renewing
(`keeps_alive`): the kernel's clock is fake and the instances' heartbeats run
on the event loop's, so when the harness moves the kernel's time it renews
those leases itself.

The faults live here because they are about wires: a crash cuts an instance's
connection right after the kernel recorded its Nth step result, and a
duplicate is a second POST of the same webhook.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import anyio.from_thread
import httpx
import sniffio
from anyio.abc import TaskGroup, TaskStatus

from rebuno_proto import Lease

from .._h11client import ConnectionLost
from .._http import INTERNAL_ERROR, Handler, Request, Response
from ..agent import Agent, KernelClient, execution
from ..agent._context import is_async_callable
from ._clock import FakeClock
from ._records import Delivery, HandlerRun

__all__ = ["KERNEL_URL", "Fleet", "Instance"]

#: Where the instances believe the kernel is; the host names nothing real.
KERNEL_URL: Final = "http://kernel.harness.invalid"
_NO_ANSWER: Final = 0  # the status recorded for a delivery nothing answered
_STEP_RESULT: Final = re.compile(r"/v0/executions/[^/]+/steps/[0-9a-f]{64}/(complete|fail)")


@dataclass(eq=False, slots=True)
class Instance:
    """One running copy of the agent (one "process")."""

    number: int
    agent: Agent
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    is_crashed: bool = False

    def works_under(self, execution_id: str, lease: Lease) -> bool:
        """Whether this instance is up and runs the execution's dispatch under
        `lease`: from the webhook it accepted until it has reported the end, it
        would keep that lease alive with heartbeats."""
        if self.is_crashed or self.scope.cancel_called:
            return False
        # The agent's table of the dispatches it runs (private to `Agent`; the
        # harness is part of the same package and reads it only).
        running = self.agent._running.get(execution_id)
        return running is not None and running.lease == lease


@dataclass(slots=True)
class _CrashPlan:
    """Crash `instance` once the kernel has recorded `after_steps` step results
    under one lease."""

    instance: Instance
    after_steps: int
    recorded: int = 0


class Fleet:
    """The user's agent as a series of in-memory instances.

    Args:
        template: the user's agent, whose configuration each instance copies.
        process: the user's handler.
        kernel: the kernel's HTTP handler (already guarded by the harness).
        clock: the kernel's clock (the instances sign with it).
        notify: called whenever a delivery or a handler run is recorded.
        on_error: called when the agent runtime raised where it never should.
        on_crash: called once an instance has crashed (from its own task).
    """

    def __init__(
        self,
        *,
        template: Agent,
        process: Callable[..., Any],
        kernel: Handler,
        clock: FakeClock,
        notify: Callable[[], None],
        on_error: Callable[[str, BaseException], None],
        on_crash: Callable[[Instance], None],
    ) -> None:
        self.template = template
        self.process = process
        self.instances: list[Instance] = []
        self.deliveries: list[Delivery] = []
        self.runs: list[HandlerRun] = []
        self.last_webhook: dict[str, Request] = {}
        self._kernel = kernel
        self._clock = clock
        self._notify = notify
        self._on_error = on_error
        self._on_crash = on_crash
        self._duplicates = 0
        self._crashes: list[int] = []  # armed: after how many steps, one per delivery
        self._plans: dict[tuple[str, int], _CrashPlan] = {}
        self._stalled: set[Lease] = set()  # leases `expire_lease` took from their runs

    # -- faults ---------------------------------------------------------------------------

    def duplicate_next_webhook(self) -> None:
        self._duplicates += 1

    def crash_next_delivery(self, after_steps: int) -> None:
        if after_steps < 1:
            raise ValueError(f"after_steps must be at least 1, got {after_steps}")
        self._crashes.append(after_steps)

    def stall(self, lease: Lease) -> None:
        """Stall the run working under `lease`: `keeps_alive` no longer holds
        for it, so the lease lapses the next time the kernel's time moves past
        its timeout."""
        self._stalled.add(lease)

    # -- leases -----------------------------------------------------------------------------

    def keeps_alive(self, execution_id: str, lease: Lease) -> bool:
        """Whether the agent side would have renewed the execution's `lease` by
        now, had its heartbeats run on the kernel's clock.

        True while an instance that is up works under it, and while the
        dispatcher is still posting it (no instance has answered that
        delivery yet). False once `stall` took it, once its instance crashed,
        and once no instance works under it any more (its delivery was
        refused, or the agent dropped it).
        """
        if lease in self._stalled:
            return False
        if any(instance.works_under(execution_id, lease) for instance in self.instances):
            return True
        return not any(
            d.execution_id == execution_id
            and d.dispatch_id == lease.dispatch_id
            and d.attempt == lease.attempt
            for d in self.deliveries
        )

    # -- instances ------------------------------------------------------------------------

    @property
    def current(self) -> Instance:
        """The instance webhooks go to: the newest."""
        return self.instances[-1]

    async def start_instance(self, tg: TaskGroup) -> Instance:
        """Bring up a new instance; from now on it receives the webhooks."""
        template = self.template
        number = len(self.instances)
        route: Handler = functools.partial(self._to_kernel, number)
        agent = Agent(
            template.agent_id,
            secret=template.secret,
            base_url=KERNEL_URL,
            webhook_path=template.webhook_path,
            description=template.description,
            output_schema=template.output_schema,
            signing=template.signing,
            kernel=KernelClient(
                agent_id=template.agent_id,
                secret=template.secret,
                base_url=KERNEL_URL,
                signing=template.signing,
                transport=route,
                clock=self._clock,
            ),
        )
        instance = Instance(number, agent)
        agent.bind(self._recording(self.process, instance))
        self.instances.append(instance)  # first: starting, it calls the kernel
        await tg.start(self._serve, instance)
        return instance

    async def _serve(self, instance: Instance, *, task_status: TaskStatus[None]) -> None:
        with instance.scope:
            async with instance.agent.running():
                task_status.started()
                await anyio.sleep_forever()

    # -- agent -> kernel ----------------------------------------------------------------

    async def _to_kernel(self, number: int, request: Request) -> Response:
        instance = self.instances[number]
        if instance.is_crashed:
            raise ConnectionLost(f"agent instance {number} has crashed (harness fault)")
        response = await self._kernel(request)
        if request.method != "POST" or response.status >= 300:
            return response
        plan = self._plans.get(_lease_of(request))
        if (
            plan is None
            or plan.instance is not instance
            or not _STEP_RESULT.fullmatch(request.route_path)
        ):
            return response
        plan.recorded += 1
        if plan.recorded < plan.after_steps:
            return response
        # The kernel has the result; the process dies before it hears back.
        instance.is_crashed = True
        self._notify()
        self._on_crash(instance)
        raise ConnectionLost(
            f"agent instance {number} crashed after {plan.after_steps} step(s) (harness fault)"
        )

    # -- kernel -> agent ----------------------------------------------------------------

    async def to_agent(self, request: Request) -> Response:
        """The webhook route of the dispatcher's HTTP client: the newest instance
        answers, once, or twice when a duplicate was asked for."""
        copies = 1
        if self._duplicates:
            self._duplicates -= 1
            copies = 2
        return await self.deliver(request, copies=copies)

    async def deliver(
        self, request: Request, *, copies: int = 1, is_resend: bool = False
    ) -> Response:
        instance = self.current
        fields = _webhook_fields(request.body)
        first: Response | None = None
        for copy in range(copies):
            if instance.is_crashed:  # a dead process answers nothing
                answer = Response(_NO_ANSWER)
            else:
                try:
                    answer = await instance.agent.handle_request(request)
                except Exception as err:
                    self._on_error("the agent's webhook handler raised", err)
                    answer = INTERNAL_ERROR
            if fields is not None:
                execution_id, dispatch_id, attempt = fields
                self.last_webhook[execution_id] = request
                self.deliveries.append(
                    Delivery(
                        execution_id=execution_id,
                        dispatch_id=dispatch_id,
                        attempt=attempt,
                        status=answer.status,
                        instance=instance.number,
                        is_duplicate=is_resend or copy > 0,
                    )
                )
                lease = (dispatch_id, attempt)
                if (
                    copy == 0
                    and not is_resend
                    and self._crashes
                    and 200 <= answer.status < 300
                    and lease not in self._plans
                ):
                    self._plans[lease] = _CrashPlan(instance, self._crashes.pop(0))
            self._notify()
            if first is None:
                first = answer
        assert first is not None
        if first.status == _NO_ANSWER:
            raise httpx.ConnectError(f"agent instance {instance.number} has crashed")
        return first

    # -- handler runs -----------------------------------------------------------------

    def _recording(self, process: Callable[..., Any], instance: Instance) -> Callable[..., Any]:
        """`process`, recording each call in `runs`; the signature (the input
        schema) and the sync/async kind stay as they are.

        An `async def` function, or an object with `async def __call__`, is
        awaited on the event loop. A synchronous callable runs in a worker
        thread, as the agent runs it; when it returns an awaitable the run
        lasts until that is awaited, on the event loop, as the agent awaits
        it. Except a coroutine under trio: trio refuses a coroutine returned
        from a worker thread, and so the agent fails such a handler there; the
        harness fails it too, with a message that says why.
        """
        if is_async_callable(process):

            @functools.wraps(process)
            async def handler(*args: Any, **kwargs: Any) -> Any:
                run = self._begin(instance)
                try:
                    result = await process(*args, **kwargs)
                except BaseException as exc:
                    self._end(run, exc)
                    raise
                self._end(run, None)
                return result

            return handler

        backend = sniffio.current_async_library()  # here, on the event loop

        @functools.wraps(process)
        def sync_handler(*args: Any, **kwargs: Any) -> Any:
            # A worker thread: the records are the event loop's to touch.
            run = anyio.from_thread.run_sync(self._begin, instance, _lease_now())
            try:
                result = process(*args, **kwargs)
                if backend == "trio" and inspect.iscoroutine(result):
                    result.close()
                    raise TypeError(
                        f"the handler {process!r} is no coroutine function but returned a "
                        "coroutine: the agent calls it in a worker thread, and trio refuses "
                        "a coroutine from a worker thread (asyncio awaits it); make the "
                        "handler an async def function"
                    )
            except BaseException as exc:
                anyio.from_thread.run_sync(self._end, run, exc)
                raise
            if inspect.isawaitable(result):
                # Not a coroutine itself: trio takes it from the thread as the
                # agent would have taken `result`, and the agent awaits it.
                return _Awaiting(self._finishing(run, result))
            anyio.from_thread.run_sync(self._end, run, None)
            return result

        return sync_handler

    async def _finishing(self, run: HandlerRun, awaitable: Awaitable[Any]) -> Any:
        """Await what a synchronous handler returned; its run ends with it."""
        try:
            result = await awaitable
        except BaseException as exc:
            self._end(run, exc)
            raise
        self._end(run, None)
        return result

    def _begin(self, instance: Instance, lease: tuple[str, str, int] | None = None) -> HandlerRun:
        execution_id, dispatch_id, attempt = lease or _lease_now()
        run = HandlerRun(
            execution_id=execution_id,
            dispatch_id=dispatch_id,
            attempt=attempt,
            instance=instance.number,
        )
        self.runs.append(run)
        self._notify()
        return run

    def _end(self, run: HandlerRun, error: BaseException | None) -> None:
        instance = self.instances[run.instance]
        if instance.is_crashed:
            run.outcome = "crashed"
        elif error is None:
            run.outcome = "returned"
        elif isinstance(error, anyio.get_cancelled_exc_class()):
            run.outcome = "cancelled"
        else:
            run.outcome = type(error).__name__
        run.error = error
        self._notify()


class _Awaiting:
    """An awaitable that is no coroutine object, over one that is."""

    __slots__ = ("_coroutine",)

    def __init__(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self._coroutine = coroutine

    def __await__(self) -> Generator[Any, None, Any]:
        return self._coroutine.__await__()


def _lease_now() -> tuple[str, str, int]:
    ctx = execution()
    return ctx.id, ctx.dispatch_id, ctx.dispatch_attempt


def _lease_of(request: Request) -> tuple[str, int]:
    attempt = request.header("rebuno-dispatch-attempt") or ""
    return request.header("rebuno-dispatch-id") or "", int(attempt) if attempt.isdigit() else 0


def _webhook_fields(body: bytes) -> tuple[str, str, int] | None:
    try:
        data = json.loads(body)
        return str(data["execution_id"]), str(data["dispatch_id"]), int(data["dispatch_attempt"])
    except (ValueError, KeyError, TypeError):
        return None

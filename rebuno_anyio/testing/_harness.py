"""`AgentHarness`: the user's agent against an in-process kernel, with faults.

One harness is one world: a `Kernel` on a `MemoryStore` with a `FakeClock`,
its `KernelAPI`, the real `Dispatcher`, and the user's agent (`Fleet`), all
joined by in-memory HTTP. Everything runs in one task group the `async with`
owns, so nothing outlives the block.

Time in the kernel moves only through `advance`, which then does at once what
the agent's heartbeats and the dispatcher's reaper and timer would have done
meanwhile: renew the leases of the handlers that are alive, re-queue the
leases that lapsed (a crashed instance's, a stalled run's), expire due
approvals. Waits follow the execution's event log
(and the harness's own records), never the wall clock, and give up after a
timeout with a message that shows where the execution stands.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from operator import methodcaller
from types import TracebackType
from typing import Any, Final, TypeVar

import anyio
import httpx

from rebuno_proto import DispatchSettings, DispatchStatus, Execution, encode_approval

from .._client import Client
from .._http import INTERNAL_ERROR, Request, Response
from ..agent import Agent
from ..kernel import Dispatcher, Kernel, KernelAPI
from ..policy import compile_bundle_text
from ..store import MemoryStore
from ..types import Approval, Event, Step
from ..types import Execution as ExecutionView
from ._clock import FakeClock
from ._fleet import KERNEL_URL, Fleet, Instance
from ._policy import HarnessPolicy
from ._records import Delivery, HandlerRun, HarnessError
from ._transport import HandlerTransport
from ._watch import Watch, execution_record

__all__ = ["TERMINAL", "AgentHarness"]

T = TypeVar("T")
#: The statuses `wait` waits for by default.
TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
_STATUSES: Final = TERMINAL | {"pending", "running", "blocked"}
_APPROVAL_STATUSES: Final = frozenset({"pending", "granted", "denied", "expired", "all"})
_AGENT_HOST: Final = "http://agent.harness.invalid"
_SECRET: Final = "harness-secret"


class AgentHarness:
    """Run a handler under an in-process kernel, with faults on request.

    Use it as `async with AgentHarness(agent, process) as h:`. On entry the
    kernel starts, the agent is registered and its first instance is up; on
    exit every task is cancelled, and an error the kernel met is raised.

    Args:
        agent: your `Agent` (its id, secret, webhook path, metadata and signing
            are copied: the harness runs fresh instances of it), or just an
            agent id.
        handler: your handler, as you would pass it to `agent.run`.
        policy: a policy bundle (YAML text) for the agent, as loaded in
            production.
        deny: step targets (globs) to deny, laid over `policy`; a mapping gives
            each its reason (default: "denied by the test").
        require_approval: step targets (globs) whose new steps wait for an
            approval, laid over `policy`.
        approval_timeout_s: how long those approvals wait before they expire.
        crash_after_steps: crash the first delivery once it has recorded this
            many step results (see `crash_next_delivery`).
        lease_timeout_s: the kernel's lease timeout.
        max_attempts: deliveries of one dispatch before the execution fails
            with `dispatch_exhausted`.
        timeout_s: how long a wait lasts before it raises `HarnessTimeout`.
        clock: the kernel's clock (default: a `FakeClock` at the real time now).

    Attributes:
        agent_id: the agent's id.
        clock: the kernel's clock.
        settings: the kernel's lease and delivery settings.
        policy: the harness's rules (`deny`, `require_approval`) over the bundle.
        kernel: the `Kernel` (inside the block).
        client: a `Client` of the kernel, in memory (inside the block).

    Raises:
        PolicyBundleError: `policy` does not load.
        ValueError: `crash_after_steps` is below 1.
    """

    kernel: Kernel
    client: Client

    def __init__(
        self,
        agent: Agent | str,
        handler: Callable[..., Any],
        *,
        policy: str | None = None,
        deny: Collection[str] | Mapping[str, str] = (),
        require_approval: Collection[str] = (),
        approval_timeout_s: float = 900.0,
        crash_after_steps: int | None = None,
        lease_timeout_s: float = 120.0,
        max_attempts: int = 5,
        timeout_s: float = 10.0,
        clock: FakeClock | None = None,
    ) -> None:
        if isinstance(agent, str):
            agent = Agent(agent, secret=_SECRET, base_url=KERNEL_URL)
        if policy is not None:
            compile_bundle_text(policy)  # a bad bundle fails here, not on the first step
        self.agent_id = agent.agent_id
        self.clock = clock or FakeClock()
        self.settings = DispatchSettings(lease_timeout_s=lease_timeout_s, max_attempts=max_attempts)
        self.timeout_s = timeout_s
        if isinstance(deny, str):  # one glob, not a collection of characters
            deny = (deny,)
        if isinstance(require_approval, str):
            require_approval = (require_approval,)
        reasons = deny if isinstance(deny, Mapping) else dict.fromkeys(deny, "denied by the test")
        self.policy = HarnessPolicy(
            deny=reasons,
            require_approval=set(require_approval),
            approval_timeout_s=approval_timeout_s,
        )
        self._bundle = policy
        self._template = agent
        self._watch = Watch()
        self._fleet = Fleet(
            template=agent,
            process=handler,
            kernel=self._kernel_side,
            clock=self.clock,
            notify=self._watch.notify,
            on_error=self._watch.record_error,
            on_crash=self._on_crash,
        )
        if crash_after_steps is not None:
            self._fleet.crash_next_delivery(crash_after_steps)
        self._lifespan: AbstractAsyncContextManager[AgentHarness] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> AgentHarness:
        if self._lifespan is not None:
            raise RuntimeError("an AgentHarness runs once: make a new one")
        self._lifespan = self._running()
        return await self._lifespan.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._lifespan is not None
        return await self._lifespan.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[AgentHarness]:
        store = MemoryStore()
        self.kernel = Kernel(
            store, settings=self.settings, clock=self.clock, jitter=lambda: 0.0, policy=self.policy
        )
        self._api = KernelAPI(self.kernel, policy_loader=compile_bundle_text)
        self.client = Client(KERNEL_URL, transport=HandlerTransport(self._kernel_side))
        webhooks = httpx.AsyncClient(transport=HandlerTransport(self._fleet.to_agent))
        failure: Exception | None = None
        try:
            with self._watch.watching():
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    await self._register()
                    # Whatever falls due is announced (kernel hooks, `advance`): the
                    # loops' own polling is only a backstop, slower than any wait.
                    dispatcher = Dispatcher(self.kernel, http=webhooks, poll_interval_s=60.0)
                    await tg.start(dispatcher.run)
                    await self._fleet.start_instance(tg)
                    try:
                        yield self
                    except Exception as exc:
                        # Carried past the task group, which would wrap it in an
                        # ExceptionGroup: the test sees its own exception as raised.
                        failure = exc
                    finally:
                        tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.client.aclose()
                await webhooks.aclose()
                await store.close()
        if failure is not None:
            raise failure
        self._watch.raise_errors()

    async def _register(self) -> None:
        template = self._template
        await self.kernel.register_agent(
            self.agent_id, webhook_url=_AGENT_HOST + template.webhook_path, secret=template.secret
        )
        if self._bundle is not None:
            await self.kernel.update_agent(self.agent_id, policy=self._bundle)

    # -- executions -------------------------------------------------------------------------

    async def start(
        self, input: Any = None, *, session: str = "", idempotency_key: str = ""
    ) -> ExecutionView:
        """Create an execution of the agent; the kernel delivers it at once."""
        return await self.client.create(
            self.agent_id, input, session=session, idempotency_key=idempotency_key
        )

    async def run(
        self,
        input: Any = None,
        *,
        session: str = "",
        idempotency_key: str = "",
        timeout_s: float | None = None,
    ) -> ExecutionView:
        """`start`, then `wait` until the execution is completed, failed or cancelled."""
        started = await self.start(input, session=session, idempotency_key=idempotency_key)
        return await self.wait(started.id, timeout_s=timeout_s)

    async def wait(
        self,
        execution_id: str,
        *,
        until: str | Collection[str] = TERMINAL,
        timeout_s: float | None = None,
    ) -> ExecutionView:
        """Wait until the execution has one of the statuses in `until`.

        Args:
            until: a status or several (`running`, `blocked`, `completed`...);
                default: completed, failed or cancelled.
            timeout_s: default: the harness's `timeout_s`.

        Returns:
            The execution, as `Client.get` returns it.

        Raises:
            HarnessTimeout: still not there when the time ran out; the message
                shows the status, the last events, the handler runs and the
                deliveries.
            HarnessError: the kernel failed, or there is no such execution.
            ValueError: `until` names no status, or one that does not exist.
        """
        wanted = {until} if isinstance(until, str) else set(until)
        if not wanted or not wanted <= _STATUSES:
            raise ValueError(f"until must name statuses among {sorted(_STATUSES)}, got {until!r}")

        async def reached(record: Execution) -> bool | None:
            return True if record.status.value in wanted else None

        what = "status " + " or ".join(sorted(wanted))
        await self._until(execution_id, reached, what, timeout_s)
        return await self.client.get(execution_id)

    async def wait_for_run(
        self, execution_id: str, *, attempt: int | None = None, timeout_s: float | None = None
    ) -> HandlerRun:
        """Wait until a handler run of the execution (of `attempt`, if given)
        has finished; returns the first such run."""

        async def finished(record: Execution) -> HandlerRun | None:
            return next(
                (
                    run
                    for run in self.runs(execution_id)
                    if run.is_finished and attempt in (None, run.attempt)
                ),
                None,
            )

        what = "a finished handler run" + ("" if attempt is None else f" of attempt {attempt}")
        return await self._until(execution_id, finished, what, timeout_s)

    async def wait_for_approval(
        self, execution_id: str, *, timeout_s: float | None = None
    ) -> Approval:
        """Wait until a step of the execution waits for approval; returns the approval."""

        async def pending(record: Execution) -> Approval | None:
            found = await self.approvals(execution_id)
            return found[0] if found else None

        return await self._until(execution_id, pending, "a pending approval", timeout_s)

    async def cancel(self, execution_id: str) -> None:
        """Cancel the execution, as a client would."""
        await self.client.cancel(execution_id)

    # -- reads ------------------------------------------------------------------------------

    async def execution(self, execution_id: str) -> ExecutionView:
        """The execution as it stands now."""
        return await self.client.get(execution_id)

    async def steps(self, execution_id: str) -> list[Step]:
        """The execution's steps, in the order they were first submitted (the
        order of their first event in the log)."""
        first_seen: dict[str, int] = {}
        for event in await self.events(execution_id):
            if isinstance(event.payload, dict) and "step_id" in event.payload:
                first_seen.setdefault(str(event.payload["step_id"]), event.event_seq)
        found = await self.client.list_steps(execution_id)
        return sorted(found, key=lambda s: first_seen.get(s.step_id, 1 << 62))

    async def events(self, execution_id: str) -> list[Event]:
        """The execution's whole event log."""
        found: list[Event] = []
        while page := await self.client.events(
            execution_id, after_seq=found[-1].event_seq if found else 0, limit=1000
        ):
            found += page
        return found

    async def approvals(
        self, execution_id: str | None = None, *, status: str = "pending"
    ) -> list[Approval]:
        """Approvals with `status` (`pending`, `granted`, `denied`, `expired`,
        `all`), of one execution or of all, oldest first: every one of them
        (read from the kernel's store, not a page of the API's listing).

        Raises:
            ValueError: `status` is none of those.
        """
        if status not in _APPROVAL_STATUSES:
            raise ValueError(f"status must be one of {sorted(_APPROVAL_STATUSES)}, got {status!r}")
        wanted = "" if status == "all" else status
        found = await self.kernel.read(
            lambda tx: [
                approval
                for approval in tx.approvals(status=wanted, limit=sys.maxsize)
                if execution_id in (None, approval.execution_id)
            ]
        )
        # The view `Client.list_approvals` gives: the API's own encoding.
        return [Approval.model_validate_json(encode_approval(approval)) for approval in found]

    async def grant_approval(self, approval_id: str, *, rationale: str = "") -> None:
        """Grant: the execution resumes and the held step runs."""
        await self.client.grant_approval(approval_id, decided_by="test", rationale=rationale)

    async def deny_approval(self, approval_id: str, *, rationale: str = "") -> None:
        """Deny: the execution resumes and the held step is refused
        (`PolicyError` with reason `approval_denied`, or `rationale`)."""
        await self.client.deny_approval(approval_id, decided_by="test", rationale=rationale)

    def deliveries(self, execution_id: str | None = None) -> list[Delivery]:
        """The webhooks delivered so far (of one execution or all), in order."""
        return [d for d in self._fleet.deliveries if execution_id in (None, d.execution_id)]

    def runs(self, execution_id: str | None = None) -> list[HandlerRun]:
        """The handler's runs so far (of one execution or all), in start order."""
        return [r for r in self._fleet.runs if execution_id in (None, r.execution_id)]

    # -- time and faults -------------------------------------------------------------------

    async def advance(self, seconds: float) -> None:
        """Move the kernel's clock forward, then do what falls due.

        First the leases of live handlers are renewed, as their heartbeats
        would have renewed them meanwhile: a run whose instance is up holds
        its lease however far the clock moves. Then the leases nobody renewed
        for the lease timeout lapse -- those of a crashed instance and the one
        `expire_lease` stalled -- and are re-queued and delivered again. Due
        approvals expire, and deliveries waiting out a backoff go out.
        """
        self.clock.advance(seconds)
        await self._renew_live_leases()
        now = self.clock()
        lapsed = await self.kernel.read(
            methodcaller("lapsed_leases", now - self.settings.lease_timeout_s, 10_000)
        )
        for execution_id in lapsed:
            await self.kernel.reclaim(execution_id)
        for approval_id in await self.kernel.read(methodcaller("due_approvals", now, 10_000)):
            await self.kernel.expire(approval_id)
        self.kernel.on_dispatch_due(0.0)  # earlier than anything: the claim loop looks now
        self.kernel.on_timer_due(0.0)
        self._watch.notify()

    def crash_next_delivery(self, *, after_steps: int) -> None:
        """Crash the agent during the next delivery, right after the kernel has
        recorded `after_steps` step results from it.

        The instance dies as a process would: the handler never hears back
        from that step, nothing more reaches the kernel, no outcome is
        reported. The harness then brings up a fresh instance and lets the
        crashed one's leases lapse (it advances the clock by the lease
        timeout; the leases of handlers still alive elsewhere are renewed),
        and the kernel delivers the executions again, to the fresh instance:
        recorded steps must replay there.
        """
        self._fleet.crash_next_delivery(after_steps)

    def duplicate_next_webhook(self) -> None:
        """Post the next webhook twice, back to back (same lease)."""
        self._fleet.duplicate_next_webhook()

    async def resend_last_webhook(self, execution_id: str) -> int:
        """Post the execution's last webhook again now (a late duplicate);
        returns the agent's HTTP status."""
        request = self._fleet.last_webhook.get(execution_id)
        if request is None:
            raise HarnessError(f"execution {execution_id} has had no webhook yet")
        return (await self._fleet.deliver(request, is_resend=True)).status

    async def expire_lease(self, execution_id: str) -> None:
        """Let the execution's lease lapse while its handler is stalled.

        The handler counts as stalled from now on (the harness no longer
        renews its lease when the clock moves, as a stalled process no longer
        heartbeats) and its instance stops getting webhooks (it stays alive,
        as a stalled or cut-off process would). A fresh instance comes up,
        the clock moves on by the lease timeout, and the kernel re-queues the
        dispatch and delivers it again, to the fresh instance. What the old
        handler sends after that is refused with `lease_superseded`. Only
        this lease lapses: every other live handler, on the old instance or
        the new, keeps its own.

        Raises:
            HarnessError: the execution holds no lease (not delivered yet,
                blocked, or finished).
        """
        record = await execution_record(self.kernel, execution_id)
        dispatch = record.dispatch
        if dispatch is None or dispatch.status is not DispatchStatus.IN_FLIGHT:
            state = "none" if dispatch is None else dispatch.status.value
            raise HarnessError(
                f"execution {execution_id} holds no lease to expire "
                f"(status {record.status.value}, dispatch {state})"
            )
        self._fleet.stall(dispatch.lease())
        await self._fleet.start_instance(self._tg)
        await self.advance(self.settings.lease_timeout_s)

    @property
    def deny(self) -> dict[str, str]:
        """Denied targets (glob -> reason); change it to deny from now on."""
        return self.policy.deny

    @property
    def require_approval(self) -> set[str]:
        """Held targets (globs); change it to hold from now on."""
        return self.policy.require_approval

    # -- plumbing ----------------------------------------------------------------------------

    async def _kernel_side(self, request: Request) -> Response:
        """The kernel's HTTP handler, as every in-memory caller reaches it."""
        try:
            return await self._api(request)
        except Exception as err:
            self._watch.record_error(
                f"the kernel API raised on {request.method} {request.target}", err
            )
            return INTERNAL_ERROR

    async def _renew_live_leases(self) -> None:
        """Renew, at the kernel's time now, each lease that is about to lapse
        but whose handler would have kept it alive (`Fleet.keeps_alive`)."""
        lease_s = self.settings.lease_timeout_s
        lapsing = await self.kernel.read(
            methodcaller("lapsed_leases", self.clock() - lease_s, 10_000)
        )
        for execution_id in lapsing:
            record = await execution_record(self.kernel, execution_id)
            dispatch = record.dispatch
            if dispatch is None or dispatch.status is not DispatchStatus.IN_FLIGHT:
                continue
            lease = dispatch.lease()
            if self._fleet.keeps_alive(execution_id, lease):
                await self.kernel.heartbeat(execution_id, record.agent_id, lease)

    def _on_crash(self, instance: Instance) -> None:
        self._tg.start_soon(self._recover, instance)

    async def _recover(self, instance: Instance) -> None:
        instance.scope.cancel()  # the process is gone
        await self._fleet.start_instance(self._tg)
        await self.advance(self.settings.lease_timeout_s)

    async def _until(
        self,
        execution_id: str,
        check: Callable[[Execution], Awaitable[T | None]],
        what: str,
        timeout_s: float | None,
    ) -> T:
        limit = self.timeout_s if timeout_s is None else timeout_s
        return await self._watch.until(
            self.kernel,
            execution_id,
            check,
            timeout_s=limit,
            explain=lambda: self._watch.explain(
                self.kernel,
                execution_id,
                f"{what} within {limit:g} s",
                self.runs(execution_id),
                self.deliveries(execution_id),
            ),
        )

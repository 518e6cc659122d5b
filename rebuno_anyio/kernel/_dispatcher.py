"""Background work: deliver dispatches, reclaim lapsed leases, expire approvals.

Three loops in one task group. Each asks the store what is due, runs the kernel
command for it, and then sleeps until the next thing is due -- or until a
command that just committed says something became due sooner (`wake`).

Deliveries are POSTs of the signed webhook with httpx. A 2xx answer means the
agent took it (`dispatch.acked`); anything else, a timeout or a connection
error is a failed delivery, retried with backoff until `max_attempts`. The
claim loop takes a delivery slot *before* it claims: the lease clock starts at
the claim, so a claimed dispatch must never wait for a slot.

Nothing that goes wrong with one item or one pass stops the kernel: an error
(a store that stays locked, a URL the HTTP client refuses) is logged with the
execution it concerns, the loop backs off for one poll interval and goes on.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable
from operator import methodcaller
from typing import Final

import anyio
import httpx
from anyio.abc import TaskGroup, TaskStatus

from rebuno_proto import (
    Delivery,
    DeliveryResult,
    delivery_result,
    encode_webhook,
    sign_webhook,
)

from ..store import StoreError
from ._service import Kernel

__all__ = ["Dispatcher"]

log = logging.getLogger("rebuno.kernel.dispatcher")


#: Errors after which a webhook may have reached the agent: it was (being) sent
#: and no answer came. Anything else (no connection, a bad URL) never arrived;
#: our own deadline (`TimeoutError`) counts once the request began to go out.
_MAYBE_ARRIVED: Final = (
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


class _Alarm:
    """Sleep until a wall-clock time, or until woken earlier."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._event = anyio.Event()
        self._at = math.inf

    def wake(self, at: float) -> None:
        if at < self._at:
            self._at = at
            self._event.set()

    async def sleep_until(self, at: float, *, cap_s: float) -> None:
        self._at = min(at, self._at)
        delay = min(max(self._at - self._clock(), 0.0), cap_s)
        if delay > 0:
            with anyio.move_on_after(delay):
                await self._event.wait()
        self._event = anyio.Event()
        self._at = math.inf


class Dispatcher:
    """Delivers webhooks and runs the kernel's timers.

    Args:
        kernel: the kernel service.
        poll_interval_s: the longest any loop sleeps without looking (the claim
            loop of PROTOCOL.md §6.3 runs every 2 s); also the back-off after an
            error.
        claim_batch: dispatches claimed per pass.
        concurrency: deliveries in flight at once (claims never exceed it).
        delivery_timeout_s: how long a webhook POST may take in total.
        http: the client for webhook POSTs (one is created if not given).
    """

    def __init__(
        self,
        kernel: Kernel,
        *,
        poll_interval_s: float = 2.0,
        claim_batch: int = 10,
        concurrency: int = 8,
        delivery_timeout_s: float = 30.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.kernel = kernel
        self.poll_interval_s = poll_interval_s
        self.claim_batch = claim_batch
        self.delivery_timeout_s = delivery_timeout_s
        self._slots = anyio.Semaphore(concurrency)  # one per claimed, undelivered dispatch
        self._http = http
        self._owns_http = http is None
        self._claims = _Alarm(kernel.clock)
        self._timers = _Alarm(kernel.clock)
        self._reaper = _Alarm(kernel.clock)
        kernel.on_dispatch_due = self._claims.wake
        kernel.on_timer_due = self._timers.wake

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the loops until cancelled."""
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=self.delivery_timeout_s,
                follow_redirects=False,
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
            )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._loop, "claim", functools.partial(self._claim_pass, tg))
                tg.start_soon(self._loop, "lease reaper", self._reap_pass)
                tg.start_soon(self._loop, "approval timer", self._timer_pass)
                task_status.started()
        finally:
            if self._owns_http and self._http is not None:
                with anyio.CancelScope(shield=True):
                    await self._http.aclose()

    async def _loop(self, name: str, one_pass: Callable[[], Awaitable[bool]]) -> None:
        """Run `one_pass` forever; one that fails, or reports that an item
        failed (returns False), is followed by a pause of one poll interval."""
        while True:
            try:
                is_clean = await one_pass()
            except Exception as err:
                _log_error(
                    err, "dispatcher: %s pass failed; retrying in %g s", name, self.poll_interval_s
                )
                is_clean = False
            if not is_clean:
                await anyio.sleep(self.poll_interval_s)

    # -- delivery -------------------------------------------------------------------

    async def _claim_pass(self, tg: TaskGroup) -> bool:
        """Claim due dispatches, each only once a delivery slot is free, and
        start their deliveries; then sleep until more is due. False if a
        claim failed."""
        kernel = self.kernel
        await self._slots.acquire()  # a slot first: look for work only when it can be sent
        holding, is_clean = True, True
        try:
            due: list[str] = await kernel.read(
                methodcaller("due_dispatches", kernel.clock(), self.claim_batch)
            )
            for execution_id in due:
                if not holding:
                    await self._slots.acquire()
                    holding = True
                try:
                    delivery = await kernel.claim(execution_id)
                except Exception as err:
                    _log_error(
                        err,
                        "dispatcher: claiming the dispatch of execution %s failed",
                        execution_id,
                    )
                    is_clean = False
                    continue
                if delivery is not None:
                    tg.start_soon(self._deliver, delivery)  # the slot goes with it
                    holding = False
        finally:
            if holding:
                self._slots.release()
        if not is_clean or len(due) == self.claim_batch:
            return is_clean
        next_at = await kernel.read(lambda tx: tx.next_dispatch_at())
        await self._claims.sleep_until(
            math.inf if next_at is None else next_at, cap_s=self.poll_interval_s
        )
        return True

    async def _deliver(self, delivery: Delivery) -> None:
        """POST one claimed dispatch and record how it went; holds a slot
        (acquired by the claim loop) until done."""
        try:
            # Shutting down mid-POST records nothing: the webhook may have
            # arrived, so the lease stays in flight -- a handler that got it
            # carries on across a clean restart, and if none did, the reaper
            # re-queues the dispatch when the lease lapses.
            result = await self._post(delivery)
            try:
                await self.kernel.delivered(delivery, result)
            except Exception as err:
                # The dispatch stays in flight; the reaper re-queues it when
                # its lease lapses.
                _log_error(
                    err,
                    "dispatcher: recording delivery attempt %d of execution %s failed",
                    delivery.attempt,
                    delivery.execution_id,
                )
        finally:
            self._slots.release()

    async def _post(self, delivery: Delivery) -> DeliveryResult:
        """Send the webhook: `ACKED` if the agent answered 2xx; `REFUSED` if
        it never got it (not registered, no connection, a non-2xx answer);
        `UNANSWERED` if it was sent and no answer came (a timeout, a
        connection lost): a handler may be running then. Any error, not only
        an `httpx.HTTPError`, is a failed delivery."""
        url = "?"
        status: int | None = None
        sending = False

        async def trace(event: str, info: dict[str, object]) -> None:
            nonlocal sending
            if event.endswith(".send_request_headers.started"):
                sending = True

        try:
            agent = await self.kernel.agent(delivery.agent_id)
            if agent is None:
                log.warning(
                    "agent %s of execution %s is not registered; delivery failed",
                    delivery.agent_id,
                    delivery.execution_id,
                )
                return DeliveryResult.REFUSED
            url = agent.webhook_url
            body = encode_webhook(delivery, self.kernel.settings.lease_timeout_s)
            headers = {
                "Content-Type": "application/json",
                "Rebuno-Signature": sign_webhook(agent.secret.encode("utf-8"), body),
                "Rebuno-Execution-Id": delivery.execution_id,
            }
            assert self._http is not None
            # The client's timeout is per read: a trickling agent would hold the
            # slot for ever. The whole exchange gets the deadline, and the body
            # of the answer is never read (only its status counts).
            with anyio.fail_after(self.delivery_timeout_s):
                async with self._http.stream(
                    "POST", url, content=body, headers=headers, extensions={"trace": trace}
                ) as reply:
                    status = reply.status_code
        except Exception as err:
            if status is not None:
                return delivery_result(status)  # answered; only closing the stream failed
            text = "timed out" if isinstance(err, TimeoutError) else str(err) or type(err).__name__
            log.info(
                "delivery of %s attempt %d to %s failed: %s",
                delivery.execution_id,
                delivery.attempt,
                url,
                text,
                exc_info=not isinstance(err, httpx.HTTPError | TimeoutError | StoreError),
            )
            maybe = isinstance(err, _MAYBE_ARRIVED) or (isinstance(err, TimeoutError) and sending)
            return DeliveryResult.UNANSWERED if maybe else DeliveryResult.REFUSED
        result = delivery_result(status)
        if result is not DeliveryResult.ACKED:
            log.info(
                "delivery of %s attempt %d to %s answered %d",
                delivery.execution_id,
                delivery.attempt,
                url,
                status,
            )
        return result

    # -- leases and approvals -------------------------------------------------------------

    async def _reap_pass(self) -> bool:
        kernel = self.kernel
        lease_s = kernel.settings.lease_timeout_s
        lapsed: list[str] = await kernel.read(
            methodcaller("lapsed_leases", kernel.clock() - lease_s, 100)
        )
        is_clean = True
        for execution_id in lapsed:
            try:
                if await kernel.reclaim(execution_id):
                    log.info("lease of %s lapsed; re-queued for delivery", execution_id)
            except Exception as err:
                _log_error(
                    err,
                    "dispatcher: re-queuing the lapsed lease of execution %s failed",
                    execution_id,
                )
                is_clean = False
        if not is_clean or len(lapsed) == 100:
            return is_clean
        oldest = await kernel.read(lambda tx: tx.oldest_lease_at())
        await self._reaper.sleep_until(
            math.inf if oldest is None else oldest + lease_s,
            cap_s=min(self.poll_interval_s, lease_s / 4),
        )
        return True

    async def _timer_pass(self) -> bool:
        kernel = self.kernel
        due = await kernel.read(methodcaller("due_approvals", kernel.clock(), 100))
        is_clean = True
        for approval_id in due:
            try:
                if await kernel.expire(approval_id):
                    log.info("approval %s expired", approval_id)
            except Exception as err:
                _log_error(err, "dispatcher: expiring approval %s failed", approval_id)
                is_clean = False
        if not is_clean or len(due) == 100:
            return is_clean
        next_at = await kernel.read(lambda tx: tx.next_approval_at())
        await self._timers.sleep_until(
            math.inf if next_at is None else next_at, cap_s=self.poll_interval_s * 15
        )
        return True


def _log_error(err: Exception, message: str, *args: object) -> None:
    """Log a failure of background work: a store error (the database is locked
    or gone) as one line, anything else with its traceback."""
    if isinstance(err, StoreError):
        log.error(message + ": %s", *args, err)
    else:
        log.error(message + ": %s", *args, err or type(err).__name__, exc_info=err)

"""Background work: deliver dispatches, reclaim lapsed leases, expire approvals.

Three loops in one task group. Each asks the store what is due, runs the kernel
command for it, and then sleeps until the next thing is due -- or until a
command that just committed says something became due sooner (`wake`).

Deliveries are POSTs of the signed webhook with httpx. A 2xx answer means the
agent took it (`dispatch.acked`); anything else, a timeout or a connection
error is a failed delivery, retried with backoff until `max_attempts`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from operator import methodcaller

import anyio
import httpx
from anyio.abc import TaskGroup, TaskStatus

from rebuno_proto import Delivery, encode_webhook, sign_webhook

from ._service import Kernel

__all__ = ["Dispatcher"]

log = logging.getLogger("rebuno.kernel.dispatcher")


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
            loop of PROTOCOL.md §6.3 runs every 2 s).
        claim_batch: dispatches claimed per pass.
        concurrency: deliveries in flight at once.
        delivery_timeout_s: how long a webhook POST may take.
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
        self._limiter = anyio.CapacityLimiter(concurrency)
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
                tg.start_soon(self._claim_loop, tg)
                tg.start_soon(self._reap_loop)
                tg.start_soon(self._timer_loop)
                task_status.started()
        finally:
            if self._owns_http and self._http is not None:
                with anyio.CancelScope(shield=True):
                    await self._http.aclose()

    # -- delivery -------------------------------------------------------------------

    async def _claim_loop(self, tg: TaskGroup) -> None:
        kernel = self.kernel
        while True:
            now = kernel.clock()
            batch = self.claim_batch
            due: list[str] = await kernel.read(methodcaller("due_dispatches", now, batch))
            for execution_id in due:
                delivery = await kernel.claim(execution_id)
                if delivery is not None:
                    tg.start_soon(self._deliver, delivery)
            if len(due) == batch:
                continue
            next_at = await kernel.read(lambda tx: tx.next_dispatch_at())
            await self._claims.sleep_until(
                math.inf if next_at is None else next_at, cap_s=self.poll_interval_s
            )

    async def _deliver(self, delivery: Delivery) -> None:
        async with self._limiter:
            is_acked = await self._post(delivery)
        await self.kernel.delivered(delivery, is_acked=is_acked)

    async def _post(self, delivery: Delivery) -> bool:
        agent = await self.kernel.agent(delivery.agent_id)
        if agent is None:
            log.warning(
                "agent %s of execution %s is not registered; delivery failed",
                delivery.agent_id,
                delivery.execution_id,
            )
            return False
        body = encode_webhook(delivery, self.kernel.settings.lease_timeout_s)
        headers = {
            "Content-Type": "application/json",
            "Rebuno-Signature": sign_webhook(agent.secret.encode("utf-8"), body),
            "Rebuno-Execution-Id": delivery.execution_id,
        }
        assert self._http is not None
        try:
            response = await self._http.post(agent.webhook_url, content=body, headers=headers)
        except httpx.HTTPError as err:
            log.info(
                "delivery of %s attempt %d to %s failed: %s",
                delivery.execution_id,
                delivery.attempt,
                agent.webhook_url,
                err or type(err).__name__,
            )
            return False
        if 200 <= response.status_code < 300:
            return True
        log.info(
            "delivery of %s attempt %d to %s answered %d",
            delivery.execution_id,
            delivery.attempt,
            agent.webhook_url,
            response.status_code,
        )
        return False

    # -- leases and approvals -------------------------------------------------------------

    async def _reap_loop(self) -> None:
        kernel = self.kernel
        lease_s = kernel.settings.lease_timeout_s
        while True:
            now = kernel.clock()
            lapsed: list[str] = await kernel.read(methodcaller("lapsed_leases", now - lease_s, 100))
            for execution_id in lapsed:
                if await kernel.reclaim(execution_id):
                    log.info("lease of %s lapsed; re-queued for delivery", execution_id)
            if len(lapsed) == 100:
                continue
            oldest = await kernel.read(lambda tx: tx.oldest_lease_at())
            await self._reaper.sleep_until(
                math.inf if oldest is None else oldest + lease_s,
                cap_s=min(self.poll_interval_s, lease_s / 4),
            )

    async def _timer_loop(self) -> None:
        kernel = self.kernel
        while True:
            now = kernel.clock()
            due = await kernel.read(methodcaller("due_approvals", now, 100))
            for approval_id in due:
                if await kernel.expire(approval_id):
                    log.info("approval %s expired", approval_id)
            if len(due) == 100:
                continue
            next_at = await kernel.read(lambda tx: tx.next_approval_at())
            await self._timers.sleep_until(
                math.inf if next_at is None else next_at, cap_s=self.poll_interval_s * 15
            )

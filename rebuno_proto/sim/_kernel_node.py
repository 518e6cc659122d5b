"""The simulated kernel process: `KernelCommands` over durable `MemoryRecords`,
with the volatile memory a crash loses (deliveries in flight, wake-ups, and the
occurrence counters inside the records)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .._approvals import ApprovalChoice
from .._canonical import canonical_json
from .._delivery import Delivery, DeliveryResult
from .._memory import MemoryTx
from .._outcome import ErrorCode, Outcome, Refusal, StepDecision
from .._records import Lease
from .._state import ApprovalStatus
from .._wire import (
    CreateExecution,
    WebhookPayload,
)
from ._plan import Job, MessageClass

if TYPE_CHECKING:
    from ._world import World

__all__ = ["START", "KernelNode"]

START: Final = 1_800_000_000.0  # the kernel's clock at t = 0


def _for(lease: tuple[str, Lease] | None) -> str:
    if lease is None:
        return ""
    return f" [{lease[0][-4:]} {lease[1].dispatch_id[-4:]}#{lease[1].attempt}]"


def _summary(reply: object) -> str:
    if isinstance(reply, Refusal):
        return f"refused {reply.code.value}: {reply.message}"
    if isinstance(reply, StepDecision):
        text = reply.decision.value
        if reply.step_id:
            text += f" {reply.step_id[:8]}"
        if reply.error:
            text += f" error={reply.error}"
        return text
    if isinstance(reply, Delivery):
        return f"delivery attempt {reply.attempt}"
    return "ok" if reply is None else type(reply).__name__


# -- the kernel -------------------------------------------------------------------------


class KernelNode:
    """The kernel process: commands over durable records, plus volatile memory."""

    def __init__(self, world: World) -> None:
        self.w = world
        self.up = True
        self.incarnation = 0
        self.clock_offset = 0.0
        self.created: dict[str, str] = {}  # job key -> execution id (the client's memory)
        self.deliveries: dict[tuple[str, str, int], Delivery] = {}
        self._wake_at: float | None = None

    @property
    def clock(self) -> float:
        return START + self.w.now + self.clock_offset

    def run(
        self,
        label: str,
        fn: Callable[[MemoryTx, float], Outcome[Any]],
        lease: tuple[str, Lease] | None = None,
    ) -> Outcome[Any] | None:
        """One command in one transaction; `None` if a rule raised."""
        tx = self.w.records.begin()
        now = self.clock
        try:
            outcome = fn(tx, now)
            if not outcome.change.is_empty:
                tx.apply(outcome.change)
        except Exception as err:
            tx.rollback()
            self.w.check.fail("rule_error", f"{label} raised {type(err).__name__}: {err}")
            return None
        self.w.check.command(label, outcome, lease)
        if self.w.tracing:
            self.w.log(f"kernel: {label}{_for(lease)} -> {_summary(outcome.reply)}")
        for approval in outcome.change.approvals:
            if approval.status is ApprovalStatus.PENDING:
                self._approver(approval.id)
        if outcome.dispatch_due_at is not None and outcome.dispatch_due_at <= now:
            self._wake()
        return outcome

    def _wake(self) -> None:
        """The dispatcher runs right after this command (as the real one is woken)."""
        if self._wake_at is None:
            self._wake_at = self.w.now
            incarnation = self.incarnation
            self.w.at(self.w.now, lambda: self._dispatch(incarnation))

    # -- background work ---------------------------------------------------------------

    def tick(self) -> None:
        """Once a simulated second: dispatcher, reaper, approval timer."""
        self.w.at(self.w.now + self.w.config.tick_s, self.tick)
        if not self.up:
            return
        self._dispatch(self.incarnation)
        now = self.clock
        lapsed = self.w.records.begin().lapsed_leases(now - self.w.settings.lease_timeout_s, 1000)
        for execution_id in lapsed:
            self._on_execution("reclaim", self.w.commands.reclaim, execution_id)
        for approval_id in self.w.records.begin().due_approvals(now, 1000):
            self._on_execution("expire", self.w.commands.expire, approval_id)

    def _on_execution(
        self, label: str, command: Callable[[MemoryTx, str, float], Outcome[Any]], key: str
    ) -> Outcome[Any] | None:
        return self.run(label, lambda tx, now: command(tx, key, now))

    def _dispatch(self, incarnation: int) -> None:
        if incarnation != self.incarnation or not self.up:
            return
        self._wake_at = None
        for execution_id in self.w.records.begin().due_dispatches(self.clock, 1000):
            outcome = self._on_execution("claim", self.w.commands.claim, execution_id)
            delivery = None if outcome is None else outcome.reply
            if isinstance(delivery, Delivery):
                self.w.check.granted(delivery.execution_id, delivery.lease())
                self._post(delivery)

    def _post(self, delivery: Delivery) -> None:
        key = (delivery.execution_id, delivery.dispatch_id, delivery.attempt)
        self.deliveries[key] = delivery
        incarnation = self.incarnation
        payload = WebhookPayload(
            execution_id=delivery.execution_id,
            dispatch_id=delivery.dispatch_id,
            dispatch_attempt=delivery.attempt,
            lease_timeout_seconds=self.w.settings.lease_timeout_s,
        )
        agent = self.w.process(delivery.agent_id, self.w.route.randrange(self.w.config.replicas))
        self.w.log(
            f"kernel: webhook {delivery.execution_id[-4:]} attempt {delivery.attempt} "
            f"to {agent.name}"
        )

        def answered(result: DeliveryResult) -> None:
            if incarnation == self.incarnation and self.up:
                self._delivered(key, result)

        self.w.send(MessageClass.WEBHOOKS, agent, lambda: agent.webhook(payload, answered))
        self.w.at(
            self.w.now + self.w.config.delivery_timeout_s,
            lambda: answered(DeliveryResult.UNANSWERED),
        )

    def _delivered(self, key: tuple[str, str, int], result: DeliveryResult) -> None:
        delivery = self.deliveries.pop(key, None)
        if delivery is None:
            return  # already answered (or timed out)
        jitter = self.w.timing.random()
        self.run(
            "delivered",
            lambda tx, now: self.w.commands.delivered(
                tx,
                delivery,
                result=result,
                jitter=jitter,
                now=now,
            ),
        )

    # -- crash and restart ---------------------------------------------------------------

    def stop(self, *, crash: bool, downtime: float) -> None:
        if not self.up:
            return
        if not crash:
            # A clean stop records the deliveries it cuts short as failed, and
            # keeps the counters (the real kernel saves them with a marker).
            for key in list(self.deliveries):
                self._delivered(key, DeliveryResult.UNANSWERED)  # cut short: it may have arrived
        self.up = False
        self.incarnation += 1
        self.deliveries.clear()
        self._wake_at = None
        if crash:
            self.w.records.forget_counters()
        self.w.at(self.w.now + downtime, lambda: self.start(crashed=crash))

    def start(self, *, crashed: bool) -> None:
        self.up = True
        self.w.log(f"kernel: up again ({'after a crash' if crashed else 'clean'})")
        if crashed:
            self.w.check.kernel_crashed()
            retire = self.w.commands.retire_after_restart
            for execution_id in self.w.records.begin().leased("", 100_000):
                self._on_execution(
                    "retire", lambda tx, e, now: retire(tx, now, execution_id=e), execution_id
                )
        self._wake()

    # -- requests ------------------------------------------------------------------------

    def request(self, agent_id: str, op: str, execution_id: str, lease: Lease, body: Any) -> object:
        """An agent's request; returns the reply (a `Refusal`, a decision, a status)."""
        c = self.w.commands
        held = (execution_id, lease)
        outcome: Outcome[Any] | None
        if op == "get":
            execution = self.w.records.executions.get(execution_id)
            return "missing" if execution is None else execution.status.value
        if op == "submit":
            outcome = self.run(
                f"submit {body.target}",
                lambda tx, now: c.submit(tx, execution_id, agent_id, lease, body, now),
                held,
            )
        elif op == "complete" or op == "fail":
            step_id, value = body
            outcome = self.run(
                f"{op} step",
                lambda tx, now: c.finish_step(
                    tx,
                    execution_id,
                    step_id,
                    agent_id,
                    lease,
                    now,
                    result=value if op == "complete" else None,
                    error=value if op == "fail" else None,
                ),
                held,
            )
        elif op == "heartbeat":
            outcome = self.run(
                "heartbeat",
                lambda tx, now: c.heartbeat(tx, execution_id, agent_id, lease, now),
                held,
            )
        else:  # "end"
            outcome = self.run(
                "end", lambda tx, now: c.end(tx, execution_id, agent_id, lease, body, now), held
            )
        return (
            Refusal(ErrorCode.INTERNAL_ERROR, "rule raised") if outcome is None else outcome.reply
        )

    # -- the client and the approver -----------------------------------------------------

    def client_create(self, job: Job) -> None:
        if not self.up:
            self.w.at(self.w.now + 1.0, lambda: self.client_create(job))
            return
        request = CreateExecution(
            agent_id=job.agent_id,
            input=canonical_json(json.dumps(job.program).encode()).decode(),
            session=job.session,
            idempotency_key=job.key,
        )
        outcome = self.run("create", lambda tx, now: self.w.commands.create(tx, request, now))
        if outcome is not None and not isinstance(outcome.reply, Refusal):
            self.created[job.key] = outcome.reply.execution.id
            self.w.log(f"client: created {job.key} as {outcome.reply.execution.id[-4:]}")

    def client_cancel(self, key: str) -> None:
        execution_id = self.created.get(key)
        if execution_id is None:
            return
        if not self.up:
            self.w.at(self.w.now + 1.0, lambda: self.client_cancel(key))
            return
        self.w.log(f"client: cancel {execution_id[-4:]}")
        self.run("cancel", lambda tx, now: self.w.commands.cancel(tx, execution_id, now))

    def _approver(self, approval_id: str) -> None:
        delay, grant = self.w.approver_for()
        if delay is None:
            return  # nobody answers: it expires
        choice = ApprovalChoice.GRANT if grant else ApprovalChoice.DENY

        def decide() -> None:
            if not self.up:
                self.w.at(self.w.now + 1.0, decide)
                return
            self.w.log(f"approver: {choice.value} {approval_id[-4:]}")
            self.run(
                "decide",
                lambda tx, now: self.w.commands.decide_approval(
                    tx, approval_id, choice, decided_by="sim", rationale="", now=now
                ),
            )

        self.w.at(self.w.now + delay, decide)

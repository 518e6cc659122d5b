"""The simulated world: a kernel, agents, a client, an approver, a network and
a clock, in one thread, driven by one event queue.

The kernel is `KernelCommands` over `MemoryRecords` -- the very commands the
real kernel runs -- with a dispatcher, reaper and approval timer that tick once
a simulated second. Its memory (the occurrence counters, deliveries in flight)
is lost when it crashes; its records are not. Each agent drives the agent-side
rules (`Webhooks`, `Dispatch`, `interpret`, `conclude`) for programs carried in
the execution's input. Every message crosses the network, which the fault plan
may drop, duplicate, delay or cut.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from .._agent import (
    CancelHandler,
    CompleteExecution,
    Dispatch,
    DispatchReceived,
    ExecutionFetched,
    ExecutionReported,
    FailExecution,
    FetchExecution,
    HandlerFinished,
    HeartbeatAcked,
    HeartbeatFailed,
    LeaseLost,
    Meaning,
    Phase,
    SendHeartbeat,
    StartHandler,
    Superseded,
    Tick,
    Webhooks,
    conclude,
    interpret,
)
from .._agent import Outcome as HandlerOutcome
from .._approvals import ApprovalChoice
from .._canonical import canonical_json
from .._commands import KernelCommands, Records
from .._delivery import Delivery
from .._dispatch import DispatchSettings
from .._errors import LocalProtocolError
from .._memory import MemoryRecords, MemoryTx
from .._outcome import Decision, ErrorCode, Outcome, RateBucket, Refusal, StepDecision
from .._records import Agent, Execution, Idempotency, Lease, StepKind
from .._state import ApprovalStatus
from .._verdict import Action, Verdict
from .._wire import (
    CreateExecution,
    ExecutionCompletion,
    ExecutionFailure,
    StepSubmission,
    WebhookPayload,
)
from ._checks import Checker, Violation
from ._plan import AGENTS, Fault, FaultKind, FaultPlan, Job, MessageClass, SimConfig, Workload

__all__ = ["RunResult", "World"]

_START: Final = 1_800_000_000.0  # the kernel's clock at t = 0
_KINDS: Final = {"tool": StepKind.TOOL_CALL, "par": StepKind.TOOL_CALL, "llm": StepKind.LLM_CALL}
_NETWORK_FAULTS: Final = (FaultKind.DROP, FaultKind.DUPLICATE, FaultKind.DELAY)


def sim_policy(
    records: Records, execution: Execution, agent: Agent | None, sub: StepSubmission, now: float
) -> tuple[Verdict, tuple[RateBucket, ...]]:
    """The simulated governance: `wire_money` waits for a human, `delete_all`
    is denied, everything else is allowed."""
    if sub.target == "wire_money":
        return Verdict(
            action=Action.REQUIRE_APPROVAL, rule_id="wire-needs-human", approval_timeout_s=60.0
        ), ()
    if sub.target == "delete_all":
        return Verdict(action=Action.DENY, rule_id="no-delete", reason="destructive"), ()
    return Verdict(rule_id="allow"), ()


@dataclass(slots=True)
class RunResult:
    """What one run did, and what it broke."""

    seed: int
    violations: list[Violation]
    events: int
    sim_seconds: float
    statuses: dict[str, int]
    body_runs: int
    orphan_reruns: int
    #: seconds from the end of the last fault until every execution had ended
    settled_after: float = 0.0
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


class _Failure(Exception):
    """How a call ended other than with a value (it unwinds or fails the handler)."""

    def __init__(self, outcome: HandlerOutcome, detail: str = "") -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail


_UNWINDS: Final = (
    HandlerOutcome.BLOCKED,
    HandlerOutcome.TERMINATED,
    HandlerOutcome.LEASE_SUPERSEDED,
)


class World:
    """One simulated run. `run()` plays it to the end and returns its result."""

    def __init__(
        self,
        seed: int,
        config: SimConfig,
        plan: FaultPlan,
        workload: Workload,
        *,
        trace: bool = False,
    ) -> None:
        self.seed = seed
        self.config = config
        self.plan = plan
        self.workload = workload
        self.tracing = trace
        self.trace: list[str] = []
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._ids = 0
        self.events = 0
        self.net = random.Random(f"network:{seed}")
        self.timing = random.Random(f"timing:{seed}")
        self.records = MemoryRecords()
        self.check = Checker(self.records)
        self.settings = DispatchSettings(
            lease_timeout_s=config.lease_timeout_s,
            max_attempts=config.max_attempts,
            backoff_base_s=config.backoff_base_s,
            backoff_max_s=config.backoff_max_s,
        )
        self.commands = KernelCommands(
            settings=self.settings, new_id=self._new_id, policy=sim_policy
        )
        self.kernel = _Kernel(self)
        registering = self.records.begin()
        for agent_id in AGENTS:
            registering.put_agent(
                Agent(id=agent_id, webhook_url=f"sim://{agent_id}", secret="", registered_at=_START)
            )
        self.agents = {agent_id: _AgentNode(self, agent_id) for agent_id in AGENTS}
        self._network_faults = [f for f in plan.faults if f.kind in _NETWORK_FAULTS]
        self._partitions = [f for f in plan.faults if f.kind is FaultKind.PARTITION]
        self.quiet_at = max(plan.ends_at, max((j.at for j in workload.jobs), default=0.0))
        # A clock set back delays every timeout by as much: the bound grows by it.
        set_back = sum(
            -f.delta for f in plan.faults if f.kind is FaultKind.CLOCK_JUMP and f.delta < 0
        )
        self.horizon = self.quiet_at + config.liveness_bound_s + set_back
        self._approvals_seen = 0

    # -- plumbing ------------------------------------------------------------------

    def _new_id(self) -> str:
        self._ids += 1
        return f"00000000-0000-7000-8000-{self._ids:012x}"

    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (max(when, self.now), self._seq, fn))

    def log(self, text: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.now:10.3f}  {text}")

    def send(self, cls: MessageClass, agent_id: str, deliver: Callable[[], None]) -> None:
        """Put one message on the network between the kernel and `agent_id`."""
        latency = self.net.uniform(0.0005, 0.005)
        copies = 1
        now = self.now
        for fault in self._partitions:
            if fault.at <= now < fault.ends_at and fault.agent == agent_id:
                self.log(f"net: {cls.value} to/from {agent_id} lost (partition)")
                return
        for fault in self._network_faults:
            if not (fault.at <= now < fault.ends_at):
                continue
            if fault.messages is not MessageClass.ALL and fault.messages is not cls:
                continue
            if self.net.random() >= fault.rate:
                continue
            if fault.kind is FaultKind.DROP:
                self.log(f"net: {cls.value} to/from {agent_id} dropped")
                return
            if fault.kind is FaultKind.DUPLICATE:
                copies = 2
            else:
                latency += self.net.uniform(0.0, abs(fault.delta))
        self.at(now + latency, deliver)
        if copies == 2:
            self.log(f"net: {cls.value} to/from {agent_id} duplicated")
            self.at(now + latency + self.net.uniform(0.0, 0.05), deliver)

    # -- the run ---------------------------------------------------------------------

    def run(self) -> RunResult:
        for job in self.workload.jobs:
            self.at(job.at, functools.partial(self.kernel.client_create, job))
            if job.cancel_at is not None:
                self.at(job.cancel_at, functools.partial(self.kernel.client_cancel, job.key))
        for fault in self.plan.faults:
            self.at(fault.at, functools.partial(self._fault, fault))
        self.at(0.0, self.kernel.tick)
        while self._queue:
            when, _, fn = heapq.heappop(self._queue)
            self.now = self.check.now = when
            self.events += 1
            try:
                fn()
            except LocalProtocolError as err:
                self.check.fail("rule_error", f"{type(err).__name__}: {err}")
            if self.check.violations:
                break
            if self.now >= self.quiet_at and self._all_done():
                break
            if self.now > self.horizon:
                self._liveness_failed()
                break
        self.check.final()
        statuses: dict[str, int] = {}
        for execution in self.records.executions.values():
            statuses[execution.status.value] = statuses.get(execution.status.value, 0) + 1
        return RunResult(
            seed=self.seed,
            violations=self.check.violations,
            events=self.events,
            sim_seconds=self.now,
            statuses=dict(sorted(statuses.items())),
            body_runs=sum(self.check.body_runs.values()),
            orphan_reruns=self.check.orphan_reruns,
            settled_after=max(self.now - self.quiet_at, 0.0),
            trace=self.trace,
        )

    def _all_done(self) -> bool:
        if len(self.kernel.created) < len(self.workload.jobs):
            return False
        return all(e.status.is_terminal for e in self.records.executions.values())

    def _liveness_failed(self) -> None:
        stuck = [
            f"{e.id} {e.status.value} dispatch={e.dispatch}"
            for e in self.records.executions.values()
            if not e.status.is_terminal
        ]
        missing = len(self.workload.jobs) - len(self.kernel.created)
        self.check.fail(
            "liveness",
            f"{self.horizon - self.quiet_at:.0f}s after the last fault "
            f"(t={self.quiet_at:.3f}): {len(stuck)} executions unfinished, "
            f"{missing} never created: " + "; ".join(stuck),
        )

    def _fault(self, fault: Fault) -> None:
        self.log(f"FAULT {fault.describe()}")
        kind = fault.kind
        if kind is FaultKind.AGENT_CRASH:
            self.agents[fault.agent].crash(fault.duration)
        elif kind is FaultKind.AGENT_STALL:
            self.agents[fault.agent].stall(fault.duration)
        elif kind in (FaultKind.KERNEL_CRASH, FaultKind.KERNEL_RESTART):
            self.kernel.stop(crash=kind is FaultKind.KERNEL_CRASH, downtime=fault.duration)
        elif kind is FaultKind.CLOCK_JUMP:
            self.kernel.clock_offset += fault.delta

    def approver_for(self) -> tuple[float | None, bool]:
        """The next approval's decision delay (None: never) and choice."""
        index = self._approvals_seen % max(len(self.workload.approver_delays), 1)
        self._approvals_seen += 1
        if not self.workload.approver_delays:
            return None, False
        return self.workload.approver_delays[index], self.workload.approver_grants[index]


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


class _Kernel:
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
        return _START + self.w.now + self.clock_offset

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
        except (LocalProtocolError, ValueError, KeyError, AssertionError) as err:
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
        self.w.log(f"kernel: webhook {delivery.execution_id[-4:]} attempt {delivery.attempt}")
        agent = self.w.agents[delivery.agent_id]

        def answered(acked: bool) -> None:
            if incarnation == self.incarnation and self.up:
                self._delivered(key, acked)

        self.w.send(MessageClass.WEBHOOKS, agent.id, lambda: agent.webhook(payload, answered))
        self.w.at(self.w.now + self.w.config.delivery_timeout_s, lambda: answered(False))

    def _delivered(self, key: tuple[str, str, int], acked: bool) -> None:
        delivery = self.deliveries.pop(key, None)
        if delivery is None:
            return  # already answered (or timed out)
        jitter = self.w.timing.random()
        self.run(
            "delivered",
            lambda tx, now: self.w.commands.delivered(
                tx, delivery, is_acked=acked, jitter=jitter, now=now
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
                self._delivered(key, False)
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


# -- the agents ------------------------------------------------------------------------


class _AgentNode:
    """An agent process: handlers by execution, under one incarnation."""

    def __init__(self, world: World, agent_id: str) -> None:
        self.w = world
        self.id = agent_id
        self.up = True
        self.incarnation = 0
        self.stalled_until = 0.0
        self.webhooks = Webhooks()
        self.handlers: dict[str, _Handler] = {}

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run `fn` on this process after `delay`, unless it crashed meanwhile;
        a stall holds it until the process thaws."""
        incarnation = self.incarnation

        def fire() -> None:
            if incarnation != self.incarnation:
                return
            if self.w.now < self.stalled_until:
                self.w.at(self.stalled_until, fire)
                return
            fn()

        self.w.at(self.w.now + delay, fire)

    def crash(self, downtime: float) -> None:
        self.up = False
        self.incarnation += 1
        self.handlers.clear()
        self.webhooks = Webhooks()

        def restart() -> None:
            self.up = True
            self.w.log(f"{self.id}: restarted")

        self.w.at(self.w.now + downtime, restart)

    def stall(self, duration: float) -> None:
        self.stalled_until = max(self.stalled_until, self.w.now + duration)

    def webhook(self, payload: WebhookPayload, answered: Callable[[bool], None]) -> None:
        """A webhook arrives (the kernel waits for the answer, or times out)."""
        if not self.up:
            self.w.at(self.w.now + 0.001, lambda: answered(False))  # connection refused
            return

        def receive() -> None:
            decision = self.webhooks.received(payload)
            self.w.log(
                f"{self.id}: webhook {payload.execution_id[-4:]} "
                f"attempt {payload.dispatch_attempt}: {decision}"
            )
            self.w.send(MessageClass.WEBHOOKS, self.id, lambda: answered(True))
            if decision == "ignore":
                return
            old = self.handlers.pop(payload.execution_id, None)
            if old is not None:
                old.interrupt(Superseded())
            handler = self.handlers[payload.execution_id] = _Handler(self, payload)
            handler.start()

        self.later(0.0, receive)

    def call(
        self,
        handler: _Handler,
        op: str,
        body: Any,
        reply: Callable[[object], None],
        unreachable: Callable[[], None],
    ) -> None:
        """One request to the kernel, as the SDK's client makes it: a refused
        connection is retried for a while; a request that got no answer in time
        is `KernelUnreachable` (it may have reached the kernel: never resent)."""
        first = self.w.now
        incarnation = self.incarnation
        kernel = self.w.kernel
        state = {"done": False, "attempt": 0}

        def settle(answer: object | None) -> None:
            if state["done"] or incarnation != self.incarnation or not handler.alive:
                return
            state["done"] = True
            if answer is None:
                unreachable()
            else:
                reply(answer)

        def attempt() -> None:
            state["attempt"] += 1
            number = state["attempt"]

            def at_kernel() -> None:
                if not kernel.up:
                    self.later(0.001, lambda: refused(number))
                    return
                answer = kernel.request(self.id, op, handler.execution_id, handler.lease, body)
                self.w.send(
                    MessageClass.REPLIES, self.id, lambda: self.later(0.0, lambda: settle(answer))
                )

            self.w.send(MessageClass.REQUESTS, self.id, at_kernel)
            self.later(self.w.config.request_timeout_s, lambda: timed_out(number))

        def refused(number: int) -> None:
            if state["done"] or number != state["attempt"]:
                return
            if self.w.now - first >= self.w.config.refused_give_up_s:
                settle(None)
            else:
                state["attempt"] += 1  # the pending timeout belongs to the refused attempt
                self.later(self.w.config.refused_retry_s, attempt)

        def timed_out(number: int) -> None:
            if number == state["attempt"]:
                settle(None)

        attempt()


def _result_of(kind: str, target: str, args: object) -> str:
    """What a body computes: a deterministic value of its call."""
    digest = hashlib.sha256(f"{kind}|{target}|{json.dumps(args, sort_keys=True)}".encode())
    return json.dumps({"value": digest.hexdigest()[:12]})


class _Handler:
    """One dispatch on an agent: the `Dispatch` machine and the program it runs."""

    def __init__(self, node: _AgentNode, payload: WebhookPayload) -> None:
        self.node = node
        self.w = node.w
        self.payload = payload
        self.execution_id = payload.execution_id
        self.lease = Lease(dispatch_id=payload.dispatch_id, attempt=payload.dispatch_attempt)
        self.machine = Dispatch()
        self.alive = True
        self.running = False
        self.ops: list[list[Any]] = []
        self.ending = "complete"
        self.pc = 0
        self.results: list[object] = []
        self._tick_at: float | None = None

    def tag(self) -> str:
        return f"{self.node.id} {self.execution_id[-4:]}#{self.lease.attempt}"

    # -- the Dispatch machine ----------------------------------------------------------

    def feed(self, event: Any) -> None:
        for action in self.machine.handle(event, now=self.w.kernel.clock):
            self.act(action)
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        deadline = self.machine.next_deadline()
        if deadline is not None and self.alive and deadline != self._tick_at:
            self._tick_at = deadline
            self.node.later(max(deadline - self.w.kernel.clock, 0.0), self.tick)

    def tick(self) -> None:
        self._tick_at = None
        if not self.alive or self.machine.state not in (Phase.RUNNING, Phase.FINISHING):
            return
        deadline = self.machine.next_deadline()
        if deadline is not None and self.w.kernel.clock >= deadline:
            self.feed(Tick())
        else:  # the clock jumped back: wait for it
            self._schedule_tick()

    def act(self, action: object) -> None:
        if isinstance(action, FetchExecution):
            self.node.call(self, "get", None, self.fetched, self.gone)
        elif isinstance(action, StartHandler):
            self.running = True
            self.next_op()
        elif isinstance(action, SendHeartbeat):
            self.node.call(self, "heartbeat", None, self.heartbeat_reply, self.heartbeat_lost)
        elif isinstance(action, CancelHandler):
            self.alive = False
            self.w.log(f"{self.tag()}: handler cancelled")
        elif isinstance(action, (CompleteExecution, FailExecution)):
            ending: Any = (
                ExecutionCompletion(output=action.output, state=action.state)
                if isinstance(action, CompleteExecution)
                else ExecutionFailure(error=action.reason)
            )
            self.w.log(f"{self.tag()}: ends the execution ({type(ending).__name__})")
            self.node.call(self, "end", ending, self.reported, self.reported_unreachable)

    def start(self) -> None:
        self.feed(DispatchReceived(payload=self.payload))

    def interrupt(self, event: LeaseLost | Superseded) -> None:
        """The lease is gone: cancel the handler, which then reports finishing."""
        if self.machine.state in (Phase.DONE, Phase.SUPERSEDED, Phase.ERROR):
            self.alive = False
            return
        was_running = self.running
        self.feed(event)
        self.alive = False
        phase: Phase = self.machine.state
        if was_running and phase is Phase.SUPERSEDED:
            self.machine.handle(HandlerFinished(conclusion=None), now=self.w.kernel.clock)
        self.release()

    def release(self) -> None:
        self.alive = False
        self.node.webhooks.finished(self.execution_id, self.lease)
        if self.node.handlers.get(self.execution_id) is self:
            del self.node.handlers[self.execution_id]

    def fetched(self, answer: object) -> None:
        if answer == "missing" or not isinstance(answer, str):
            self.unexpected(f"execution fetch answered {answer!r}")
            return
        execution = self.w.records.executions.get(self.execution_id)
        program = json.loads(execution.input) if execution is not None else {}
        self.ops = program.get("ops", [])
        self.ending = program.get("end", "complete")
        self.feed(ExecutionFetched(status=answer))
        if self.machine.state is Phase.DONE:
            self.release()

    def gone(self) -> None:
        """The kernel did not answer the fetch: drop this delivery."""
        self.release()

    def heartbeat_reply(self, answer: object) -> None:
        if isinstance(answer, Refusal) and answer.code is ErrorCode.LEASE_SUPERSEDED:
            self.interrupt(LeaseLost())
        elif isinstance(answer, Refusal):
            self.feed(HeartbeatFailed())
        else:
            self.feed(HeartbeatAcked())

    def heartbeat_lost(self) -> None:
        self.feed(HeartbeatFailed())

    def reported(self, answer: object) -> None:
        if isinstance(answer, Refusal) and answer.code is ErrorCode.LEASE_SUPERSEDED:
            self.interrupt(LeaseLost())
            return
        self.feed(ExecutionReported())
        self.release()

    def reported_unreachable(self) -> None:
        self.feed(ExecutionReported())
        self.release()

    def unexpected(self, what: str) -> None:
        self.w.check.fail("unexpected_reply", f"{self.tag()}: {what}")
        self.release()

    # -- the program -------------------------------------------------------------------

    def next_op(self) -> None:
        if not self.alive:
            return
        if self.pc >= len(self.ops):
            if self.ending == "fail":
                self.finish(HandlerOutcome.OTHER_ERROR, "the program fails", "SimError")
            else:
                self.finish(HandlerOutcome.RETURNED)
            return
        op = self.ops[self.pc]
        name, target, args, idem, catch = op[0], op[1], op[2], op[3], op[4]
        copies = int(op[5]) if name == "par" else 1
        outstanding = [copies]
        failures: list[_Failure] = []
        values: list[object] = []

        def done(value: object | _Failure) -> None:
            if isinstance(value, _Failure):
                failures.append(value)
            else:
                values.append(value)
            outstanding[0] -= 1
            if outstanding[0] or not self.alive:
                return
            unwind = next((f for f in failures if f.outcome in _UNWINDS), None)
            if unwind is not None:
                self.finish(unwind.outcome, unwind.detail)
                return
            if failures and not catch:
                self.finish(failures[0].outcome, failures[0].detail)
                return
            self.results.append(sorted(map(str, values)))
            self.pc += 1
            self.next_op()

        for _ in range(copies):
            self.call(name, target, args, idem, done)

    def call(
        self, name: str, target: str, args: object, idem: str, done: Callable[[Any], None]
    ) -> None:
        """One recording primitive: submit, then run the body, replay or raise."""
        submission = StepSubmission(
            kind=_KINDS.get(name, StepKind.LOCAL),
            target=target,
            args=canonical_json(json.dumps(args).encode()).decode(),
            idempotency=Idempotency(idem),
        )

        def decided(answer: object) -> None:
            if isinstance(answer, Refusal):
                if answer.code is ErrorCode.LEASE_SUPERSEDED:
                    self.interrupt(LeaseLost())
                else:
                    self.unexpected(
                        f"submit {target} refused: {answer.code.value} {answer.message}"
                    )
                return
            assert isinstance(answer, StepDecision)
            meaning = interpret(answer.decision.value, has_error=answer.error is not None)
            if meaning is Meaning.RUN_BODY:
                self.body(name, target, args, answer.step_id, done)
            elif meaning is Meaning.RETURN_RESULT:
                done(answer.result)
            elif meaning is Meaning.RAISE_RECORDED_ERROR:
                done(_Failure(HandlerOutcome.TOOL_ERROR, f"{target}: {answer.error}"))
            elif meaning is Meaning.RAISE_POLICY_ERROR:
                done(_Failure(HandlerOutcome.POLICY_ERROR, answer.reason))
            elif meaning is Meaning.RAISE_RATE_LIMITED:
                done(_Failure(HandlerOutcome.RATE_LIMITED, answer.reason))
            elif meaning is Meaning.RAISE_BLOCKED:
                done(_Failure(HandlerOutcome.BLOCKED))
            elif meaning is Meaning.RAISE_TERMINATED:
                done(_Failure(HandlerOutcome.TERMINATED))
            else:
                self.unexpected(f"submit {target} decided {answer.decision.value}")

        self.node.call(self, "submit", submission, decided, self.unreachable)

    def body(
        self, name: str, target: str, args: Any, step_id: str, done: Callable[[Any], None]
    ) -> None:
        self.w.check.body_started(self.execution_id, step_id)
        self.w.log(f"{self.tag()}: runs {target} ({step_id[:8]})")
        fails = isinstance(args, dict) and bool(args.get("fail"))
        result = _result_of(name, target, args)
        error = json.dumps({"reason": "tool_error", "message": f"{target} failed"})

        def finished() -> None:
            if not self.alive:
                return  # cancelled mid-body: nothing is reported

            def recorded(answer: object) -> None:
                if isinstance(answer, Refusal):
                    if answer.code is ErrorCode.LEASE_SUPERSEDED:
                        self.interrupt(LeaseLost())
                    else:
                        self.unexpected(f"{target} result refused: {answer.message}")
                    return
                assert isinstance(answer, StepDecision)
                if answer.decision is Decision.RECORDED:
                    failed = fails
                    value: str | None = result
                else:  # another attempt recorded it first: that outcome stands
                    failed = answer.error is not None
                    value = answer.result
                if failed:
                    done(_Failure(HandlerOutcome.TOOL_ERROR, f"{target} failed"))
                else:
                    done(value)

            op = "fail" if fails else "complete"
            self.node.call(
                self, op, (step_id, error if fails else result), recorded, self.unreachable
            )

        self.node.later(self.w.timing.uniform(0.01, 4.0), finished)

    def unreachable(self) -> None:
        """A call got no answer: the SDK cancels the handler and the dispatch unwinds."""
        if not self.alive:
            return
        self.w.log(f"{self.tag()}: kernel unreachable, unwinding")
        self.finish(HandlerOutcome.LEASE_SUPERSEDED)

    def finish(self, outcome: HandlerOutcome, detail: str = "", error_class: str = "") -> None:
        if not self.alive:
            return
        self.running = False
        output = canonical_json(json.dumps({"results": self.results}).encode()).decode()
        conclusion = conclude(outcome, detail=detail, error_class=error_class, output=output)
        self.w.log(f"{self.tag()}: handler ends {outcome.value}")
        self.feed(HandlerFinished(conclusion=conclusion))
        if conclusion is None:
            self.release()

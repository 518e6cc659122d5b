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
import heapq
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from .._commands import KernelCommands, Records
from .._dispatch import DispatchSettings
from .._memory import MemoryRecords
from .._outcome import RateBucket
from .._records import Agent, Execution
from .._verdict import Action, Verdict
from .._wire import (
    StepSubmission,
)
from ._agent_node import AgentNode
from ._checks import Checker, Violation
from ._kernel_node import START, KernelNode
from ._plan import AGENTS, Fault, FaultKind, FaultPlan, MessageClass, SimConfig, Workload

__all__ = ["RunResult", "World"]

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
    #: body starts after their step ended that a forward clock step excuses
    excused: int = 0
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def _describe(err: BaseException) -> str:
    """An exception with where it was raised (the last frames of its traceback)."""
    lines = traceback.format_exception(err)
    return "".join(lines[-6:]).strip()


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
        self.kernel = KernelNode(self)
        registering = self.records.begin()
        for agent_id in AGENTS:
            registering.put_agent(
                Agent(id=agent_id, webhook_url=f"sim://{agent_id}", secret="", registered_at=START)
            )
        replicas = max(config.replicas, 1)
        self.agents = {
            agent_id: [AgentNode(self, agent_id, replica) for replica in range(replicas)]
            for agent_id in AGENTS
        }
        self.route = random.Random(f"route:{seed}")  # which process a webhook reaches
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

    def process(self, agent_id: str, replica: int) -> AgentNode:
        """One of the agent's processes (`replica` wraps around)."""
        processes = self.agents[agent_id]
        return processes[replica % len(processes)]

    def send(self, cls: MessageClass, node: AgentNode, deliver: Callable[[], None]) -> None:
        """Put one message on the network between the kernel and an agent process."""
        latency = self.net.uniform(0.0005, 0.005)
        copies = 1
        now = self.now
        agent_id = node.name
        for fault in self._partitions:
            if fault.at <= now < fault.ends_at and self.process(fault.agent, fault.replica) is node:
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
            except Exception as err:  # a rule (or the simulator) broke: name the seed
                self.check.fail("rule_error", _describe(err))
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
            excused=self.check.excused,
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
            self.process(fault.agent, fault.replica).crash(fault.duration)
        elif kind is FaultKind.AGENT_STALL:
            self.process(fault.agent, fault.replica).stall(fault.duration)
        elif kind in (FaultKind.KERNEL_CRASH, FaultKind.KERNEL_RESTART):
            self.kernel.stop(crash=kind is FaultKind.KERNEL_CRASH, downtime=fault.duration)
        elif kind is FaultKind.CLOCK_JUMP:
            self.kernel.clock_offset += fault.delta
            self.check.clock_stepped(fault.delta)

    def approver_for(self) -> tuple[float | None, bool]:
        """The next approval's decision delay (None: never) and choice."""
        index = self._approvals_seen % max(len(self.workload.approver_delays), 1)
        self._approvals_seen += 1
        if not self.workload.approver_delays:
            return None, False
        return self.workload.approver_delays[index], self.workload.approver_grants[index]

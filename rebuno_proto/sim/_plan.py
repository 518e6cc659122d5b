"""What a simulation runs: its settings, its workload and its fault plan.

Everything is drawn from a seed with `random.Random`, so a seed names one run.
A `FaultPlan` is plain data: a shrinker (or hypothesis) can remove faults from
it and run again, and the rest of the run still comes from the seed.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "AGENTS",
    "PROFILES",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "Job",
    "MessageClass",
    "SimConfig",
    "Workload",
    "draw_plan",
    "draw_workload",
]

#: The simulated agents' ids.
AGENTS: Final = ("alpha", "beta")


class FaultKind(enum.Enum):
    """What goes wrong.

    Network faults apply to every message of `messages` sent during
    `[at, at + duration)`, each with probability `rate`.
    """

    DROP = "drop"  # the message is lost
    DUPLICATE = "duplicate"  # it arrives twice
    DELAY = "delay"  # it arrives up to `delta` seconds late (so, reordered)
    PARTITION = "partition"  # every message to or from `agent` is lost
    AGENT_CRASH = "agent_crash"  # the agent process dies; back after `duration`
    AGENT_STALL = "agent_stall"  # the agent freezes for `duration` (no heartbeats)
    KERNEL_CRASH = "kernel_crash"  # kill -9: memory lost; back after `duration`
    KERNEL_RESTART = "kernel_restart"  # a clean stop and start
    CLOCK_JUMP = "clock_jump"  # the kernel's clock jumps by `delta` seconds


class MessageClass(enum.Enum):
    """Which messages a network fault touches."""

    ALL = "all"
    REQUESTS = "requests"  # agent to kernel
    REPLIES = "replies"  # kernel to agent
    WEBHOOKS = "webhooks"  # kernel to agent, and the agent's acknowledgement


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    kind: FaultKind
    at: float
    duration: float = 0.0
    agent: str = ""
    rate: float = 0.0
    delta: float = 0.0
    messages: MessageClass = MessageClass.ALL
    replica: int = 0  # which of the agent's processes (agent_crash, agent_stall, partition)

    @property
    def ends_at(self) -> float:
        return self.at + max(self.duration, 0.0)

    def describe(self) -> str:
        parts = [f"{self.kind.value} at {self.at:.3f}"]
        if self.duration:
            parts.append(f"for {self.duration:.3f}s")
        if self.agent:
            parts.append(f"agent={self.agent}#{self.replica}")
        if self.rate:
            parts.append(f"rate={self.rate:.2f}")
        if self.delta:
            parts.append(f"delta={self.delta:.3f}")
        if self.kind in (FaultKind.DROP, FaultKind.DUPLICATE, FaultKind.DELAY):
            parts.append(f"messages={self.messages.value}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """The faults of one run, in time order."""

    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(sorted(self.faults, key=_fault_order)))

    @property
    def ends_at(self) -> float:
        """When the last fault is over (0 for none)."""
        return max((f.ends_at for f in self.faults), default=0.0)

    def without(self, index: int, count: int = 1) -> FaultPlan:
        return FaultPlan(self.faults[:index] + self.faults[index + count :])

    def __len__(self) -> int:
        return len(self.faults)


def _fault_order(fault: Fault) -> tuple[float, str, str]:
    return (fault.at, fault.kind.value, fault.agent)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """The simulated world's settings (seconds of simulated time).

    `liveness_bound_s` is the stated bound: once the last fault is over, every
    execution must be terminal within it. It covers a lapsed lease, the longest
    delivery backoff, an approval that waits out its timeout, a backward clock
    jump, and re-running the longest program a few times.
    """

    max_executions: int = 5
    max_ops: int = 7
    fault_window_s: float = 60.0
    max_faults: int = 6
    lease_timeout_s: float = 30.0
    max_attempts: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    approval_timeout_s: float = 60.0
    tick_s: float = 1.0
    request_timeout_s: float = 10.0
    refused_retry_s: float = 0.5
    refused_give_up_s: float = 30.0
    delivery_timeout_s: float = 10.0
    max_clock_jump_s: float = 90.0
    liveness_bound_s: float = 1200.0
    replicas: int = 2  # processes per agent; webhooks go to any of them
    faults: bool = True


#: Named settings: `default`, and `harsh` -- short leases (6 s, so a stall or a
#: slow network loses them often), more executions and up to 14 faults.
PROFILES: Final = {
    "default": SimConfig(),
    "harsh": SimConfig(max_executions=8, max_ops=10, max_faults=14, lease_timeout_s=6.0),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One execution the simulated client creates: the program is its input."""

    key: str
    agent_id: str
    at: float
    session: str
    program: dict[str, object]
    cancel_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    jobs: tuple[Job, ...] = ()
    # seconds after its request an approver decides each approval (None: never)
    approver_delays: tuple[float | None, ...] = field(default_factory=tuple)
    approver_grants: tuple[bool, ...] = field(default_factory=tuple)


_TOOLS: Final = ("search", "fetch", "send_email", "charge_card", "wire_money", "delete_all")
_LLMS: Final = ("gpt", "claude")


def _op(rng: random.Random) -> list[object]:
    """One program operation: [op, target, args, idempotency, flags]."""
    roll = rng.random()
    args: dict[str, object] = {"n": rng.randrange(3)}
    if rng.random() < 0.15:
        args["fail"] = True  # the body fails (a tool error)
    catch = rng.random() < 0.5  # the handler catches a failure of this call
    if roll < 0.45:
        target = rng.choice(_TOOLS)
        idem = "at_most_once" if target in ("send_email", "charge_card") else "safe_to_retry"
        if rng.random() < 0.2:
            idem = "at_most_once" if idem == "safe_to_retry" else "safe_to_retry"
        return ["tool", target, args, idem, catch]
    if roll < 0.6:
        return [
            "llm",
            rng.choice(_LLMS),
            {"prompt": f"p{rng.randrange(4)}"},
            "safe_to_retry",
            catch,
        ]
    if roll < 0.75:
        return ["local", f"think{rng.randrange(2)}", args, "safe_to_retry", catch]
    # parallel identical calls: the same effect k times at once
    target = rng.choice(("search", "fetch", "send_email"))
    idem = "at_most_once" if target == "send_email" else "safe_to_retry"
    return ["par", target, args, idem, catch, rng.randint(2, 3)]


def draw_workload(seed: int, config: SimConfig) -> Workload:
    """The executions a run creates, their programs, and the approvers' choices."""
    rng = random.Random(f"workload:{seed}")
    count = rng.randint(1, config.max_executions)
    jobs = []
    for index in range(count):
        ops = [_op(rng) for _ in range(rng.randint(1, config.max_ops))]
        ending = "fail" if rng.random() < 0.1 else "complete"
        session = f"s{rng.randrange(2)}" if rng.random() < 0.3 else ""
        at = rng.uniform(0.0, 20.0)
        cancel_at = at + rng.uniform(1.0, 70.0) if rng.random() < 0.1 else None
        jobs.append(
            Job(
                key=f"job-{index}",
                agent_id=rng.choice(AGENTS),
                at=at,
                session=session,
                program={"ops": ops, "end": ending, "job": index},
                cancel_at=cancel_at,
            )
        )
    delays: list[float | None] = []
    grants: list[bool] = []
    for _ in range(16):
        delays.append(None if rng.random() < 0.2 else rng.uniform(0.5, 80.0))
        grants.append(rng.random() < 0.7)
    return Workload(jobs=tuple(jobs), approver_delays=tuple(delays), approver_grants=tuple(grants))


def draw_plan(seed: int, config: SimConfig) -> FaultPlan:
    """The fault plan a seed runs with (empty if `config.faults` is off)."""
    if not config.faults:
        return FaultPlan()
    rng = random.Random(f"faults:{seed}")
    faults = [_draw_fault(rng, config) for _ in range(rng.randint(0, config.max_faults))]
    return FaultPlan(tuple(faults))


#: How long a fault aimed at one agent process lasts, in seconds (low, high).
_PROCESS_FAULT_SECONDS: Final = {
    FaultKind.PARTITION: (1.0, 70.0),
    FaultKind.AGENT_CRASH: (0.1, 60.0),
    FaultKind.AGENT_STALL: (1.0, 70.0),
}


def _draw_fault(rng: random.Random, config: SimConfig) -> Fault:
    kind = rng.choice(list(FaultKind))
    at = round(rng.uniform(0.0, config.fault_window_s), 3)
    agent = rng.choice(AGENTS)
    replica = rng.randrange(max(config.replicas, 1))
    if kind in (FaultKind.DROP, FaultKind.DUPLICATE, FaultKind.DELAY):
        return Fault(
            kind=kind,
            at=at,
            duration=round(rng.uniform(1.0, 60.0), 3),
            rate=round(rng.uniform(0.05, 0.6), 2),
            delta=round(rng.uniform(0.1, 20.0), 3) if kind is FaultKind.DELAY else 0.0,
            messages=rng.choice(list(MessageClass)),
        )
    if kind in _PROCESS_FAULT_SECONDS:
        low, high = _PROCESS_FAULT_SECONDS[kind]
        return Fault(
            kind=kind,
            at=at,
            duration=round(rng.uniform(low, high), 3),
            agent=agent,
            replica=replica,
        )
    if kind in (FaultKind.KERNEL_CRASH, FaultKind.KERNEL_RESTART):
        return Fault(kind=kind, at=at, duration=round(rng.uniform(0.1, 45.0), 3))
    jump = config.max_clock_jump_s
    return Fault(kind=kind, at=at, delta=round(rng.uniform(-jump, jump), 3))

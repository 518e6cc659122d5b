"""Deterministic simulation of the whole protocol, offline, with faults.

One thread runs the kernel's own commands (`rebuno_proto.KernelCommands` over
`rebuno_proto.MemoryRecords`), simulated agents driving the agent-side rules, a
client, a human approver, a network and a clock. A seed draws the workload
(programs of tool calls, local steps, LLM calls and parallel identical calls
that finish or fail) and a `FaultPlan`: messages dropped, duplicated, delayed
and reordered, partitions, agents crashed or frozen, the kernel killed (its
memory lost, its records kept) or cleanly restarted, its clock jumped.

After every event the run checks the invariants in `INVARIANTS`. The same seed
and code give the same trace, byte for byte.

    >>> from rebuno_proto.sim import run_seed
    >>> result = run_seed(7)
    >>> result.ok
    True

From a shell: `python -m rebuno_proto.sim --seeds 1000` runs seeds 0..999;
`python -m rebuno_proto.sim --seed 7 --trace` prints one run's trace. See
docs/testing.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TypeVar

from ._checks import INVARIANTS, Violation
from ._plan import (
    AGENTS,
    PROFILES,
    Fault,
    FaultKind,
    FaultPlan,
    Job,
    MessageClass,
    SimConfig,
    Workload,
    draw_plan,
    draw_workload,
)
from ._world import RunResult, World

__all__ = [
    "AGENTS",
    "INVARIANTS",
    "PROFILES",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "Job",
    "MessageClass",
    "RunResult",
    "Shrunk",
    "SimConfig",
    "Violation",
    "Workload",
    "draw_plan",
    "draw_workload",
    "run",
    "run_seed",
    "run_seeds",
    "shrink",
]

DEFAULT_CONFIG = SimConfig()
T = TypeVar("T")


def run(
    seed: int,
    *,
    plan: FaultPlan | None = None,
    workload: Workload | None = None,
    config: SimConfig = DEFAULT_CONFIG,
    trace: bool = False,
) -> RunResult:
    """Run one simulation. `plan` and `workload` default to the seed's own."""
    return World(
        seed,
        config,
        draw_plan(seed, config) if plan is None else plan,
        draw_workload(seed, config) if workload is None else workload,
        trace=trace,
    ).run()


def run_seed(seed: int, *, config: SimConfig = DEFAULT_CONFIG, trace: bool = False) -> RunResult:
    """Run the seed's own workload under the seed's own fault plan."""
    return run(seed, config=config, trace=trace)


def run_seeds(start: int, count: int, *, config: SimConfig = DEFAULT_CONFIG) -> Iterator[RunResult]:
    """Run seeds `start .. start + count - 1`, yielding each result."""
    for seed in range(start, start + count):
        yield run_seed(seed, config=config)


class Shrunk:
    """A failing run made smaller: fewer faults, fewer executions, same invariant."""

    def __init__(self, seed: int, plan: FaultPlan, workload: Workload, result: RunResult) -> None:
        self.seed = seed
        self.plan = plan
        self.workload = workload
        self.result = result

    def describe(self) -> list[str]:
        lines = [
            f"seed {self.seed}, shrunk to {len(self.plan)} faults and "
            f"{len(self.workload.jobs)} executions:"
        ]
        lines += [f"  fault: {fault.describe()}" for fault in self.plan.faults]
        lines += [
            f"  job: {job.key} on {job.agent_id} at {job.at:.3f}: {job.program}"
            for job in self.workload.jobs
        ]
        lines += [f"  violation: {v}" for v in self.result.violations]
        return lines


def shrink(
    seed: int,
    *,
    config: SimConfig = DEFAULT_CONFIG,
    plan: FaultPlan | None = None,
    workload: Workload | None = None,
    max_runs: int = 400,
) -> Shrunk | None:
    """Make a failing run smaller: drop faults and executions while the same
    invariant still breaks. `None` if the run does not fail. The shrunk run's
    result carries its trace."""
    full_plan = draw_plan(seed, config) if plan is None else plan
    full_workload = draw_workload(seed, config) if workload is None else workload
    first = run(seed, plan=full_plan, workload=full_workload, config=config)
    if first.ok:
        return None
    invariant = first.violations[0].invariant
    budget = [max_runs]

    def fails(p: FaultPlan, w: Workload) -> bool:
        if budget[0] <= 0:
            return False
        budget[0] -= 1
        result = run(seed, plan=p, workload=w, config=config)
        return any(v.invariant == invariant for v in result.violations)

    small_plan = _reduce(
        full_plan,
        len(full_plan),
        lambda p, i, n: p.without(i, n),
        lambda p: fails(p, full_workload),
    )
    jobs = _reduce(
        full_workload.jobs,
        len(full_workload.jobs),
        lambda js, i, n: js[:i] + js[i + n :],
        lambda js: fails(small_plan, replace(full_workload, jobs=js)),
    )
    small = replace(full_workload, jobs=jobs)
    result = run(seed, plan=small_plan, workload=small, config=config, trace=True)
    return Shrunk(seed, small_plan, small, result)


def _reduce(
    value: T, size: int, remove: Callable[[T, int, int], T], still_fails: Callable[[T], bool]
) -> T:
    """Greedy delta debugging: remove chunks (halves, quarters, ... single
    items) while the run still fails."""
    chunk = max(size // 2, 1)
    while size and chunk >= 1:
        index = 0
        while index < size:
            candidate = remove(value, index, chunk)
            if still_fails(candidate):
                value, size = candidate, size - min(chunk, size - index)
            else:
                index += chunk
        if chunk == 1:
            break
        chunk //= 2
    return value

"""The invariants a simulation checks after every event.

The checker watches the kernel's commands from outside the rules: it keeps its
own account of which lease is live, which outcome each step recorded, and how
often each step's body ran, and compares every command against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from .._memory import MemoryRecords
from .._outcome import Decision, Outcome, Refusal, StepDecision
from .._records import Idempotency, Lease
from .._state import ExecutionStatus, StepStatus

__all__ = ["INVARIANTS", "Checker", "Violation"]

#: Every invariant, by the name a `Violation` carries.
INVARIANTS: Final = {
    "one_outcome": "a step records at most one terminal outcome; it never changes",
    "no_rerun_after_outcome": "a step whose outcome is recorded never runs its body again",
    "at_most_once": ("a body runs at most once if any run of it, or its record, says at_most_once"),
    "orphan_reruns_bounded": "a safe_to_retry step's body runs at most once per lease",
    "event_seq_gapless": "each execution's events are numbered 1, 2, 3, ... with no gap",
    "superseded_lease": "no mutation is accepted under a superseded lease",
    "liveness": "once faults stop, every execution ends within the stated bound",
    "rule_error": "kernel and agent rules never raise on the messages they are given",
    "unexpected_reply": "a well-behaved agent never gets a refusal other than lease_superseded",
}

_RELEASING: Final = frozenset(
    {
        "dispatch.queued",
        "dispatch.failed",
        "execution.completed",
        "execution.failed",
        "execution.cancelled",
    }
)
_AGENT_OUTCOMES: Final = (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.DENIED)


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    at: float
    message: str

    def __str__(self) -> str:
        return f"{self.invariant} at t={self.at:.3f}: {self.message}"


class Checker:
    """Checks a run's invariants as it goes; `violations` collects what failed."""

    def __init__(self, records: MemoryRecords) -> None:
        self._records = records
        self.violations: list[Violation] = []
        self._outcomes: dict[str, tuple[StepStatus, str | None, str | None]] = {}
        self._live: dict[str, Lease | None] = {}
        self.grants: dict[str, int] = {}
        self.body_runs: dict[str, int] = {}
        # Membership only (never iterated, so hash order cannot reach a trace):
        self._strict: set[str] = set()  # steps some run of which was at_most_once
        self._ran_under: set[tuple[str, Lease]] = set()  # (step, lease) that ran a body
        self._steps_forward = 0  # forward steps of the kernel's wall clock so far
        self._proceeds: dict[tuple[str, Lease], int] = {}  # (step, lease) told proceed -> steps
        self.excused = 0  # body starts a forward clock step excuses (see `clock_stepped`)
        self._seqs: dict[str, int] = {}
        self.now = 0.0

    def fail(self, invariant: str, message: str) -> None:
        self.violations.append(Violation(invariant, self.now, message))

    # -- the kernel's side ---------------------------------------------------------

    def granted(self, execution_id: str, lease: Lease) -> None:
        """A claim handed out `lease`: the only one that may act now."""
        self._live[execution_id] = lease
        self.grants[execution_id] = self.grants.get(execution_id, 0) + 1

    def clock_stepped(self, delta: float) -> None:
        """The kernel's wall clock jumped by `delta`. A forward step lapses the
        leases in flight early -- leases assume clocks that run at the same
        rate -- so a handler told `proceed` before it may start its body after
        another attempt resolved the step. Such a start is counted in
        `excused`, not failed."""
        if delta > 0:
            self._steps_forward += 1

    def kernel_crashed(self) -> None:
        """A crash retires every lease granted before it."""
        self._live.clear()

    def command(
        self,
        label: str,
        outcome: Outcome[Any],
        lease: tuple[str, Lease] | None = None,
    ) -> None:
        """Check one committed command; `lease` is the agent's, if it carried one."""
        change = outcome.change
        reply = outcome.reply
        if (
            lease is not None
            and isinstance(reply, StepDecision)
            and reply.decision is Decision.PROCEED
        ):
            self._proceeds[(reply.step_id, lease[1])] = self._steps_forward
        if (
            lease is not None
            and not change.is_empty
            and not isinstance(outcome.reply, Refusal)
            and self._live.get(lease[0]) != lease[1]
        ):
            self.fail(
                "superseded_lease",
                f"{label} on {lease[0]} under {lease[1]} changed records; "
                f"live lease is {self._live.get(lease[0])}",
            )
        for step in change.steps:
            recorded = self._outcomes.get(step.step_id)
            now = (step.status, step.result, step.error)
            if recorded is not None and recorded != now:
                self.fail(
                    "one_outcome",
                    f"{label}: step {step.step_id} was {recorded[0].value} "
                    f"and is now {step.status.value}",
                )
            elif step.status.is_terminal:
                self._outcomes[step.step_id] = now
        for event in change.events:
            expected = self._seqs.get(event.execution_id, 0) + 1
            if event.seq != expected:
                self.fail(
                    "event_seq_gapless",
                    f"{label}: event {event.type} of {event.execution_id} has seq "
                    f"{event.seq}, expected {expected}",
                )
            self._seqs[event.execution_id] = event.seq
            if event.type in _RELEASING:
                self._live[event.execution_id] = None
        for execution in change.executions:
            if execution.last_event_seq != self._seqs.get(execution.id, 0):
                self.fail(
                    "event_seq_gapless",
                    f"{label}: execution {execution.id} says last_event_seq "
                    f"{execution.last_event_seq}, its log ends at {self._seqs.get(execution.id, 0)}",
                )

    # -- the agent's side ----------------------------------------------------------

    def body_started(
        self, execution_id: str, step_id: str, lease: Lease, idempotency: Idempotency
    ) -> None:
        """An agent is about to run the body of `step_id` under `lease`, as a
        call declared `idempotency` (it was told `proceed`)."""
        step = self._records.steps.get(step_id)
        runs = self.body_runs[step_id] = self.body_runs.get(step_id, 0) + 1
        if step is None:
            self.fail("no_rerun_after_outcome", f"body of unknown step {step_id} ran")
            return
        told = self._proceeds.get((step_id, lease), self._steps_forward)
        if step.status.is_terminal and told < self._steps_forward:
            self.excused += 1  # the clock stepped forward since `proceed` (see clock_stepped)
        elif step.status in _AGENT_OUTCOMES:
            self.fail(
                "no_rerun_after_outcome",
                f"body of step {step_id} ({step.target}) ran again after it {step.status.value}",
            )
        elif step.status is StepStatus.CANCELLED:
            execution = self._records.executions.get(execution_id)
            if execution is None or execution.status is not ExecutionStatus.CANCELLED:
                self.fail("no_rerun_after_outcome", f"body of cancelled step {step_id} ran")
        elif step.status is not StepStatus.EXECUTING:
            self.fail(
                "no_rerun_after_outcome",
                f"body of step {step_id} ran while it is {step.status.value}",
            )
        # at_most_once if any run of it was declared so, or the kernel says so.
        strict = (
            step_id in self._strict
            or idempotency is Idempotency.AT_MOST_ONCE
            or step.idempotency is Idempotency.AT_MOST_ONCE
        )
        if strict:
            self._strict.add(step_id)
        if strict and runs > 1:
            self.fail(
                "at_most_once", f"at_most_once step {step_id} ({step.target}) ran {runs} times"
            )
        if (step_id, lease) in self._ran_under:
            self.fail("orphan_reruns_bounded", f"step {step_id} ran twice under one lease {lease}")
        self._ran_under.add((step_id, lease))

    # -- at the end ------------------------------------------------------------------

    def final(self) -> None:
        """The whole log once more: gap-free, and in step with each execution."""
        for execution_id, execution in self._records.executions.items():
            log = self._records.events.get(execution_id, [])
            seqs = [e.seq for e in log]
            if seqs != list(range(1, len(log) + 1)) or execution.last_event_seq != len(log):
                self.fail(
                    "event_seq_gapless",
                    f"execution {execution_id}: log seqs {seqs[:5]}... "
                    f"last_event_seq {execution.last_event_seq}",
                )

    @property
    def orphan_reruns(self) -> int:
        """Body runs beyond the first, over every step."""
        return sum(runs - 1 for runs in self.body_runs.values())

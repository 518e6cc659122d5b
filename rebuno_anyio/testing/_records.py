"""What the harness observed: webhook deliveries, handler runs, and its errors.

These are the harness's own records, kept beside the kernel's: the kernel
cannot tell whether a handler started twice or how an agent answered a
webhook, and a test of resume behaviour needs both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Delivery", "HandlerRun", "HarnessError", "HarnessTimeout"]


class HarnessError(Exception):
    """The harness cannot go on: the kernel or the agent runtime failed inside
    it, or a fault was asked for that does not apply (no lease to expire...)."""


class HarnessTimeout(HarnessError, TimeoutError):
    """A wait ran out of time; the message shows where the execution stands."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """One webhook the kernel's dispatcher posted to the agent.

    Attributes:
        execution_id: the execution delivered.
        dispatch_id: the dispatch (with `attempt`, the lease).
        attempt: the delivery attempt: 1, then 2... when the lease lapsed.
        status: the HTTP status the agent answered (0: no answer, its instance
            had crashed; the kernel counts it a failed delivery).
        instance: which agent instance received it (0 is the first; a crash or
            a lease expiry brings up the next).
        is_duplicate: a copy the harness sent on top of the real delivery.
    """

    execution_id: str
    dispatch_id: str
    attempt: int
    status: int
    instance: int
    is_duplicate: bool = False


@dataclass(slots=True, kw_only=True)
class HandlerRun:
    """One call of the handler, from its start to its end.

    Attributes:
        execution_id: the execution it ran for.
        dispatch_id: the lease's dispatch.
        attempt: the lease's attempt.
        instance: the agent instance that ran it.
        outcome: `"running"` until it ends; then `"returned"`, `"crashed"`
            (its instance crashed), `"cancelled"`, or the name of the
            exception it raised (`"LeaseSuperseded"`, `"Blocked"`,
            `"PolicyError"`, `"ToolError"`, `"ValueError"`...).
        error: the exception it raised, traceback included (None otherwise).
    """

    execution_id: str
    dispatch_id: str
    attempt: int
    instance: int
    outcome: str = "running"
    error: BaseException | None = field(default=None, repr=False)

    @property
    def is_finished(self) -> bool:
        return self.outcome != "running"

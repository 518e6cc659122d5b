"""Test helpers: deterministic ids, record builders, and a tiny in-memory
kernel that applies each `Change` to dicts, as a store would."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from rebuno_proto import (
    ALLOW,
    NO_SESSION,
    Agent,
    Approval,
    ApprovalChoice,
    Change,
    CreateExecution,
    Delivery,
    DeliveryResult,
    DispatchRecord,
    DispatchSettings,
    DispatchStatus,
    Event,
    Execution,
    ExecutionCompletion,
    ExecutionFailure,
    ExecutionStatus,
    Idempotency,
    Lease,
    Outcome,
    Refusal,
    SessionView,
    Step,
    StepDecision,
    StepKind,
    StepStatus,
    StepSubmission,
    Verdict,
    cancel_execution,
    claim_dispatch,
    complete_step,
    create_execution,
    decide_approval,
    decide_submission,
    end_execution,
    expire_approval,
    fail_step,
    heartbeat,
    needs_indeterminate_check,
    needs_lease_owner,
    parse_step_submission,
    reclaim_lease,
    record_delivery,
    step_key,
)

R = TypeVar("R")

AGENT_ID = "agent-1"
EXEC_ID = "0192f1a0-0000-7000-8000-000000000000"
DISPATCH_ID = "0192f1a0-1111-7000-8000-000000000000"
T0 = 1_760_000_000.0


class Ids:
    """Deterministic UUID-shaped ids: ...-000000000001, -000000000002, ..."""

    def __init__(self, prefix: str = "0192f1a0-0000-7000-9000-") -> None:
        self.prefix = prefix
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"{self.prefix}{self.n:012x}"


def no_ids() -> str:
    raise AssertionError("this rule must not create ids")


def agent(agent_id: str = AGENT_ID) -> Agent:
    return Agent(id=agent_id, webhook_url="http://agent/webhook", secret="s3cret", registered_at=T0)


def dispatch(
    status: DispatchStatus = DispatchStatus.IN_FLIGHT,
    *,
    attempt: int = 1,
    dispatch_id: str = DISPATCH_ID,
    max_attempts: int = 5,
    locked_at: float | None = T0,
    next_attempt_at: float = T0,
) -> DispatchRecord:
    return DispatchRecord(
        id=dispatch_id,
        status=status,
        attempt=attempt,
        max_attempts=max_attempts,
        next_attempt_at=next_attempt_at,
        locked_at=locked_at,
    )


def execution(
    status: ExecutionStatus = ExecutionStatus.RUNNING,
    *,
    dispatch_record: DispatchRecord | None = None,
    exec_id: str = EXEC_ID,
    agent_id: str = AGENT_ID,
    last_event_seq: int = 3,
    **extra: Any,
) -> Execution:
    return Execution(
        id=exec_id,
        agent_id=agent_id,
        status=status,
        created_at=T0,
        updated_at=T0,
        last_event_seq=last_event_seq,
        dispatch=dispatch() if dispatch_record is None else dispatch_record,
        **extra,
    )


LEASE = Lease(dispatch_id=DISPATCH_ID, attempt=1)


def submission(
    kind: str = "tool_call",
    target: str = "search",
    args: Any = None,
    idempotency: str = "safe_to_retry",
) -> StepSubmission:
    fields: dict[str, Any] = {"kind": kind, "target": target, "idempotency": idempotency}
    fields["args"] = {"q": "x"} if args is None else args
    return parse_step_submission(json.dumps(fields).encode("utf-8"))


def step(
    sub: StepSubmission,
    status: StepStatus,
    *,
    occurrence: int = 0,
    exec_id: str = EXEC_ID,
    **extra: Any,
) -> Step:
    key = step_key(exec_id, sub, None if occurrence == 0 else occurrence - 1)
    return Step(
        step_id=key.step_id,
        execution_id=exec_id,
        kind=sub.kind,
        target=sub.target,
        args_hash=key.args_hash,
        occurrence=key.occurrence,
        status=status,
        idempotency=sub.idempotency,
        args=sub.args,
        started_at=T0,
        **extra,
    )


def event_types(change: Change) -> list[str]:
    return [e.type for e in change.events]


def payload(event: Event) -> dict[str, Any]:
    value = json.loads(event.payload)
    assert isinstance(value, dict)
    return value


def reply(outcome: Outcome[R]) -> R:
    """The reply of an outcome that must not be a refusal."""
    assert not isinstance(outcome.reply, Refusal), outcome.reply
    return outcome.reply


CounterKey = tuple[str, StepKind, str, str]


class Store:
    """Records by id, counters, the event log; `apply` commits a `Change`."""

    def __init__(self) -> None:
        self.executions: dict[str, Execution] = {}
        self.steps: dict[str, Step] = {}
        self.approvals: dict[str, Approval] = {}
        self.events: list[Event] = []
        self.counters: dict[CounterKey, int] = {}
        self.dispatch_owner: dict[str, str] = {}
        self.buckets: dict[str, Any] = {}
        self.order: list[str] = []  # executions in creation order

    def last_seq(self, execution_id: str) -> int:
        seqs = [e.seq for e in self.events if e.execution_id == execution_id]
        return max(seqs, default=0)

    def apply(self, change: Change) -> None:
        for ex in change.executions:
            if ex.id not in self.executions:
                self.order.append(ex.id)
            self.executions[ex.id] = ex
        for st in change.steps:
            self.steps[st.step_id] = st
        for ap in change.approvals:
            self.approvals[ap.id] = ap
        for eid in change.cleared_counters:
            for key in [k for k in self.counters if k[0] == eid]:
                del self.counters[key]
        for cw in change.counters:
            key = (cw.execution_id, cw.kind, cw.target, cw.args_hash)
            self.counters[key] = max(self.counters.get(key, -1), cw.value)
        for ev in change.events:
            # Gap-free and increasing per execution.
            assert ev.seq == self.last_seq(ev.execution_id) + 1, (
                ev,
                self.last_seq(ev.execution_id),
            )
            self.events.append(ev)
        for ex in change.executions:
            assert ex.last_event_seq == self.last_seq(ex.id), ex
        for did, eid in change.new_dispatches:
            assert did not in self.dispatch_owner
            self.dispatch_owner[did] = eid
        for bucket in change.rate_buckets:
            self.buckets[bucket.key] = bucket

    def events_of(self, execution_id: str) -> list[Event]:
        return [e for e in self.events if e.execution_id == execution_id]


class Kernel:
    """The service glue around the pure rules, over a `Store`."""

    def __init__(
        self, settings: DispatchSettings | None = None, *, agents: tuple[str, ...] = (AGENT_ID,)
    ) -> None:
        self.store = Store()
        self.ids = Ids()
        self.settings = settings or DispatchSettings()
        self.agents = {a: agent(a) for a in agents}
        self.now = T0

    # -- reads the service would do ------------------------------------------------

    def ex(self, execution_id: str) -> Execution:
        return self.store.executions[execution_id]

    def lease_owner(self, execution: Execution, lease: Lease) -> str | None:
        if not needs_lease_owner(execution, lease):
            return None
        return self.store.dispatch_owner.get(lease.dispatch_id)

    def head(self, agent_id: str, session: str, before: str | None = None) -> Execution | None:
        head = None
        for eid in self.store.order:
            if eid == before:
                break
            ex = self.store.executions[eid]
            if (
                ex.session == session
                and ex.agent_id == agent_id
                and ex.status is ExecutionStatus.COMPLETED
            ):
                head = ex
        return head

    def session_view(self, execution: Execution) -> SessionView:
        if not execution.session:
            return NO_SESSION
        for eid in self.store.order:
            other = self.store.executions[eid]
            if (
                eid != execution.id
                and other.session == execution.session
                and other.status is ExecutionStatus.PENDING
            ):
                return SessionView(
                    next_pending=other, head_for_next=self.head(other.agent_id, other.session)
                )
        return NO_SESSION

    def pending(self, execution_id: str) -> tuple[tuple[Approval, Step], ...]:
        out = []
        for ap in self.store.approvals.values():
            if ap.execution_id == execution_id and ap.status.value == "pending":
                out.append((ap, self.store.steps[ap.step_id]))
        return tuple(out)

    def commit(self, outcome: Outcome[R]) -> Outcome[R]:
        if isinstance(outcome.reply, Refusal):
            assert outcome.change.is_empty
        self.store.apply(outcome.change)
        return outcome

    # -- commands -----------------------------------------------------------------

    def create(
        self, *, input_: Any = None, session: str = "", agent_id: str = AGENT_ID, key: str = ""
    ) -> Execution:
        request = CreateExecution(
            agent_id=agent_id, input=json.dumps(input_), session=session, idempotency_key=key
        )
        busy = (
            any(
                ex.session == session and not ex.status.is_terminal
                for ex in self.store.executions.values()
            )
            if session
            else False
        )
        outcome = self.commit(
            create_execution(
                request=request,
                agent=self.agents.get(agent_id),
                duplicate=None,
                session_busy=busy,
                head=self.head(agent_id, session) if session else None,
                new_id=self.ids,
                now=self.now,
                settings=self.settings,
            )
        )
        return reply(outcome).execution

    def claim(self, execution_id: str) -> Delivery | None:
        ex = self.ex(execution_id)
        return self.commit(
            claim_dispatch(
                execution=ex,
                session=self.session_view(ex),
                new_id=self.ids,
                now=self.now,
                settings=self.settings,
            )
        ).reply  # type: ignore[return-value]

    def deliver(
        self, execution_id: str, lease: Lease, *, acked: bool, jitter: float = 0.0
    ) -> Outcome[None]:
        ex = self.ex(execution_id)
        return self.commit(
            record_delivery(
                execution=ex,
                lease=lease,
                result=DeliveryResult.ACKED if acked else DeliveryResult.REFUSED,
                jitter=jitter,
                session=self.session_view(ex),
                new_id=self.ids,
                now=self.now,
                settings=self.settings,
            )
        )

    def start(self, execution_id: str) -> Lease:
        """Claim and acknowledge: the lease a running handler holds."""
        delivery = self.claim(execution_id)
        assert delivery is not None
        self.deliver(execution_id, delivery.lease(), acked=True)
        return delivery.lease()

    def indeterminate(self, execution_id: str, sub: StepSubmission, args_hash: str) -> bool:
        for st in self.store.steps.values():
            if (
                st.execution_id == execution_id
                and st.status is StepStatus.FAILED
                and st.kind is sub.kind
                and st.target == sub.target
                and st.args_hash == args_hash
                and st.error is not None
                and json.loads(st.error).get("reason") == "indeterminate"
            ):
                return True
        return False

    def submit(
        self,
        execution_id: str,
        lease: Lease,
        sub: StepSubmission,
        *,
        verdict: Verdict = ALLOW,
        caller: str | None = AGENT_ID,
    ) -> Outcome[StepDecision]:
        ex = self.ex(execution_id)
        probe = step_key(execution_id, sub, None)
        counter = self.store.counters.get((execution_id, sub.kind, sub.target, probe.args_hash))
        key = step_key(execution_id, sub, counter)
        existing = self.store.steps.get(key.step_id)
        check = needs_indeterminate_check(ex, sub, existing)
        return self.commit(
            decide_submission(
                execution=ex,
                caller=caller,
                lease=lease,
                lease_owner=self.lease_owner(ex, lease),
                submission=sub,
                key=key,
                existing=existing,
                has_indeterminate_failure=check
                and self.indeterminate(execution_id, sub, key.args_hash),
                verdict=verdict,
                new_id=self.ids,
                now=self.now,
            )
        )

    def complete_step(
        self, execution_id: str, lease: Lease, step_id: str, result: str = '"ok"'
    ) -> Outcome[StepDecision]:
        ex = self.ex(execution_id)
        return self.commit(
            complete_step(
                execution=ex,
                caller=ex.agent_id,
                lease=lease,
                lease_owner=self.lease_owner(ex, lease),
                step=self.store.steps.get(step_id),
                result=result,
                now=self.now,
            )
        )

    def fail_step(
        self, execution_id: str, lease: Lease, step_id: str, error: str = '{"message":"boom"}'
    ) -> Outcome[StepDecision]:
        ex = self.ex(execution_id)
        return self.commit(
            fail_step(
                execution=ex,
                caller=ex.agent_id,
                lease=lease,
                lease_owner=self.lease_owner(ex, lease),
                step=self.store.steps.get(step_id),
                error=error,
                now=self.now,
            )
        )

    def heartbeat(self, execution_id: str, lease: Lease) -> Outcome[None]:
        ex = self.ex(execution_id)
        return self.commit(
            heartbeat(
                execution=ex,
                caller=ex.agent_id,
                lease=lease,
                lease_owner=self.lease_owner(ex, lease),
                now=self.now,
            )
        )

    def complete(
        self, execution_id: str, lease: Lease, output: str = '"done"', state: str | None = None
    ) -> Outcome[None]:
        ex = self.ex(execution_id)
        return self.commit(
            end_execution(
                execution=ex,
                caller=ex.agent_id,
                lease=lease,
                lease_owner=self.lease_owner(ex, lease),
                ending=ExecutionCompletion(output=output, state=state),
                session=self.session_view(ex),
                pending=self.pending(execution_id),
                new_id=self.ids,
                now=self.now,
                settings=self.settings,
            )
        )

    def fail(
        self, execution_id: str, lease: Lease, reason: str = "agent_error: X: y"
    ) -> Outcome[None]:
        ex = self.ex(execution_id)
        return self.commit(
            end_execution(
                execution=ex,
                caller=ex.agent_id,
                lease=lease,
                lease_owner=self.lease_owner(ex, lease),
                ending=ExecutionFailure(error=reason),
                session=self.session_view(ex),
                pending=self.pending(execution_id),
                new_id=self.ids,
                now=self.now,
                settings=self.settings,
            )
        )

    def cancel(self, execution_id: str) -> Outcome[None]:
        ex = self.ex(execution_id)
        active = tuple(
            s
            for s in self.store.steps.values()
            if s.execution_id == execution_id
            and s.status in (StepStatus.EXECUTING, StepStatus.ALLOWED)
        )
        return self.commit(
            cancel_execution(
                execution=ex,
                session=self.session_view(ex),
                pending=self.pending(execution_id),
                active_steps=active,
                new_id=self.ids,
                now=self.now,
                settings=self.settings,
            )
        )

    def reclaim(self, execution_id: str) -> Outcome[bool]:
        return self.commit(
            reclaim_lease(execution=self.ex(execution_id), now=self.now, settings=self.settings)
        )

    def decide(
        self, approval_id: str, choice: ApprovalChoice, *, decided_by: str = "", rationale: str = ""
    ) -> Outcome[None]:
        ap = self.store.approvals[approval_id]
        return self.commit(
            decide_approval(
                approval=ap,
                execution=self.ex(ap.execution_id),
                step=self.store.steps[ap.step_id],
                choice=choice,
                decided_by=decided_by,
                rationale=rationale,
                new_id=self.ids,
                now=self.now,
                settings=self.settings,
            )
        )

    def expire(self, approval_id: str) -> Outcome[bool]:
        ap = self.store.approvals[approval_id]
        return self.commit(
            expire_approval(
                approval=ap,
                execution=self.ex(ap.execution_id),
                step=self.store.steps[ap.step_id],
                new_id=self.ids,
                now=self.now,
                settings=self.settings,
            )
        )


def with_dispatch(ex: Execution, **changes: Any) -> Execution:
    assert ex.dispatch is not None
    return dataclasses.replace(ex, dispatch=dataclasses.replace(ex.dispatch, **changes))


__all__ = [
    "AGENT_ID",
    "DISPATCH_ID",
    "EXEC_ID",
    "LEASE",
    "T0",
    "Idempotency",
    "Ids",
    "Kernel",
    "Store",
    "agent",
    "dispatch",
    "event_types",
    "execution",
    "no_ids",
    "payload",
    "reply",
    "step",
    "submission",
    "with_dispatch",
]

"""Execution lifecycle, approvals, sessions and the event log (PROTOCOL.md
§6.1, §6.2, §7, §8)."""

import dataclasses
import json
from typing import Any

import pytest
from _support import (
    AGENT_ID,
    EXEC_ID,
    LEASE,
    T0,
    Ids,
    Kernel,
    agent,
    event_types,
    execution,
    no_ids,
    payload,
    reply,
    step,
    submission,
)

from rebuno_proto import (
    NO_SESSION,
    Action,
    Approval,
    ApprovalChoice,
    ApprovalStatus,
    Created,
    CreateExecution,
    Decision,
    DispatchSettings,
    DispatchStatus,
    ErrorCode,
    EventType,
    Execution,
    ExecutionCompletion,
    ExecutionStatus,
    Lease,
    Refusal,
    SessionView,
    StepStatus,
    Verdict,
    cancel_execution,
    create_execution,
    decide_approval,
    end_execution,
    expire_approval,
    previous_state,
)

SETTINGS = DispatchSettings()
APPROVAL = Verdict(action=Action.REQUIRE_APPROVAL, rule_id="hold", approval_timeout_s=900.0)


def request(**kw: Any) -> CreateExecution:
    fields = {
        "agent_id": AGENT_ID,
        "input": '{"prompt":"hi"}',
        "session": "",
        "idempotency_key": "",
    }
    fields.update(kw)
    return CreateExecution(**fields)


def create(**kw: Any) -> Any:
    args: dict[str, Any] = {
        "request": request(),
        "agent": agent(),
        "duplicate": None,
        "session_busy": False,
        "head": None,
        "new_id": Ids(),
        "now": T0,
        "settings": SETTINGS,
    }
    args.update(kw)
    return create_execution(**args)


def seqs_ok(events: list[Any]) -> None:
    by_exec: dict[str, list[int]] = {}
    for e in events:
        by_exec.setdefault(e.execution_id, []).append(e.seq)
    for seqs in by_exec.values():
        assert seqs == list(range(1, len(seqs) + 1))


# -- create ----------------------------------------------------------------------------------


def test_create_admits_at_once() -> None:
    outcome = create()
    created = reply(outcome)
    assert isinstance(created, Created)
    assert created.is_new
    ex = created.execution
    assert ex.id == "0192f1a0-0000-7000-9000-000000000001"
    assert ex.status is ExecutionStatus.RUNNING
    assert ex.input == '{"prompt":"hi"}'
    assert ex.parent_execution_id is None
    assert ex.dispatch is not None
    assert ex.dispatch.id == "0192f1a0-0000-7000-9000-000000000002"
    assert ex.last_event_seq == 3
    assert event_types(outcome.change) == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
    ]
    assert [payload(e) for e in outcome.change.events] == [
        {"execution_id": ex.id, "status": "pending"},
        {"execution_id": ex.id, "status": "running"},
        {"dispatch_id": ex.dispatch.id, "execution_id": ex.id, "status": "pending", "attempt": 0},
    ]
    assert outcome.change.executions == (ex,)
    assert outcome.change.new_dispatches == ((ex.dispatch.id, ex.id),)
    assert outcome.dispatch_due_at == T0
    seqs_ok(list(outcome.change.events))


def test_create_with_session_and_head() -> None:
    head = execution(ExecutionStatus.COMPLETED, exec_id="0192f1a0-0000-7000-8000-0000000000aa")
    outcome = create(request=request(session="chat-1", idempotency_key="k"), head=head)
    ex = reply(outcome).execution
    assert (ex.session, ex.idempotency_key, ex.parent_execution_id) == ("chat-1", "k", head.id)
    assert payload(outcome.change.events[0]) == {
        "execution_id": ex.id,
        "status": "pending",
        "session": "chat-1",
    }
    assert payload(outcome.change.events[1]) == {
        "execution_id": ex.id,
        "status": "running",
        "parent_execution_id": head.id,
    }


def test_create_queues_when_session_busy() -> None:
    outcome = create(request=request(session="chat-1"), session_busy=True)
    ex = reply(outcome).execution
    assert ex.status is ExecutionStatus.PENDING
    assert ex.dispatch is None
    assert event_types(outcome.change) == ["execution.created"]
    assert outcome.dispatch_due_at is None
    assert not outcome.change.new_dispatches


def test_create_unknown_agent_is_404() -> None:
    outcome = create(agent=None, request=request(agent_id="ghost"))
    assert outcome.reply == Refusal(ErrorCode.NOT_FOUND, "agent 'ghost' is not registered")
    assert outcome.change.is_empty


def test_create_idempotency_key() -> None:
    earlier = execution(input='{"prompt":"hi"}', idempotency_key="k")
    same = create(request=request(idempotency_key="k"), duplicate=earlier, new_id=no_ids)
    assert reply(same) == Created(execution=earlier, is_new=False)
    assert same.change.is_empty
    different = create(
        request=request(idempotency_key="k", input="1"), duplicate=earlier, new_id=no_ids
    )
    assert isinstance(different.reply, Refusal)
    assert different.reply.code is ErrorCode.CONFLICT
    assert "idempotency_key 'k' was already used" in different.reply.message
    other_session = create(
        request=request(idempotency_key="k", session="s"), duplicate=earlier, new_id=no_ids
    )
    assert isinstance(other_session.reply, Refusal)


# -- complete / fail -------------------------------------------------------------------------


def test_complete_execution() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    outcome = k.complete(ex.id, lease, output='{"answer":42}', state='{"n":1}')
    assert outcome.reply is None
    done = k.ex(ex.id)
    assert done.status is ExecutionStatus.COMPLETED
    assert (done.output, done.state, done.failure_reason) == ('{"answer":42}', '{"n":1}', "")
    assert done.dispatch is not None
    assert done.dispatch.status is DispatchStatus.EXHAUSTED
    assert event_types(outcome.change) == ["execution.completed"]
    assert payload(outcome.change.events[0]) == {
        "execution_id": ex.id,
        "status": "completed",
        "output": {"answer": 42},
    }


def test_fail_execution() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    outcome = k.fail(ex.id, lease, reason="tool_error: search: boom")
    failed = k.ex(ex.id)
    assert failed.status is ExecutionStatus.FAILED
    assert failed.failure_reason == "tool_error: search: boom"
    assert failed.output is None
    assert failed.state is None
    assert event_types(outcome.change) == ["execution.failed"]
    assert payload(outcome.change.events[0])["reason"] == "tool_error: search: boom"


@pytest.mark.parametrize(
    "status", [ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.CANCELLED]
)
@pytest.mark.parametrize("how", ["complete", "fail"])
def test_end_on_terminal_is_409_execution_terminal(status: ExecutionStatus, how: str) -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    k.store.executions[ex.id] = dataclasses.replace(k.ex(ex.id), status=status)
    outcome = k.complete(ex.id, lease) if how == "complete" else k.fail(ex.id, lease)
    assert outcome.reply == Refusal(ErrorCode.EXECUTION_TERMINAL, f"execution is {status.value}")
    assert outcome.reply.status == 409
    assert outcome.change.is_empty


def test_blocked_execution_may_still_complete_under_its_retired_lease() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    blocked = reply(k.submit(ex.id, lease, submission(), verdict=APPROVAL))
    outcome = k.complete(ex.id, lease, output='"early"')
    assert k.ex(ex.id).status is ExecutionStatus.COMPLETED
    assert event_types(outcome.change) == ["execution.completed", "approval.expired", "step.denied"]
    ap = k.store.approvals[blocked.approval_id or ""]
    assert (ap.status, ap.rationale) == (ApprovalStatus.EXPIRED, "execution_completed")
    st = k.store.steps[blocked.step_id]
    assert st.status is StepStatus.DENIED
    assert json.loads(st.error or "") == {"reason": "execution_completed"}


# -- cancel ----------------------------------------------------------------------------------


def test_cancel_running_with_executing_step() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    running = reply(k.submit(ex.id, lease, submission()))
    done = reply(k.submit(ex.id, lease, submission(target="b")))
    k.complete_step(ex.id, lease, done.step_id)
    outcome = k.cancel(ex.id)
    assert outcome.reply is None
    cancelled = k.ex(ex.id)
    assert cancelled.status is ExecutionStatus.CANCELLED
    assert cancelled.failure_reason == "client_cancelled"
    assert cancelled.dispatch is not None
    assert cancelled.dispatch.status is DispatchStatus.EXHAUSTED
    assert event_types(outcome.change) == ["execution.cancelled", "step.cancelled"]
    assert payload(outcome.change.events[0]) == {
        "execution_id": ex.id,
        "status": "cancelled",
        "reason": "client_cancelled",
    }
    assert payload(outcome.change.events[1])["error"] == {"reason": "execution_cancelled"}
    assert k.store.steps[running.step_id].status is StepStatus.CANCELLED
    assert k.store.steps[done.step_id].status is StepStatus.SUCCEEDED
    # The handler's next call learns it is over.
    assert reply(k.submit(ex.id, lease, submission())).decision is Decision.EXECUTION_TERMINAL
    assert k.heartbeat(ex.id, lease).reply == Refusal(
        ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded"
    )


def test_cancel_blocked_expires_pending_approvals() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    blocked = reply(k.submit(ex.id, lease, submission(), verdict=APPROVAL))
    outcome = k.cancel(ex.id)
    assert event_types(outcome.change) == ["execution.cancelled", "approval.expired", "step.denied"]
    expired = payload(outcome.change.events[1])
    assert expired["status"] == "expired"
    assert expired["rationale"] == "execution_cancelled"
    assert payload(outcome.change.events[2])["error"] == {"reason": "execution_cancelled"}
    assert k.store.steps[blocked.step_id].status is StepStatus.DENIED
    seqs_ok(k.store.events)


def test_cancel_allowed_step_is_cancelled() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    blocked = reply(k.submit(ex.id, lease, submission(), verdict=APPROVAL))
    k.decide(blocked.approval_id or "", ApprovalChoice.GRANT)
    outcome = k.cancel(ex.id)
    assert event_types(outcome.change) == ["execution.cancelled", "step.cancelled"]
    assert k.store.steps[blocked.step_id].status is StepStatus.CANCELLED


def test_cancel_skips_steps_that_are_not_active() -> None:
    ex = execution()
    done = step(submission(), StepStatus.SUCCEEDED)
    outcome = cancel_execution(
        execution=ex,
        session=NO_SESSION,
        pending=(),
        active_steps=(done,),
        new_id=no_ids,
        now=T0,
        settings=SETTINGS,
    )
    assert not outcome.change.steps
    assert event_types(outcome.change) == ["execution.cancelled"]


def test_cancel_pending_execution() -> None:
    k = Kernel()
    k.create(session="s")
    queued = k.create(session="s")
    assert k.ex(queued.id).status is ExecutionStatus.PENDING
    outcome = k.cancel(queued.id)
    assert k.ex(queued.id).status is ExecutionStatus.CANCELLED
    assert event_types(outcome.change) == ["execution.cancelled"]


@pytest.mark.parametrize(
    "status", [ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.CANCELLED]
)
def test_cancel_terminal_is_409(status: ExecutionStatus) -> None:
    outcome = cancel_execution(
        execution=execution(status),
        session=NO_SESSION,
        pending=(),
        active_steps=(),
        new_id=no_ids,
        now=T0,
        settings=SETTINGS,
    )
    assert outcome.reply == Refusal(ErrorCode.EXECUTION_TERMINAL, f"execution is {status.value}")
    assert outcome.change.is_empty


# -- approvals ---------------------------------------------------------------------------------


def blocked_kernel(verdict: Verdict = APPROVAL) -> tuple[Kernel, Execution, Lease, Any]:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    decision = reply(k.submit(ex.id, lease, submission(), verdict=verdict))
    assert decision.decision is Decision.BLOCKED
    assert decision.approval_id
    return k, ex, lease, decision


def test_grant_sequence_and_resubmit() -> None:
    k, ex, old, blocked = blocked_kernel()
    k.now += 5
    outcome = k.decide(
        blocked.approval_id, ApprovalChoice.GRANT, decided_by="alice", rationale="fine"
    )
    assert outcome.reply is None
    assert event_types(outcome.change) == [
        "approval.granted",
        "step.allowed",
        "execution.resumed",
        "dispatch.queued",
    ]
    granted = payload(outcome.change.events[0])
    assert granted == {
        "approval_id": blocked.approval_id,
        "step_id": blocked.step_id,
        "execution_id": ex.id,
        "status": "granted",
        "decided_by": "alice",
        "rationale": "fine",
    }
    assert payload(outcome.change.events[1])["rule_id"] == "hold"
    resumed = k.ex(ex.id)
    assert resumed.status is ExecutionStatus.RUNNING
    assert resumed.dispatch is not None
    assert resumed.dispatch.status is DispatchStatus.PENDING
    assert resumed.dispatch.id != old.dispatch_id
    assert outcome.dispatch_due_at == k.now
    ap = k.store.approvals[blocked.approval_id]
    assert (ap.status, ap.decided_by, ap.decided_at, ap.rationale) == (
        ApprovalStatus.GRANTED,
        "alice",
        k.now,
        "fine",
    )
    assert k.store.steps[blocked.step_id].status is StepStatus.ALLOWED
    # The old lease is superseded by the new dispatch.
    stale = k.submit(ex.id, old, submission())
    assert stale.reply == Refusal(ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded")
    lease = k.start(ex.id)
    resubmit = k.submit(ex.id, lease, submission())
    assert reply(resubmit) == dataclasses.replace(
        reply(resubmit), decision=Decision.PROCEED, step_id=blocked.step_id
    )
    assert event_types(resubmit.change) == ["step.executing"]
    seqs_ok(k.store.events)


@pytest.mark.parametrize(
    ("rationale", "reason"), [("too risky", "too risky"), ("", "approval_denied")]
)
def test_deny_sequence(rationale: str, reason: str) -> None:
    k, ex, _, blocked = blocked_kernel()
    outcome = k.decide(
        blocked.approval_id, ApprovalChoice.DENY, decided_by="bob", rationale=rationale
    )
    assert event_types(outcome.change) == [
        "approval.denied",
        "step.denied",
        "execution.resumed",
        "dispatch.queued",
    ]
    assert payload(outcome.change.events[0])["status"] == "denied"
    assert payload(outcome.change.events[1])["error"] == {"reason": reason}
    assert payload(outcome.change.events[1])["rule_id"] == "hold"
    assert k.ex(ex.id).status is ExecutionStatus.RUNNING
    lease = k.start(ex.id)
    replay = reply(k.submit(ex.id, lease, submission()))
    assert (replay.decision, replay.step_id, replay.reason, replay.rule_id) == (
        Decision.DENIED,
        blocked.step_id,
        reason,
        "hold",
    )


def test_expiry_sequence() -> None:
    k, ex, _, blocked = blocked_kernel()
    ap = k.store.approvals[blocked.approval_id]
    assert ap.timeout_at == k.now + 900
    k.now = ap.timeout_at - 0.001
    early = k.expire(blocked.approval_id)
    assert early.reply is False
    assert early.change.is_empty
    k.now = ap.timeout_at
    outcome = k.expire(blocked.approval_id)
    assert outcome.reply is True
    assert event_types(outcome.change) == [
        "approval.expired",
        "step.denied",
        "execution.resumed",
        "dispatch.queued",
    ]
    assert payload(outcome.change.events[0])["rationale"] == "timeout"
    assert payload(outcome.change.events[1])["error"] == {"reason": "approval_timeout"}
    assert k.store.approvals[blocked.approval_id].status is ApprovalStatus.EXPIRED
    assert k.ex(ex.id).status is ExecutionStatus.RUNNING
    # Expiring twice does nothing.
    assert k.expire(blocked.approval_id).reply is False


def test_expire_refuses_mismatches() -> None:
    k, ex, _, blocked = blocked_kernel()
    ap = k.store.approvals[blocked.approval_id]
    st = k.store.steps[blocked.step_id]
    late = ap.timeout_at + 1
    cases = [
        (ap, k.ex(ex.id), dataclasses.replace(st, approval_id="other")),
        (ap, dataclasses.replace(k.ex(ex.id), status=ExecutionStatus.RUNNING), st),
        (dataclasses.replace(ap, status=ApprovalStatus.GRANTED), k.ex(ex.id), st),
    ]
    for approval, current, stp in cases:
        outcome = expire_approval(
            approval=approval,
            execution=current,
            step=stp,
            new_id=no_ids,
            now=late,
            settings=SETTINGS,
        )
        assert outcome.reply is False
        assert outcome.change.is_empty


def _decide(approval: Approval, ex: Execution, st: Any, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "approval": approval,
        "execution": ex,
        "step": st,
        "choice": ApprovalChoice.GRANT,
        "decided_by": "",
        "rationale": "",
        "new_id": no_ids,
        "now": T0,
        "settings": SETTINGS,
    }
    args.update(kw)
    return decide_approval(**args)


def test_decide_refusals() -> None:
    k, ex, _, blocked = blocked_kernel(
        Verdict(action=Action.REQUIRE_APPROVAL, approvers=("alice", "bob"))
    )
    ap = k.store.approvals[blocked.approval_id]
    st = k.store.steps[blocked.step_id]
    current = k.ex(ex.id)

    outcome = _decide(ap, current, st, decided_by="mallory")
    assert outcome.reply == Refusal(
        ErrorCode.FORBIDDEN, "'mallory' may not decide this approval; approvers: alice, bob"
    )
    assert outcome.change.is_empty
    anonymous = _decide(ap, current, st)
    assert anonymous.reply.message.startswith("an anonymous caller may not decide")

    done = _decide(
        dataclasses.replace(ap, status=ApprovalStatus.DENIED), current, st, decided_by="alice"
    )
    assert done.reply == Refusal(ErrorCode.CONFLICT, "approval is already denied")

    mismatch = Refusal(ErrorCode.CONFLICT, "approval no longer matches a blocked step")
    for stp, cur in (
        (dataclasses.replace(st, step_id="f" * 64), current),
        (dataclasses.replace(st, execution_id="other"), current),
        (dataclasses.replace(st, approval_id="other"), current),
        (st, dataclasses.replace(current, id="other")),
        (st, dataclasses.replace(current, status=ExecutionStatus.RUNNING)),
    ):
        outcome = _decide(ap, cur, stp, decided_by="alice")
        assert outcome.reply == mismatch
        assert outcome.change.is_empty
    allowed = _decide(ap, current, st, decided_by="bob", new_id=Ids())
    assert allowed.reply is None


# -- sessions ---------------------------------------------------------------------------------


def test_previous_state() -> None:
    assert previous_state(None) == "null"
    base = execution(ExecutionStatus.COMPLETED)
    assert previous_state(dataclasses.replace(base, state='{"m":[]}', output='"o"')) == '{"m":[]}'
    assert previous_state(dataclasses.replace(base, output='"o"')) == '"o"'
    assert previous_state(base) == "null"
    assert previous_state(dataclasses.replace(base, state="null", output='"o"')) == "null"
    for status in (ExecutionStatus.FAILED, ExecutionStatus.CANCELLED, ExecutionStatus.RUNNING):
        assert (
            previous_state(dataclasses.replace(base, status=status, state="1", output="2"))
            == "null"
        )


def test_session_admits_next_on_completion_with_head() -> None:
    k = Kernel()
    first = k.create(session="chat")
    second = k.create(session="chat")
    assert k.ex(second.id).status is ExecutionStatus.PENDING
    lease = k.start(first.id)
    outcome = k.complete(first.id, lease, output='"a"', state='{"turns":1}')
    nxt = k.ex(second.id)
    assert nxt.status is ExecutionStatus.RUNNING
    assert nxt.parent_execution_id == first.id
    assert nxt.dispatch is not None
    assert nxt.dispatch.status is DispatchStatus.PENDING
    assert [(e.execution_id, e.type) for e in outcome.change.events] == [
        (first.id, "execution.completed"),
        (second.id, "execution.started"),
        (second.id, "dispatch.queued"),
    ]
    assert payload(outcome.change.events[1])["parent_execution_id"] == first.id
    assert [e.seq for e in outcome.change.events] == [5, 2, 3]
    assert outcome.dispatch_due_at == k.now
    assert previous_state(k.ex(nxt.parent_execution_id or "")) == '{"turns":1}'
    seqs_ok(k.store.events)


@pytest.mark.parametrize("how", ["fail", "cancel"])
def test_failed_or_cancelled_never_become_head(how: str) -> None:
    k = Kernel()
    head = k.create(session="chat")
    k.complete(head.id, k.start(head.id), output='"h"')
    broken = k.create(session="chat")
    queued = k.create(session="chat")
    lease = k.start(broken.id)
    if how == "fail":
        k.fail(broken.id, lease)
    else:
        k.cancel(broken.id)
    nxt = k.ex(queued.id)
    assert nxt.status is ExecutionStatus.RUNNING
    assert nxt.parent_execution_id == head.id
    assert broken.parent_execution_id == head.id


def test_head_is_only_the_same_agents() -> None:
    k = Kernel(agents=(AGENT_ID, "agent-2"))
    mine = k.create(session="chat")
    theirs = k.create(session="chat", agent_id="agent-2")
    k.complete(mine.id, k.start(mine.id))
    assert k.ex(theirs.id).status is ExecutionStatus.RUNNING
    assert k.ex(theirs.id).parent_execution_id is None
    later = k.create(session="chat")
    k.complete(theirs.id, k.start(theirs.id))
    assert k.ex(later.id).parent_execution_id == mine.id


def test_finish_without_session_admits_nothing() -> None:
    queued = execution(
        ExecutionStatus.PENDING, exec_id="0192f1a0-0000-7000-8000-0000000000bb", session="s"
    )
    view = SessionView(next_pending=queued, head_for_next=None)
    outcome = end_execution(
        execution=execution(),
        caller=AGENT_ID,
        lease=LEASE,
        lease_owner=None,
        ending=ExecutionCompletion(output="1", state=None),
        session=view,
        pending=(),
        new_id=no_ids,
        now=T0,
        settings=SETTINGS,
    )
    assert [e.execution_id for e in outcome.change.events] == [EXEC_ID]


def test_finish_ignores_a_next_that_is_no_longer_pending() -> None:
    running = execution(exec_id="0192f1a0-0000-7000-8000-0000000000bb", session="s")
    view = SessionView(next_pending=running, head_for_next=None)
    outcome = end_execution(
        execution=execution(session="s"),
        caller=AGENT_ID,
        lease=LEASE,
        lease_owner=None,
        ending=ExecutionCompletion(output="1", state=None),
        session=view,
        pending=(),
        new_id=no_ids,
        now=T0,
        settings=SETTINGS,
    )
    assert event_types(outcome.change) == ["execution.completed"]


def test_admission_when_dispatch_exhausts() -> None:
    k = Kernel(DispatchSettings(max_attempts=1))
    first = k.create(session="s")
    second = k.create(session="s")
    delivery = k.claim(first.id)
    assert delivery is not None
    k.deliver(first.id, delivery.lease(), acked=False)
    assert k.ex(first.id).failure_reason == "dispatch_exhausted"
    assert k.ex(second.id).status is ExecutionStatus.RUNNING
    assert k.ex(second.id).parent_execution_id is None


# -- the canonical event sequences end to end ----------------------------------------------------


def test_whole_run_event_log() -> None:
    k = Kernel()
    ex = k.create(input_={"task": "t"})
    lease = k.start(ex.id)
    allowed = reply(k.submit(ex.id, lease, submission(target="a")))
    k.complete_step(ex.id, lease, allowed.step_id)
    failing = reply(k.submit(ex.id, lease, submission(target="b")))
    k.fail_step(ex.id, lease, failing.step_id)
    k.submit(ex.id, lease, submission(target="c"), verdict=Verdict(action=Action.DENY))
    k.complete(ex.id, lease)
    assert [e.type for e in k.store.events_of(ex.id)] == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
        "dispatch.acked",
        "step.proposed",
        "step.allowed",
        "step.executing",
        "step.succeeded",
        "step.proposed",
        "step.allowed",
        "step.executing",
        "step.failed",
        "step.proposed",
        "step.denied",
        "execution.completed",
    ]
    seqs_ok(k.store.events)
    assert k.ex(ex.id).last_event_seq == 15
    for event in k.store.events:
        assert event.occurred_at == T0
        assert "result" not in payload(event)


def test_orphaned_at_most_once_then_refused_retry() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    once = submission(idempotency="at_most_once")
    first = reply(k.submit(ex.id, lease, once))
    k.now += 120
    k.reclaim(ex.id)
    lease2 = k.start(ex.id)
    replay = reply(k.submit(ex.id, lease2, once))
    assert (replay.decision, replay.step_id) == (Decision.REPLAY, first.step_id)
    assert json.loads(replay.error or "")["reason"] == "indeterminate"
    retry = reply(k.submit(ex.id, lease2, once))
    assert (retry.decision, retry.reason, retry.rule_id) == (
        Decision.DENIED,
        "prior attempt outcome unknown; retry refused",
        "__indeterminate_retry",
    )
    assert k.store.steps[retry.step_id].occurrence == 1
    # A safe_to_retry call of the same effect is not refused.
    safe = reply(k.submit(ex.id, lease2, submission()))
    assert safe.decision is Decision.PROCEED


# -- internals the rules share ---------------------------------------------------------------


def test_event_log_close_without_events_keeps_the_record() -> None:
    from rebuno_proto._events import EventLog

    ex = execution()
    log = EventLog(ex, T0)
    assert log.close(ex) is ex
    log.execution(EventType.EXECUTION_RESUMED, ex, reason="", extra=None)
    closed = log.close(ex)
    assert closed.last_event_seq == ex.last_event_seq + 1
    assert payload(log.events[0]) == {"execution_id": ex.id, "status": "running"}


def test_tx_keeps_the_earliest_timer() -> None:
    from rebuno_proto._tx import Tx

    tx = Tx(T0)
    tx.wake_timer(T0 + 5)
    tx.wake_timer(T0 + 7)
    assert tx.timer_due_at == T0 + 5
    tx.wake_timer(T0 + 3)
    assert tx.outcome(None).timer_due_at == T0 + 3


def test_tx_writes_only_changed_executions() -> None:
    from rebuno_proto._tx import Tx

    tx = Tx(T0)
    tx.track(execution())
    assert tx.outcome(None).change.is_empty


def test_cancelling_a_queued_execution_admits_nobody() -> None:
    """Regression: cancelling an execution still queued in its session admitted
    the next queued one while the session's active execution was running."""
    k = Kernel()
    active = k.create(session="s")
    queued = k.create(session="s")
    last = k.create(session="s")
    view = SessionView(next_pending=k.ex(last.id), head_for_next=None)
    outcome = cancel_execution(
        execution=k.ex(queued.id),
        session=view,
        pending=(),
        active_steps=(),
        new_id=no_ids,
        now=k.now,
        settings=SETTINGS,
    )
    k.commit(outcome)
    assert event_types(outcome.change) == ["execution.cancelled"]
    assert [k.ex(x.id).status for x in (active, queued, last)] == [
        ExecutionStatus.RUNNING,
        ExecutionStatus.CANCELLED,
        ExecutionStatus.PENDING,
    ]
    # When the active one ends, the slot passes on as usual.
    k.complete(active.id, k.start(active.id))
    assert k.ex(last.id).status is ExecutionStatus.RUNNING


def test_a_human_cannot_decide_an_approval_past_its_timeout() -> None:
    k = Kernel()
    ex = k.create()
    lease = k.start(ex.id)
    k.submit(
        ex.id,
        lease,
        submission(),
        verdict=Verdict(action=Action.REQUIRE_APPROVAL, approval_timeout_s=60.0),
    )
    (approval,) = k.store.approvals.values()
    k.now += 60.0
    refused = k.decide(approval.id, ApprovalChoice.GRANT)
    assert refused.reply == Refusal(ErrorCode.CONFLICT, "approval has expired")
    assert refused.change.is_empty
    assert reply(k.expire(approval.id)) is True

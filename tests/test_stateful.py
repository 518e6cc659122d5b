"""Stateful tests of the kernel rules (hypothesis.stateful).

Each machine holds an in-memory store (executions, steps, counters, events),
sends random commands through the pure functions with injected, non-decreasing
time, applies every returned `Change`, and checks the result against a small
reference model written here:

* `LeaseLifecycle`: claim, acknowledge, failed delivery, lapse and reclaim,
  heartbeat, submit and end under the current or a stale lease.
* `StepLifecycle`: submissions under random policy verdicts, completion and
  failure, approvals, new attempts that replay the previous one, the end.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from _support import Kernel, submission
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from rebuno_proto import (
    INDETERMINATE_ERROR,
    Action,
    ApprovalChoice,
    Decision,
    DispatchSettings,
    DispatchStatus,
    ErrorCode,
    ExecutionStatus,
    Lease,
    Outcome,
    Refusal,
    StepDecision,
    StepKind,
    StepStatus,
    StepSubmission,
    Verdict,
    args_hash,
    step_id,
)

FAST = settings(max_examples=150, stateful_step_count=40, deadline=None)
LEASE_TIMEOUT = 120.0
MAX_ATTEMPTS = 3
TERMINAL = {"completed", "failed", "cancelled"}


def superseded(outcome: Outcome[Any]) -> None:
    """A mutation under a non-current lease: 409 and no writes at all."""
    assert outcome.reply == Refusal(ErrorCode.LEASE_SUPERSEDED, "dispatch lease superseded")
    assert outcome.change.is_empty
    assert outcome.dispatch_due_at is None
    assert outcome.timer_due_at is None


def backoff(attempt: int, jitter: float) -> float:
    """PROTOCOL.md §6.3 step 3, written out: base 1 s, doubling, cap 30 s, + [0, 25%)."""
    return min(2.0 ** (attempt - 1), 30.0) * (1 + 0.25 * jitter)


# -- (a) the dispatch / lease lifecycle -----------------------------------------------------------


class LeaseLifecycle(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.k = Kernel(DispatchSettings(lease_timeout_s=LEASE_TIMEOUT, max_attempts=MAX_ATTEMPTS))
        ex = self.k.create()
        assert ex.dispatch is not None
        self.eid = ex.id
        self.dispatch_id = ex.dispatch.id
        # The reference model.
        self.status = "running"
        self.dispatch = "pending"
        self.attempt = 0
        self.due = self.k.now
        self.locked: float | None = None
        self.current: Lease | None = None
        self.leases: list[Lease] = []
        self.ended_as: str | None = None

    def lease_for(self, pick: int) -> Lease:
        """The current lease (pick 0) or one of the older ones."""
        if pick == 0 and self.current is not None:
            return self.current
        if self.leases:
            return self.leases[pick % len(self.leases)]
        return Lease(dispatch_id=self.dispatch_id, attempt=99)

    def is_current(self, lease: Lease) -> bool:
        return (
            lease == self.current and self.dispatch == "in_flight" and self.status not in TERMINAL
        )

    def end_model(self, status: str) -> None:
        self.status = status
        self.dispatch = "exhausted"
        self.current = None

    @rule(delta=st.sampled_from([0.0, 0.25, 1.0, 2.5, 30.0, 119.0, 120.0, 400.0]))
    def advance_time(self, delta: float) -> None:
        self.k.now += delta

    @rule()
    def claim(self) -> None:
        before = len(self.k.store.events)
        delivery = self.k.claim(self.eid)
        due = self.dispatch in ("pending", "failed") and self.due <= self.k.now
        if not due:
            assert delivery is None
            assert len(self.k.store.events) == before
            return
        assert self.status not in TERMINAL  # released dispatches are never due
        if self.attempt + 1 > MAX_ATTEMPTS:
            assert delivery is None
            self.end_model("failed")
            assert [e.type for e in self.k.store.events[before:]] == ["execution.failed"]
            assert self.k.ex(self.eid).failure_reason == "dispatch_exhausted"
            return
        self.attempt += 1
        assert delivery is not None
        assert (delivery.dispatch_id, delivery.attempt) == (self.dispatch_id, self.attempt)
        self.dispatch = "in_flight"
        self.locked = self.k.now
        self.current = delivery.lease()
        assert self.current not in self.leases
        self.leases.append(self.current)
        assert not self.k.store.counters  # every attempt starts from occurrence 0

    @rule(acked=st.booleans(), jitter=st.floats(0, 0.99), pick=st.integers(0, 3))
    def delivery_result(self, acked: bool, jitter: float, pick: int) -> None:
        lease = self.lease_for(pick)
        before = len(self.k.store.events)
        outcome = self.k.deliver(self.eid, lease, acked=acked, jitter=jitter)
        assert outcome.reply is None
        if not self.is_current(lease):
            assert outcome.change.is_empty
            return
        types = [e.type for e in self.k.store.events[before:]]
        if acked:
            assert types == ["dispatch.acked"]
            self.locked = self.k.now
        elif self.attempt >= MAX_ATTEMPTS:
            assert types == ["dispatch.failed", "execution.failed"]
            self.end_model("failed")
        else:
            assert types == ["dispatch.failed"]
            self.dispatch = "failed"
            self.due = self.k.now + backoff(self.attempt, jitter)
            assert outcome.dispatch_due_at == self.due
            self.locked = None
            self.current = None

    @rule()
    def reclaim(self) -> None:
        outcome = self.k.reclaim(self.eid)
        lapsed = (
            self.dispatch == "in_flight"
            and self.locked is not None
            and self.k.now - self.locked >= LEASE_TIMEOUT
            and self.status not in TERMINAL
        )
        assert outcome.reply is lapsed
        if lapsed:
            assert [e.type for e in outcome.change.events] == ["dispatch.queued"]
            self.dispatch = "pending"
            self.due = self.k.now
            self.locked = None
            self.current = None
        else:
            assert outcome.change.is_empty

    @rule(pick=st.integers(0, 3))
    def heartbeat(self, pick: int) -> None:
        lease = self.lease_for(pick)
        outcome = self.k.heartbeat(self.eid, lease)
        if self.is_current(lease):
            assert outcome.reply is None
            self.locked = self.k.now
        else:
            superseded(outcome)

    @rule(pick=st.integers(0, 3), tool=st.sampled_from(["a", "b"]))
    def submit(self, pick: int, tool: str) -> None:
        lease = self.lease_for(pick)
        outcome = self.k.submit(self.eid, lease, submission(target=tool))
        if self.status in TERMINAL:
            assert outcome.reply == StepDecision(decision=Decision.EXECUTION_TERMINAL)
            assert outcome.change.is_empty
        elif self.is_current(lease):
            assert isinstance(outcome.reply, StepDecision)
            assert outcome.reply.decision in (Decision.PROCEED, Decision.REPLAY)
            assert self.locked is not None
            # A proceed always renews (the agent may act on it for a lease
            # timeout); anything else at most once a second.
            if outcome.reply.decision is Decision.PROCEED or self.k.now - self.locked >= 1.0:
                self.locked = self.k.now
        else:
            superseded(outcome)

    @rule(
        kind=st.sampled_from(["complete", "fail", "cancel"]),
        pick=st.integers(0, 3),
        roll=st.integers(0, 5),
    )
    def end(self, kind: str, pick: int, roll: int) -> None:
        if roll and self.status not in TERMINAL:
            return  # ending is rare, so runs get long enough to be interesting
        lease = self.lease_for(pick)
        if kind == "cancel":
            outcome = self.k.cancel(self.eid)
        elif kind == "complete":
            outcome = self.k.complete(self.eid, lease)
        else:
            outcome = self.k.fail(self.eid, lease)
        if self.status in TERMINAL:
            assert outcome.reply == Refusal(
                ErrorCode.EXECUTION_TERMINAL, f"execution is {self.status}"
            )
            assert outcome.change.is_empty
        elif kind == "cancel" or self.is_current(lease):
            assert outcome.reply is None
            self.end_model({"complete": "completed", "fail": "failed", "cancel": "cancelled"}[kind])
        else:
            superseded(outcome)

    @invariant()
    def store_matches_model(self) -> None:
        if not hasattr(self, "k"):
            return
        ex = self.k.ex(self.eid)
        assert ex.status.value == self.status
        assert ex.dispatch is not None
        assert (ex.dispatch.id, ex.dispatch.status.value, ex.dispatch.attempt) == (
            self.dispatch_id,
            self.dispatch,
            self.attempt,
        )
        assert ex.dispatch.locked_at == self.locked or self.dispatch != "in_flight"
        assert 0 <= ex.dispatch.attempt <= MAX_ATTEMPTS
        assert ex.last_event_seq == len(self.k.store.events)
        assert [e.seq for e in self.k.store.events] == list(range(1, ex.last_event_seq + 1))

    @invariant()
    def terminal_stays_terminal(self) -> None:
        if not hasattr(self, "k"):
            return
        if self.status in TERMINAL:
            if self.ended_as is None:
                self.ended_as = self.status
            assert self.status == self.ended_as
            assert self.k.ex(self.eid).dispatch.status is DispatchStatus.EXHAUSTED  # type: ignore[union-attr]

    @invariant()
    def attempts_are_numbered_in_order(self) -> None:
        if hasattr(self, "k"):
            assert [lease.attempt for lease in self.leases] == list(range(1, len(self.leases) + 1))


TestLeaseLifecycle = LeaseLifecycle.TestCase
TestLeaseLifecycle.settings = FAST


# -- (b) the step lifecycle -----------------------------------------------------------------------

EFFECTS: list[tuple[str, str, Any]] = [
    ("tool_call", "search", {"q": "rebuno"}),
    ("tool_call", "search", {"q": "other"}),
    ("local", "clock", {}),
    ("llm_call", "model-x", {"messages": [{"role": "user", "content": "<hi>"}]}),
]
VERDICTS = {
    "allow": Verdict(),
    "deny": Verdict(action=Action.DENY, rule_id="no"),
    "approve": Verdict(action=Action.REQUIRE_APPROVAL, rule_id="hold", approval_timeout_s=60.0),
    "rate": Verdict(rate_limited="rate_limit_exceeded", rule_id="rl"),
}
RECORDING = {Decision.PROCEED, Decision.REPLAY, Decision.DENIED, Decision.BLOCKED}


class ModelStep:
    def __init__(self, effect: int, status: str, idempotency: str) -> None:
        self.effect = effect
        self.status = status
        self.idempotency = idempotency
        self.result: str | None = None
        self.error: str | None = None
        self.reason = ""
        self.rule_id = ""
        self.approval_id: str | None = None


class StepLifecycle(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.k = Kernel(DispatchSettings(lease_timeout_s=LEASE_TIMEOUT, max_attempts=1000))
        self.eid = self.k.create().id
        self.lease: Lease | None = self.k.start(self.eid)
        self.stale: list[Lease] = []
        self.status = "running"
        self.steps: dict[str, ModelStep] = {}
        self.consumed: Counter[int] = Counter()
        self.log: list[tuple[int, str, str, str | None, Decision]] = []
        self.previous: list[tuple[int, str, str, str | None, Decision]] | None = None
        self.results = 0

    # -- helpers ----------------------------------------------------------------------------

    def sub(self, effect: int, idempotency: str) -> StepSubmission:
        kind, target, args = EFFECTS[effect]
        return submission(kind=kind, target=target, args=args, idempotency=idempotency)

    def expected_id(self, effect: int) -> str:
        kind, target, args = EFFECTS[effect]
        digest = args_hash(json.dumps(args).encode())
        return step_id(self.eid, kind, target, digest, self.consumed[effect])

    def new_attempt_log(self) -> None:
        self.previous = self.log
        self.log = []
        self.consumed = Counter()
        assert not self.k.store.counters

    def do_submit(self, effect: int, idempotency: str, verdict: str) -> StepDecision:
        assert self.lease is not None
        sid = self.expected_id(effect)
        outcome = self.k.submit(
            self.eid, self.lease, self.sub(effect, idempotency), verdict=VERDICTS[verdict]
        )
        decision = outcome.reply
        assert isinstance(decision, StepDecision), decision
        existing = self.steps.get(sid)
        if self.status in TERMINAL:
            assert decision == StepDecision(decision=Decision.EXECUTION_TERMINAL)
            assert outcome.change.is_empty
            return decision
        if existing is not None:
            self.check_existing(decision, existing, sid, idempotency)
        elif self.status == "blocked":
            assert decision == StepDecision(decision=Decision.EXECUTION_BLOCKED)
        elif idempotency == "at_most_once" and any(
            s.effect == effect and s.status == "failed" and s.error == INDETERMINATE_ERROR
            for s in self.steps.values()
        ):
            assert decision == StepDecision(
                decision=Decision.DENIED,
                step_id=sid,
                reason="prior attempt outcome unknown; retry refused",
                rule_id="__indeterminate_retry",
            )
            model = self.steps[sid] = ModelStep(effect, "denied", idempotency)
            model.reason = "prior attempt outcome unknown; retry refused"
            model.rule_id = "__indeterminate_retry"
        elif verdict == "rate":
            assert decision == StepDecision(
                decision=Decision.RATE_LIMITED, reason="rate_limit_exceeded"
            )
        elif verdict == "allow":
            assert decision == StepDecision(decision=Decision.PROCEED, step_id=sid)
            self.steps[sid] = ModelStep(effect, "executing", idempotency)
        elif verdict == "deny":
            assert decision == StepDecision(
                decision=Decision.DENIED, step_id=sid, reason="policy_denied", rule_id="no"
            )
            self.steps[sid] = ModelStep(effect, "denied", idempotency)
            self.steps[sid].reason, self.steps[sid].rule_id = "policy_denied", "no"
        else:
            assert decision.decision is Decision.BLOCKED
            assert decision.step_id == sid
            assert decision.approval_id is not None
            model = self.steps[sid] = ModelStep(effect, "awaiting_approval", idempotency)
            model.approval_id, model.rule_id = decision.approval_id, "hold"
            self.status = "blocked"
        # §1.3: the counter advances exactly when a step is recorded or found.
        if decision.decision in RECORDING:
            assert decision.step_id == sid
            self.consumed[effect] += 1
        else:
            assert not outcome.change.counters
            assert not outcome.change.steps
        self.log.append((effect, idempotency, verdict, decision.step_id or None, decision.decision))
        return decision

    def check_existing(
        self, decision: StepDecision, model: ModelStep, sid: str, idempotency: str
    ) -> None:
        status = model.status
        if status == "succeeded":
            assert decision == StepDecision(
                decision=Decision.REPLAY, step_id=sid, result=model.result
            )
        elif status in ("failed", "cancelled"):
            assert decision == StepDecision(
                decision=Decision.REPLAY, step_id=sid, error=model.error
            )
        elif status == "denied":
            assert (decision.decision, decision.step_id, decision.reason, decision.rule_id) == (
                Decision.DENIED,
                sid,
                model.reason or "policy_denied",
                model.rule_id,
            )
        elif status == "awaiting_approval":
            assert decision == StepDecision(
                decision=Decision.BLOCKED, step_id=sid, approval_id=model.approval_id
            )
        elif status == "allowed":
            assert decision == StepDecision(decision=Decision.PROCEED, step_id=sid)
            model.status = "executing"
        elif idempotency == model.idempotency == "safe_to_retry":  # an orphan, re-run
            assert decision == StepDecision(decision=Decision.PROCEED, step_id=sid)
        else:  # an orphan that may have taken effect (by this submission or its first)
            assert decision == StepDecision(
                decision=Decision.REPLAY, step_id=sid, error=INDETERMINATE_ERROR
            )
            model.status, model.error = "failed", INDETERMINATE_ERROR

    # -- rules ------------------------------------------------------------------------------------

    @rule(delta=st.sampled_from([0.0, 0.5, 5.0, 61.0]))
    def advance_time(self, delta: float) -> None:
        self.k.now += delta

    @precondition(lambda self: self.lease is not None)
    @rule(
        effect=st.integers(0, len(EFFECTS) - 1),
        idempotency=st.sampled_from(["safe_to_retry", "at_most_once"]),
        verdict=st.sampled_from(["allow", "allow", "deny", "approve", "rate"]),
    )
    def submit(self, effect: int, idempotency: str, verdict: str) -> None:
        self.do_submit(effect, idempotency, verdict)

    @precondition(lambda self: self.lease is not None)
    @rule(data=st.data(), ok=st.booleans())
    def finish_step(self, data: st.DataObject, ok: bool) -> None:
        assert self.lease is not None
        candidates = sorted(self.steps)
        if not candidates:
            return
        sid = data.draw(st.sampled_from(candidates))
        model = self.steps[sid]
        self.results += 1
        payload = json.dumps({"n": self.results})
        if ok:
            outcome = self.k.complete_step(self.eid, self.lease, sid, payload)
        else:
            outcome = self.k.fail_step(self.eid, self.lease, sid, payload)
        reply = outcome.reply
        if self.status in TERMINAL:
            assert reply == StepDecision(decision=Decision.EXECUTION_TERMINAL)
        elif model.status in ("succeeded", "failed", "denied", "cancelled"):
            assert isinstance(reply, StepDecision)
            assert reply.decision is Decision.REPLAY
            assert outcome.change.is_empty  # the first outcome stands
        elif model.status == "executing":
            assert reply == StepDecision(decision=Decision.RECORDED)
            if ok:
                model.status, model.result = "succeeded", payload
            else:
                model.status, model.error = "failed", payload
        else:
            assert isinstance(reply, Refusal)
            assert reply.code is ErrorCode.CONFLICT
            assert outcome.change.is_empty

    @precondition(lambda self: self.status == "running" and self.lease is not None)
    @rule(replay=st.booleans())
    def new_attempt(self, replay: bool) -> None:
        """The lease lapses; the same dispatch is re-delivered with attempt + 1.
        With `replay`, the handler repeats the previous attempt's effects."""
        assert self.lease is not None
        self.k.now += LEASE_TIMEOUT
        assert self.k.reclaim(self.eid).reply is True
        old = self.lease
        self.lease = self.k.start(self.eid)
        assert (self.lease.dispatch_id, self.lease.attempt) == (old.dispatch_id, old.attempt + 1)
        self.stale.append(old)
        self.new_attempt_log()
        if replay and self.previous:
            self.replay_previous()

    def replay_previous(self) -> None:
        assert self.previous is not None
        for i, (effect, idempotency, verdict, old_id, old_decision) in enumerate(self.previous):
            if self.status != "running" or old_decision not in RECORDING:
                # A refusal that recorded nothing (rate limit, blocked execution)
                # raised in the handler; the attempts agree only up to there.
                break
            decision = self.do_submit(effect, idempotency, verdict)
            # Same effects in the same order: the same step ids.
            assert decision.step_id == old_id, (i, old_decision, decision)
            assert decision.decision in RECORDING
            if old_decision is Decision.REPLAY:
                assert decision.decision is Decision.REPLAY

    @precondition(lambda self: self.status == "blocked")
    @rule(how=st.sampled_from(["grant", "deny", "expire"]), rationale=st.sampled_from(["", "why"]))
    def resolve_approval(self, how: str, rationale: str) -> None:
        (model,) = [m for m in self.steps.values() if m.status == "awaiting_approval"]
        assert model.approval_id is not None
        outcome: Outcome[Any]
        approval = self.k.store.approvals[model.approval_id]
        if how != "expire" and self.k.now >= approval.timeout_at:
            # Past its timeout a human can no longer decide it (nothing changes);
            # the expiry is what happens next.
            refused = self.k.decide(model.approval_id, ApprovalChoice.GRANT, rationale=rationale)
            assert refused.reply == Refusal(ErrorCode.CONFLICT, "approval has expired")
            assert refused.change.is_empty
            how = "expire"
        if how == "expire":
            self.k.now += 60.0
            outcome = self.k.expire(model.approval_id)
            assert outcome.reply is True
            model.status, model.reason = "denied", "approval_timeout"
        elif how == "grant":
            outcome = self.k.decide(model.approval_id, ApprovalChoice.GRANT, rationale=rationale)
            model.status = "allowed"
        else:
            outcome = self.k.decide(model.approval_id, ApprovalChoice.DENY, rationale=rationale)
            model.status, model.reason = "denied", rationale or "approval_denied"
        assert outcome.change.events[-2].type == "execution.resumed"
        self.status = "running"
        if self.lease is not None:
            self.stale.append(self.lease)
        self.lease = None  # a new dispatch waits to be claimed

    @precondition(lambda self: self.status == "running" and self.lease is None)
    @rule(replay=st.booleans())
    def start_new_dispatch(self, replay: bool) -> None:
        self.lease = self.k.start(self.eid)
        assert self.lease.attempt == 1
        assert all(self.lease.dispatch_id != old.dispatch_id for old in self.stale)
        self.new_attempt_log()
        if replay and self.previous:
            self.replay_previous()

    @precondition(lambda self: bool(self.stale) and self.status not in TERMINAL)
    @rule(data=st.data())
    def stale_lease_changes_nothing(self, data: st.DataObject) -> None:
        old = data.draw(st.sampled_from(self.stale))
        events = len(self.k.store.events)
        superseded(self.k.submit(self.eid, old, self.sub(0, "safe_to_retry")))
        superseded(self.k.heartbeat(self.eid, old))
        for sid in sorted(self.steps)[:2]:
            superseded(self.k.complete_step(self.eid, old, sid))
        superseded(self.k.complete(self.eid, old))
        assert len(self.k.store.events) == events

    @precondition(lambda self: self.status not in TERMINAL)
    @rule(kind=st.sampled_from(["complete", "fail", "cancel"]), roll=st.integers(0, 5))
    def end(self, kind: str, roll: int) -> None:
        if roll or (kind != "cancel" and self.lease is None):
            return  # ending is rare, so runs get long enough to be interesting
        if kind == "cancel":
            outcome = self.k.cancel(self.eid)
        elif kind == "complete":
            assert self.lease is not None
            outcome = self.k.complete(self.eid, self.lease)
        else:
            assert self.lease is not None
            outcome = self.k.fail(self.eid, self.lease)
        assert outcome.reply is None
        if self.lease is None:
            # Any lease will do from here on: a terminal execution answers
            # `execution_terminal` before it looks at the lease.
            self.lease = Lease(dispatch_id="0192f1a0-0000-7000-8000-00000000dead", attempt=1)
        status = {"complete": "completed", "fail": "failed", "cancel": "cancelled"}[kind]
        for model in self.steps.values():
            if model.status == "awaiting_approval":
                model.status, model.reason = "denied", f"execution_{status}"
            elif kind == "cancel" and model.status in ("executing", "allowed"):
                model.status = "cancelled"
                model.error = '{"reason":"execution_cancelled"}'
        self.status = status
        # A finished execution's occurrence counters are dropped: nothing can
        # submit under it again (submissions get `execution_terminal`).
        self.consumed = Counter()

    @precondition(lambda self: self.status in TERMINAL and self.lease is not None)
    @rule(effect=st.integers(0, len(EFFECTS) - 1))
    def terminal_refuses_new_work(self, effect: int) -> None:
        self.do_submit(effect, "safe_to_retry", "allow")

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def store_matches_model(self) -> None:
        if not hasattr(self, "k"):
            return
        assert self.k.ex(self.eid).status.value == self.status
        assert set(self.k.store.steps) == set(self.steps)
        for sid, model in self.steps.items():
            stored = self.k.store.steps[sid]
            assert stored.status.value == model.status, (sid, stored.status, model.status)
            if model.status == "succeeded":
                assert stored.result == model.result
            if model.status in ("failed", "cancelled"):
                assert stored.error == model.error
        assert StepStatus.PROPOSED not in {s.status for s in self.k.store.steps.values()}

    @invariant()
    def counters_match_consumed_occurrences(self) -> None:
        if not hasattr(self, "k"):
            return
        by_effect = {}
        for effect, (kind, target, args) in enumerate(EFFECTS):
            key = (self.eid, StepKind(kind), target, args_hash(json.dumps(args).encode()))
            by_effect[effect] = self.k.store.counters.get(key)
        for effect, value in by_effect.items():
            consumed = self.consumed[effect]
            assert value == (consumed - 1 if consumed else None)

    @invariant()
    def events_gap_free(self) -> None:
        if not hasattr(self, "k"):
            return
        seqs = [e.seq for e in self.k.store.events]
        assert seqs == list(range(1, len(seqs) + 1))
        assert self.k.ex(self.eid).last_event_seq == len(seqs)

    @invariant()
    def blocked_means_one_pending_approval(self) -> None:
        if not hasattr(self, "k"):
            return
        pending = [a for a in self.k.store.approvals.values() if a.status.value == "pending"]
        assert len(pending) == (1 if self.status == "blocked" else 0)
        ex = self.k.ex(self.eid)
        if self.status in TERMINAL or self.status == "blocked":
            assert ex.dispatch is not None
            assert ex.dispatch.status is DispatchStatus.EXHAUSTED
        assert (ex.status is ExecutionStatus.BLOCKED) is (self.status == "blocked")


TestStepLifecycle = StepLifecycle.TestCase
TestStepLifecycle.settings = FAST


# -- soak runs: `pytest -m slow tests/test_stateful.py` ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("machine", [LeaseLifecycle, StepLifecycle], ids=lambda m: m.__name__)
def test_soak(machine: type[RuleBasedStateMachine], request: pytest.FixtureRequest) -> None:
    if "slow" not in str(request.config.getoption("markexpr")):
        pytest.skip("a long soak; select it with -m slow")
    run_state_machine_as_test(
        machine, settings=settings(max_examples=3000, stateful_step_count=80, deadline=None)
    )
    assert machine.TestCase.settings is FAST  # the fast run keeps its own budget

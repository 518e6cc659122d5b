"""Outbound wire shapes (`_encode.py`, `_jsonout.py`): never `null` where the
published SDK types a field as str/int/list (PROTOCOL.md §4.0), secrets never
sent, and the JSON validates with the published SDK's own models."""

import dataclasses
import json
import math
from typing import Any

import pytest
from _support import T0, Kernel, agent, execution, reply, step, submission
from hypothesis import given
from hypothesis import strategies as st

from rebuno_proto import (
    Action,
    Approval,
    ApprovalStatus,
    Decision,
    Delivery,
    ErrorCode,
    Event,
    ExecutionStatus,
    RawJSON,
    Refusal,
    StepDecision,
    StepStatus,
    Verdict,
    dumps,
    encode_agent,
    encode_approval,
    encode_decision,
    encode_error,
    encode_event,
    encode_execution,
    encode_step,
    encode_webhook,
    parse_webhook,
    rfc3339,
)

sdk: Any
try:  # the published SDK, for interoperability checks (PROTOCOL.md §4.1)
    import rebuno.types as sdk
except ImportError:  # pragma: no cover - it is in the test dependency group
    sdk = None

requires_sdk = pytest.mark.skipif(sdk is None, reason="the published rebuno SDK is not installed")

# Fields the SDK may receive as JSON null (typed Any or Optional there).
NULLABLE = {
    "execution": {
        "input",
        "output",
        "parent_execution_id",
        "forked_from",
        "restoration",
        "spawned_by",
    },
    "step": {"args", "result", "error"},
    "decision": {"result", "error", "approval_id"},
    "event": {"payload"},
    "approval": set(),
}


def nulls(data: bytes) -> set[str]:
    obj = json.loads(data)
    assert isinstance(obj, dict)
    return {k for k, v in obj.items() if v is None}


# -- Execution -----------------------------------------------------------------------------


EXECUTIONS = [
    execution(),
    execution(ExecutionStatus.PENDING, dispatch_record=None, input="null"),
    execution(
        ExecutionStatus.COMPLETED,
        output='{"answer":1.50}',
        state='{"s":1}',
        session="chat-1",
        parent_execution_id="0192f1a0-0000-7000-8000-0000000000aa",
        idempotency_key="k",
        input='{"prompt":"<hi>"}',
    ),
    execution(ExecutionStatus.FAILED, failure_reason="dispatch_exhausted"),
    execution(ExecutionStatus.CANCELLED, failure_reason="client_cancelled"),
    execution(ExecutionStatus.BLOCKED),
]


@pytest.mark.parametrize("ex", EXECUTIONS, ids=lambda e: e.status.value)
def test_execution_has_no_null_typed_fields(ex: Any) -> None:
    data = encode_execution(ex)
    assert nulls(data) <= NULLABLE["execution"]
    obj = json.loads(data)
    assert obj["fork_seq"] == 0
    assert obj["subject_groups"] == []
    for key in (
        "agent_id",
        "failure_reason",
        "session",
        "idempotency_key",
        "created_by",
        "on_behalf_of",
    ):
        assert isinstance(obj[key], str)


@requires_sdk
@pytest.mark.parametrize("ex", EXECUTIONS, ids=lambda e: e.status.value)
def test_execution_validates_with_the_sdk(ex: Any) -> None:
    model = sdk.Execution.model_validate_json(encode_execution(ex))
    assert model.id == ex.id
    assert model.agent_id == ex.agent_id
    assert model.status.value == ex.status.value
    assert model.input == json.loads(ex.input)
    assert model.output == (None if ex.output is None else json.loads(ex.output))
    assert model.failure_reason == ex.failure_reason
    assert model.session == ex.session
    assert model.parent_execution_id == ex.parent_execution_id
    assert model.idempotency_key == ex.idempotency_key


def test_execution_embeds_stored_json_verbatim() -> None:
    ex = execution(input='{"n":1.50,"s":"\\u003c"}')
    assert b'"input":{"n":1.50,"s":"\\u003c"}' in encode_execution(ex)
    obj = json.loads(encode_execution(ex))
    assert obj["created_at"] == rfc3339(T0)
    assert obj["updated_at"] == rfc3339(T0)


# -- Step ---------------------------------------------------------------------------------------


STEPS = [
    step(submission(), StepStatus.EXECUTING),
    step(submission(), StepStatus.SUCCEEDED, result='{"hits":[]}', completed_at=T0 + 1),
    step(submission(), StepStatus.FAILED, error='{"message":"boom"}', completed_at=T0 + 1),
    step(
        submission(),
        StepStatus.DENIED,
        error='{"reason":"policy_denied","rule_id":"r"}',
        rule_id="r",
    ),
    step(submission(), StepStatus.AWAITING_APPROVAL, approval_id="ap-1", rule_id="hold"),
    dataclasses.replace(
        step(submission(kind="llm_call", target=""), StepStatus.PROPOSED), started_at=None
    ),
]


@pytest.mark.parametrize("st_", STEPS, ids=lambda s: s.status.value)
def test_step_has_no_null_typed_fields(st_: Any) -> None:
    assert nulls(encode_step(st_)) <= NULLABLE["step"]


@requires_sdk
@pytest.mark.parametrize("st_", STEPS, ids=lambda s: s.status.value)
def test_step_validates_with_the_sdk(st_: Any) -> None:
    model = sdk.Step.model_validate_json(encode_step(st_))
    assert (model.step_id, model.execution_id, model.kind, model.target) == (
        st_.step_id,
        st_.execution_id,
        st_.kind.value,
        st_.target,
    )
    assert (model.args_hash, model.occurrence, model.status, model.idempotency) == (
        st_.args_hash,
        st_.occurrence,
        st_.status.value,
        st_.idempotency.value,
    )
    assert model.args == json.loads(st_.args)
    assert model.result == (None if st_.result is None else json.loads(st_.result))
    assert model.error == (None if st_.error is None else json.loads(st_.error))


def test_step_optional_fields_are_omitted_not_null() -> None:
    bare = json.loads(encode_step(STEPS[-1]))
    for key in ("started_at", "completed_at", "rule_id", "approval_id"):
        assert key not in bare
    full = json.loads(encode_step(STEPS[4]))
    assert full["approval_id"] == "ap-1"
    assert full["rule_id"] == "hold"
    assert full["started_at"] == rfc3339(T0)
    assert json.loads(encode_step(STEPS[1]))["completed_at"] == rfc3339(T0 + 1)


# -- StepDecision ----------------------------------------------------------------------------------

DECISIONS = [
    StepDecision(decision=Decision.PROCEED, step_id="a" * 64),
    StepDecision(decision=Decision.REPLAY, step_id="a" * 64, result='{"x":1}'),
    StepDecision(decision=Decision.REPLAY, step_id="a" * 64, result="null"),
    StepDecision(decision=Decision.REPLAY, step_id="a" * 64, error='{"reason":"indeterminate"}'),
    StepDecision(decision=Decision.DENIED, step_id="a" * 64, reason="policy_denied", rule_id="r"),
    StepDecision(decision=Decision.BLOCKED, step_id="a" * 64, approval_id="ap"),
    StepDecision(decision=Decision.RATE_LIMITED, reason="rate_limit_exceeded"),
    StepDecision(decision=Decision.EXECUTION_BLOCKED),
    StepDecision(decision=Decision.EXECUTION_TERMINAL),
    StepDecision(decision=Decision.RECORDED),
]


@pytest.mark.parametrize("decision", DECISIONS, ids=lambda d: d.decision.value)
def test_decision_shape(decision: StepDecision) -> None:
    data = encode_decision(decision)
    assert nulls(data) <= NULLABLE["decision"]
    obj = json.loads(data)
    assert obj["decision"] == decision.decision.value
    assert obj["resources"] == []
    for key in ("step_id", "reason", "rule_id", "approval_id"):
        assert (key in obj) is bool(getattr(decision, key))
    if decision.result is not None:
        assert "result" in obj
    if decision.error is not None:
        assert isinstance(obj["error"], dict)


@requires_sdk
@pytest.mark.parametrize("decision", DECISIONS, ids=lambda d: d.decision.value)
def test_decision_validates_with_the_sdk(decision: StepDecision) -> None:
    model = sdk.StepDecision.model_validate_json(encode_decision(decision))
    assert model.decision == decision.decision.value
    assert model.step_id == decision.step_id
    assert model.reason == decision.reason
    assert model.rule_id == decision.rule_id
    assert model.approval_id == decision.approval_id
    assert model.resources == []
    if decision.result is not None:
        assert model.result == json.loads(decision.result)
    if decision.error is not None:
        assert model.error == json.loads(decision.error)


def test_decision_result_null_is_present() -> None:
    """A recorded `null` result is replayed as `null`, not dropped."""
    assert b'"result":null' in encode_decision(DECISIONS[2])


# -- Event -----------------------------------------------------------------------------------------


@requires_sdk
def test_events_from_a_run_validate() -> None:
    k = Kernel()
    ex = k.create(input_={"q": 1})
    lease = k.start(ex.id)
    proceed = reply(k.submit(ex.id, lease, submission()))
    k.complete_step(ex.id, lease, proceed.step_id, '{"ok":true}')
    blocked = reply(
        k.submit(
            ex.id, lease, submission(target="b"), verdict=Verdict(action=Action.REQUIRE_APPROVAL)
        )
    )
    k.cancel(ex.id)
    assert len(k.store.events) > 8
    for event in k.store.events:
        data = encode_event(event)
        assert nulls(data) <= NULLABLE["event"]
        model = sdk.Event.model_validate_json(data)
        assert (model.execution_id, model.event_seq, model.type) == (
            event.execution_id,
            event.seq,
            event.type,
        )
        assert model.payload == json.loads(event.payload)
        assert model.occurred_at == rfc3339(event.occurred_at)
    for st_ in k.store.steps.values():
        sdk.Step.model_validate_json(encode_step(st_))
    for ap in k.store.approvals.values():
        approval = sdk.Approval.model_validate_json(encode_approval(ap))
        assert (approval.id, approval.step_id, approval.status) == (
            ap.id,
            blocked.step_id,
            "expired",
        )
    final = sdk.Execution.model_validate_json(encode_execution(k.ex(ex.id)))
    assert final.status == "cancelled"
    assert final.failure_reason == "client_cancelled"


def test_event_embeds_payload() -> None:
    event = Event(
        execution_id="e", seq=7, type="step.failed", payload='{"error":{"m":1.0}}', occurred_at=0.0
    )
    assert encode_event(event) == (
        b'{"execution_id":"e","event_seq":7,"type":"step.failed",'
        b'"payload":{"error":{"m":1.0}},"occurred_at":"1970-01-01T00:00:00.000000Z"}'
    )


# -- Approval --------------------------------------------------------------------------------------

APPROVALS = [
    Approval(
        id="ap",
        execution_id="e",
        step_id="s",
        status=ApprovalStatus.PENDING,
        created_at=T0,
        timeout_at=T0 + 900,
    ),
    Approval(
        id="ap",
        execution_id="e",
        step_id="s",
        status=ApprovalStatus.GRANTED,
        created_at=T0,
        timeout_at=T0 + 900,
        approvers=("alice",),
        message="ok?",
        rule_id="r",
        decided_by="alice",
        decided_at=T0 + 5,
        rationale="fine",
    ),
]


@pytest.mark.parametrize("ap", APPROVALS, ids=lambda a: a.status.value)
def test_approval_shape(ap: Approval) -> None:
    data = encode_approval(ap)
    assert nulls(data) == set()
    obj = json.loads(data)
    assert obj["approvers"] == list(ap.approvers)
    assert obj["timeout_at"] == rfc3339(ap.timeout_at)
    assert ("decided_at" in obj) is (ap.decided_at is not None)


@requires_sdk
@pytest.mark.parametrize("ap", APPROVALS, ids=lambda a: a.status.value)
def test_approval_validates_with_the_sdk(ap: Approval) -> None:
    model = sdk.Approval.model_validate_json(encode_approval(ap))
    assert (
        model.id,
        model.status,
        model.decided_by,
        model.asserted_by,
        model.rationale,
        model.message,
    ) == (
        ap.id,
        ap.status.value,
        ap.decided_by,
        ap.decided_by,
        ap.rationale,
        ap.message,
    )


# -- Agent: secrets are never sent -----------------------------------------------------------------


def test_agent_never_sends_its_secret() -> None:
    registered = dataclasses.replace(
        agent(), description="Answers.", input_schema='{"type":"object"}', policy="rules: []"
    )
    data = encode_agent(registered)
    obj = json.loads(data)
    assert "secret" not in obj
    assert registered.secret.encode() not in data
    assert obj == {
        "id": "agent-1",
        "webhook_url": "http://agent/webhook",
        "registered_at": rfc3339(T0),
        "description": "Answers.",
        "input_schema": {"type": "object"},
        "output_schema": None,
        "has_policy": True,
    }
    assert json.loads(encode_agent(agent()))["has_policy"] is False


@given(st.text(max_size=30).map(lambda t: "SECRET-" + t))
def test_agent_encoding_never_contains_the_secret(secret: str) -> None:
    data = encode_agent(dataclasses.replace(agent(), secret=secret))
    decoded = json.loads(data)
    assert "secret" not in decoded
    assert "SECRET-" not in json.dumps(decoded, ensure_ascii=False)


# -- webhook and errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lease", "text"), [(120.0, b"120"), (90, b"90"), (0.5, b"0.5"), (1e3, b"1000")]
)
def test_webhook_body(lease: float, text: bytes) -> None:
    delivery = Delivery(
        execution_id="0192f1a0-0000-7000-8000-000000000000",
        agent_id="agent-1",
        dispatch_id="0192f1a0-1111-7000-8000-000000000000",
        attempt=3,
    )
    data = encode_webhook(delivery, lease)
    assert data == (
        b'{"execution_id":"0192f1a0-0000-7000-8000-000000000000",'
        b'"dispatch_id":"0192f1a0-1111-7000-8000-000000000000",'
        b'"dispatch_attempt":3,"lease_timeout_seconds":' + text + b"}"
    )
    parsed = parse_webhook(data)
    assert (parsed.dispatch_attempt, parsed.lease_timeout_seconds) == (3, lease)
    assert isinstance(json.loads(data)["dispatch_attempt"], int)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_envelope(code: ErrorCode) -> None:
    data = encode_error(Refusal(code, "what went wrong \u00e9"))
    assert json.loads(data) == {"code": code.value, "message": "what went wrong \u00e9"}
    assert 400 <= code.status < 600


def test_error_status_table() -> None:
    assert {c.value: c.status for c in ErrorCode} == {
        "validation_error": 400,
        "unauthorized": 401,
        "forbidden": 403,
        "not_found": 404,
        "conflict": 409,
        "execution_terminal": 409,
        "lease_superseded": 409,
        "payload_too_large": 413,
        "method_not_allowed": 405,
        "not_implemented": 501,
        "internal_error": 500,
    }


# -- rfc3339 and dumps ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "text"),
    [
        (0.0, "1970-01-01T00:00:00.000000Z"),
        (1760000000.0, "2025-10-09T08:53:20.000000Z"),
        (1760000000.25, "2025-10-09T08:53:20.250000Z"),
    ],
)
def test_rfc3339(t: float, text: str) -> None:
    assert rfc3339(t) == text


def test_dumps() -> None:
    assert dumps({"a": RawJSON('{"x":1.50}'), "b": [1, 2.5, True, False, None], "c": ("t",)}) == (
        '{"a":{"x":1.50},"b":[1,2.5,true,false,null],"c":["t"]}'
    )
    assert dumps("caf\u00e9 <&>") == '"caf\u00e9 <&>"'
    assert dumps({}) == "{}"
    assert dumps([]) == "[]"
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        dumps(math.nan)


def test_raw_json_value_semantics() -> None:
    assert RawJSON("1") == RawJSON("1")
    assert RawJSON("1") != RawJSON("2")
    assert RawJSON("1") != "1"
    assert hash(RawJSON("1")) == hash(RawJSON("1"))
    assert repr(RawJSON("1")) == "RawJSON('1')"


@given(
    st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(allow_nan=False, allow_infinity=False),
            st.text(),
        ),
        lambda c: st.one_of(
            st.lists(c, max_size=4), st.dictionaries(st.text(max_size=5), c, max_size=4)
        ),
        max_leaves=15,
    )
)
def test_dumps_is_json(value: Any) -> None:
    assert json.loads(dumps(value)) == value


def test_rfc3339_clamps_times_beyond_the_calendar() -> None:
    assert rfc3339(1e300) == "9999-12-31T23:59:59.999999Z"
    assert rfc3339(-1e300) == "0001-01-01T00:00:00.000000Z"

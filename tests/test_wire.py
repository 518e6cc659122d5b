"""Inbound wire messages (`_wire.py`): every parser, good input, each error
(the message names the field), and unknown fields ignored."""

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebuno_proto import (
    MAX_DELTA_BYTES,
    Idempotency,
    MessageError,
    RemoteProtocolError,
    StepKind,
    parse_agent_metadata,
    parse_agent_registration,
    parse_approval_decision,
    parse_create_execution,
    parse_execution_completion,
    parse_execution_failure,
    parse_policy_upload,
    parse_step_completion,
    parse_step_failure,
    parse_step_submission,
    parse_stream_delta,
    parse_webhook,
    valid_agent_id,
)

EXECUTION = "0192f1a0-0000-7000-8000-000000000000"
DISPATCH = "0192f1a0-1111-7000-8000-000000000000"


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode("utf-8")


def raises(parser: Callable[[bytes], object], data: bytes, field: str, problem: str) -> None:
    with pytest.raises(MessageError) as info:
        parser(data)
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, RemoteProtocolError)
    assert err.field == field
    assert problem in err.problem
    assert str(err) == (f"{field}: {err.problem}" if field else err.problem)


# -- shared body errors ---------------------------------------------------------------

ALL_PARSERS = [
    parse_webhook,
    parse_step_submission,
    parse_step_completion,
    parse_step_failure,
    parse_stream_delta,
    parse_execution_completion,
    parse_execution_failure,
    parse_agent_metadata,
    parse_create_execution,
    parse_agent_registration,
    parse_approval_decision,
    parse_policy_upload,
]


@pytest.mark.parametrize("parser", ALL_PARSERS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("data", [b"{", b"[1,]", b'{"a": NaN}', b"{} x", b"\xff"])
def test_invalid_json_body(parser: Callable[[bytes], object], data: bytes) -> None:
    raises(parser, data, "", "body is not valid JSON: invalid JSON")


@pytest.mark.parametrize("parser", ALL_PARSERS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("data", [b"[]", b"1", b'"x"', b"null", b"true"])
def test_body_must_be_an_object(parser: Callable[[bytes], object], data: bytes) -> None:
    raises(parser, data, "", "body must be a JSON object")


@pytest.mark.parametrize(
    "parser",
    [p for p in ALL_PARSERS if p is not parse_approval_decision],
    ids=lambda p: p.__name__,
)
def test_empty_body_is_not_an_object(parser: Callable[[bytes], object]) -> None:
    raises(parser, b"", "", "body must be a JSON object")


# -- webhook --------------------------------------------------------------------------

WEBHOOK = {
    "execution_id": EXECUTION,
    "dispatch_id": DISPATCH,
    "dispatch_attempt": 2,
    "lease_timeout_seconds": 120,
}


def test_webhook_good() -> None:
    payload = parse_webhook(body(**WEBHOOK, extra={"ignored": [1, 2]}))
    assert payload.execution_id == EXECUTION
    assert payload.dispatch_id == DISPATCH
    assert payload.dispatch_attempt == 2
    assert payload.lease_timeout_seconds == 120.0


def test_webhook_normalises_uuid_spellings() -> None:
    payload = parse_webhook(
        body(**{**WEBHOOK, "execution_id": EXECUTION.upper(), "dispatch_id": "{" + DISPATCH + "}"})
    )
    assert payload.execution_id == EXECUTION
    assert payload.dispatch_id == DISPATCH


def test_webhook_fractional_lease() -> None:
    assert (
        parse_webhook(body(**{**WEBHOOK, "lease_timeout_seconds": 0.5})).lease_timeout_seconds
        == 0.5
    )


def test_webhook_on_the_slow_path() -> None:
    """A NUL anywhere sends the body down the slow path; fields read the same."""
    payload = parse_webhook(body(**WEBHOOK, note="\x00"))
    assert payload.dispatch_attempt == 2
    assert payload.lease_timeout_seconds == 120.0
    assert payload.execution_id == EXECUTION


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"execution_id": None}, "execution_id", "is required"),
        ({"execution_id": ""}, "execution_id", "must not be empty"),
        ({"execution_id": 5}, "execution_id", "must be a string, got a number"),
        ({"execution_id": "nope"}, "execution_id", "must be a UUID, got 'nope'"),
        ({"execution_id": "x" * 65}, "execution_id", "at most 64 characters"),
        ({"dispatch_id": [DISPATCH]}, "dispatch_id", "must be a string, got an array"),
        ({"dispatch_id": {"id": 1}}, "dispatch_id", "must be a string, got an object"),
        ({"dispatch_id": True}, "dispatch_id", "must be a string, got a boolean"),
        ({"dispatch_attempt": None}, "dispatch_attempt", "is required"),
        ({"dispatch_attempt": "2"}, "dispatch_attempt", "must be an integer, got a string"),
        ({"dispatch_attempt": 2.0}, "dispatch_attempt", "must be an integer, got a number"),
        ({"dispatch_attempt": True}, "dispatch_attempt", "must be an integer, got a boolean"),
        ({"dispatch_attempt": 0}, "dispatch_attempt", "must be >= 1, got 0"),
        ({"dispatch_attempt": -3}, "dispatch_attempt", "must be >= 1, got -3"),
        ({"lease_timeout_seconds": None}, "lease_timeout_seconds", "is required"),
        (
            {"lease_timeout_seconds": "120"},
            "lease_timeout_seconds",
            "must be a number, got a string",
        ),
        (
            {"lease_timeout_seconds": 0},
            "lease_timeout_seconds",
            "must be a positive number, got 0.0",
        ),
        ({"lease_timeout_seconds": -1.5}, "lease_timeout_seconds", "must be a positive number"),
        ({"lease_timeout_seconds": [1]}, "lease_timeout_seconds", "must be a number, got an array"),
    ],
)
def test_webhook_errors(change: dict[str, Any], field: str, problem: str) -> None:
    fields = {**WEBHOOK, **change}
    fields = {k: v for k, v in fields.items() if v is not None}
    raises(parse_webhook, body(**fields), field, problem)


def test_webhook_explicit_null_is_missing() -> None:
    raises(
        parse_webhook,
        body(**{**WEBHOOK, "dispatch_attempt": None}),
        "dispatch_attempt",
        "is required",
    )


def test_webhook_infinite_lease() -> None:
    data = json.dumps(WEBHOOK).replace("120", "1e999").encode()
    raises(parse_webhook, data, "lease_timeout_seconds", "must be a positive number, got inf")


# -- step submission ------------------------------------------------------------------


def test_submission_good() -> None:
    sub = parse_step_submission(
        body(
            kind="tool_call",
            target="search",
            args={"q": "<x>", "n": 1},
            idempotency="at_most_once",
            resources=[],
        )
    )
    assert sub.kind is StepKind.TOOL_CALL
    assert sub.target == "search"
    assert sub.args == '{"n":1,"q":"\\u003cx\\u003e"}'
    assert sub.idempotency is Idempotency.AT_MOST_ONCE


def test_submission_keeps_number_literals() -> None:
    sub = parse_step_submission(b'{"kind": "local", "target": "t", "args": {"f": 1.50, "e": 1e5}}')
    assert sub.args == '{"e":1e5,"f":1.50}'
    assert sub.kind is StepKind.LOCAL


def test_submission_defaults() -> None:
    sub = parse_step_submission(body(kind="llm_call"))
    assert sub.target == ""
    assert sub.args == "null"
    assert sub.idempotency is Idempotency.SAFE_TO_RETRY
    explicit_null = parse_step_submission(body(kind="llm_call", args=None, idempotency=""))
    assert explicit_null.args == "null"
    assert explicit_null.idempotency is Idempotency.SAFE_TO_RETRY


def test_submission_on_the_slow_path() -> None:
    sub = parse_step_submission(body(kind="tool_call", target="t\u00e9", args=["\x00", 2]))
    assert sub.args == '["\\u0000",2]'
    assert sub.target == "t\u00e9"


def test_submission_target_surrogates_replaced() -> None:
    sub = parse_step_submission(b'{"kind": "tool_call", "target": "a\\ud800"}')
    assert sub.target == "a\ufffd"


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({}, "kind", "is required"),
        ({"kind": ""}, "kind", "must not be empty"),
        ({"kind": "shell"}, "kind", "must be one of tool_call, llm_call, local; got 'shell'"),
        ({"kind": "TOOL_CALL"}, "kind", "got 'TOOL_CALL'"),
        ({"kind": 1}, "kind", "must be a string, got a number"),
        ({"kind": "tool_call", "target": 7}, "target", "must be a string, got a number"),
        ({"kind": "tool_call", "target": "x" * 1025}, "target", "at most 1024 characters"),
        ({"kind": "tool_call", "idempotency": "once"}, "idempotency", "got 'once'"),
        ({"kind": "tool_call", "idempotency": False}, "idempotency", "got a boolean"),
    ],
)
def test_submission_errors(fields: dict[str, Any], field: str, problem: str) -> None:
    raises(parse_step_submission, body(**fields), field, problem)


def test_submission_nan_args_rejected() -> None:
    raises(
        parse_step_submission,
        b'{"kind": "tool_call", "args": {"x": NaN}}',
        "",
        "NaN is not a JSON value",
    )


# -- step completion / failure -----------------------------------------------------------


def test_step_completion() -> None:
    assert parse_step_completion(body(result={"b": 1.5, "a": "<"}, captures=[])).result == (
        '{"a":"\\u003c","b":1.5}'
    )
    assert parse_step_completion(b"{}").result == "null"
    assert parse_step_completion(b'{"result": 1.50}').result == "1.50"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (body(error={"message": "boom", "code": 1}), {"message": "boom", "code": 1}),
        (body(error="boom"), {"message": "boom"}),
        (body(error=None), {"message": "step failed"}),
        (b"{}", {"message": "step failed"}),
        (body(error=42), {"message": "42"}),
        (body(error=[1, "<"]), {"message": '[1,"\\u003c"]'}),
        (body(error=True), {"message": "true"}),
        (body(error="\x00"), {"message": "\x00"}),
        (body(error={"reason": "x"}, capture_failures=[]), {"reason": "x"}),
    ],
)
def test_step_failure_is_always_an_object(data: bytes, expected: dict[str, Any]) -> None:
    error = parse_step_failure(data).error
    assert json.loads(error) == expected


def test_step_failure_object_is_canonical() -> None:
    assert parse_step_failure(b'{"error": {"z": 1, "a": "&"}}').error == '{"a":"\\u0026","z":1}'


# -- stream delta -----------------------------------------------------------------------------


def test_stream_delta_good() -> None:
    delta = parse_stream_delta(body(seq=0, data="hello"))
    assert (delta.seq, delta.data) == (0, "hello")
    assert parse_stream_delta(body(seq=5)).data == ""


def test_stream_delta_size_limits() -> None:
    assert parse_stream_delta(body(seq=1, data="a" * MAX_DELTA_BYTES)).data == "a" * 7000
    raises(parse_stream_delta, body(seq=1, data="a" * 7001), "data", "at most 7000 characters")
    # 3500 two-byte characters is exactly 7000 bytes; one more is over.
    assert len(parse_stream_delta(body(seq=1, data="\u00e9" * 3500)).data) == 3500
    raises(
        parse_stream_delta, body(seq=1, data="\u00e9" * 3501), "data", "at most 7000 UTF-8 bytes"
    )


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({"data": "x"}, "seq", "is required"),
        ({"seq": -1, "data": "x"}, "seq", "must be >= 0, got -1"),
        ({"seq": "1", "data": "x"}, "seq", "must be an integer, got a string"),
        ({"seq": 1, "data": 5}, "data", "must be a string, got a number"),
    ],
)
def test_stream_delta_errors(fields: dict[str, Any], field: str, problem: str) -> None:
    raises(parse_stream_delta, body(**fields), field, problem)


# -- execution completion / failure ----------------------------------------------------------


def test_execution_completion() -> None:
    done = parse_execution_completion(body(output={"answer": 1}, state={"messages": []}))
    assert done.output == '{"answer":1}'
    assert done.state == '{"messages":[]}'
    no_state = parse_execution_completion(body(output="x"))
    assert no_state.output == '"x"'
    assert no_state.state is None
    assert parse_execution_completion(body(state=None)).state is None
    assert parse_execution_completion(b"{}").output == "null"
    assert parse_execution_completion(body(output=None, state=0)).state == "0"


def test_execution_failure() -> None:
    assert parse_execution_failure(body(error="tool_error: x: boom")).error == "tool_error: x: boom"
    assert parse_execution_failure(body(error="")).error == "agent_error"
    assert parse_execution_failure(b"{}").error == "agent_error"
    raises(
        parse_execution_failure, body(error={"m": 1}), "error", "must be a string, got an object"
    )
    # Too long is cut, not refused: the agent must still be able to fail.
    long = parse_execution_failure(body(error="x" * (64 * 1024 + 10))).error
    assert long == "x" * (64 * 1024) + "... [10 more characters]"


def test_huge_number_literals_are_message_errors() -> None:
    raises(
        parse_stream_delta,
        b'{"seq":' + b"1" * 5000 + b',"data":"x"}',
        "seq",
        "must be an integer",
    )
    huge_lease = (
        b'{"execution_id":"0192f1a0-0000-7000-8000-000000000000",'
        b'"dispatch_id":"0192f1a0-1111-7000-8000-000000000000","dispatch_attempt":1,'
        b'"lease_timeout_seconds":' + b"1" * 400 + b"}"
    )
    raises(parse_webhook, huge_lease, "lease_timeout_seconds", "positive number")


# -- agent metadata -----------------------------------------------------------------------------


def test_agent_metadata() -> None:
    meta = parse_agent_metadata(
        body(description="Answers.", input_schema={"type": "object"}, output_schema=None)
    )
    assert meta.description == "Answers."
    assert meta.input_schema == '{"type":"object"}'
    assert meta.output_schema is None
    empty = parse_agent_metadata(b"{}")
    assert (empty.description, empty.input_schema, empty.output_schema) == (None, None, None)


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({"description": 1}, "description", "must be a string, got a number"),
        ({"input_schema": []}, "input_schema", "must be a JSON object or null, got an array"),
        ({"output_schema": "x"}, "output_schema", "must be a JSON object or null, got a string"),
        ({"output_schema": True}, "output_schema", "got a boolean"),
    ],
)
def test_agent_metadata_errors(fields: dict[str, Any], field: str, problem: str) -> None:
    raises(parse_agent_metadata, body(**fields), field, problem)


# -- create execution ----------------------------------------------------------------------------


def test_create_execution() -> None:
    req = parse_create_execution(
        body(
            agent_id="dev-agent",
            input={"prompt": "hi"},
            session="chat-1",
            idempotency_key="k1",
            on_behalf_of="someone",
            spawned_by=None,
        )
    )
    assert req.agent_id == "dev-agent"
    assert req.input == '{"prompt":"hi"}'
    assert req.session == "chat-1"
    assert req.idempotency_key == "k1"
    bare = parse_create_execution(body(agent_id="a"))
    assert (bare.input, bare.session, bare.idempotency_key) == ("null", "", "")


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({}, "agent_id", "is required"),
        ({"agent_id": ""}, "agent_id", "must not be empty"),
        ({"agent_id": "a" * 129}, "agent_id", "at most 128 characters"),
        ({"agent_id": "a", "session": 1}, "session", "must be a string, got a number"),
        ({"agent_id": "a", "session": "s" * 257}, "session", "at most 256"),
        ({"agent_id": "a", "idempotency_key": []}, "idempotency_key", "got an array"),
    ],
)
def test_create_execution_errors(fields: dict[str, Any], field: str, problem: str) -> None:
    raises(parse_create_execution, body(**fields), field, problem)


# -- agent registration ----------------------------------------------------------------------------


def test_agent_registration() -> None:
    reg = parse_agent_registration(
        body(id="dev-agent", webhook_url="http://localhost:5000/webhook", secret="s", extra=1)
    )
    assert (reg.id, reg.webhook_url, reg.secret) == (
        "dev-agent",
        "http://localhost:5000/webhook",
        "s",
    )
    assert (
        parse_agent_registration(
            body(id="a.b:c_d-1", webhook_url="https://example.com", secret="s")
        ).webhook_url
        == "https://example.com"
    )


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({"webhook_url": "http://h", "secret": "s"}, "id", "is required"),
        ({"id": "-bad", "webhook_url": "http://h", "secret": "s"}, "id", "starting alphanumeric"),
        ({"id": "a b", "webhook_url": "http://h", "secret": "s"}, "id", "letters, digits"),
        ({"id": "a/b", "webhook_url": "http://h", "secret": "s"}, "id", "letters, digits"),
        ({"id": "a", "secret": "s"}, "webhook_url", "is required"),
        (
            {"id": "a", "webhook_url": "ftp://h", "secret": "s"},
            "webhook_url",
            "http:// or https://",
        ),
        ({"id": "a", "webhook_url": "http://", "secret": "s"}, "webhook_url", "got 'http://'"),
        ({"id": "a", "webhook_url": "http://h x/", "secret": "s"}, "webhook_url", "URL"),
        ({"id": "a", "webhook_url": "http://h"}, "secret", "is required"),
        ({"id": "a", "webhook_url": "http://h", "secret": ""}, "secret", "must not be empty"),
    ],
)
def test_agent_registration_errors(fields: dict[str, Any], field: str, problem: str) -> None:
    raises(parse_agent_registration, body(**fields), field, problem)


@pytest.mark.parametrize(
    ("agent_id", "ok"),
    [
        ("a", True),
        ("dev-agent", True),
        ("A9_.:-", True),
        ("a" * 128, True),
        ("a" * 129, False),
        ("", False),
        ("_a", False),
        ("a b", False),
        ("\u00e9", False),
        ("a\n", False),
    ],
)
def test_valid_agent_id(agent_id: str, ok: bool) -> None:
    assert valid_agent_id(agent_id) is ok


# -- approvals and policies ------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"  \n", b"{}"])
def test_approval_decision_empty(data: bytes) -> None:
    decision = parse_approval_decision(data)
    assert (decision.decided_by, decision.rationale) == ("", "")


def test_approval_decision_fields() -> None:
    decision = parse_approval_decision(body(rationale="looks fine", decided_by="alice", extra=[]))
    assert (decision.decided_by, decision.rationale) == ("alice", "looks fine")
    raises(
        parse_approval_decision, body(rationale=1), "rationale", "must be a string, got a number"
    )
    raises(parse_approval_decision, body(decided_by="x" * 257), "decided_by", "at most 256")


def test_policy_upload() -> None:
    assert parse_policy_upload(body(bundle="rules: []\n")).bundle == "rules: []\n"
    raises(parse_policy_upload, b"{}", "bundle", "is required")
    raises(parse_policy_upload, body(bundle=""), "bundle", "must not be empty")
    raises(parse_policy_upload, body(bundle={"rules": []}), "bundle", "got an object")


# -- properties ------------------------------------------------------------------------------------

_junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
    lambda c: st.one_of(
        st.lists(c, max_size=3), st.dictionaries(st.text(max_size=3), c, max_size=3)
    ),
    max_leaves=6,
)


@given(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in WEBHOOK), _junk, max_size=4))
def test_unknown_fields_are_ignored(extra: dict[str, Any]) -> None:
    assert parse_webhook(body(**WEBHOOK, **extra)) == parse_webhook(body(**WEBHOOK))
    sub = {"kind": "local", "target": "t", "args": {"a": 1}}
    extra_sub = {k: v for k, v in extra.items() if k not in sub and k != "idempotency"}
    assert parse_step_submission(body(**sub, **extra_sub)) == parse_step_submission(body(**sub))


@pytest.mark.parametrize("parser", ALL_PARSERS, ids=lambda p: p.__name__)
@given(data=st.binary(max_size=60))
def test_parsers_raise_only_message_errors(parser: Callable[[bytes], object], data: bytes) -> None:
    try:
        parser(data)
    except MessageError as err:
        message = str(err)
    else:
        message = "parsed"
    assert message  # any other exception type fails the test


def test_describe_null() -> None:
    """No parser reaches it today (a null field is missing), but it must not lie."""
    from rebuno_proto._wire import _Body

    assert _Body(b"{}")._describe(None) == "null"

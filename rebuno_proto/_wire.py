"""Inbound wire messages (PROTOCOL.md §3, §4): parsing JSON bodies into typed,
immutable records with precise errors.

Every parser takes the raw body bytes, ignores fields it does not know (the
published SDK sends `resources`, `captures`...), and raises `MessageError`
naming the field and what is wrong with it. JSON values the kernel stores are
kept as canonical JSON text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from ._canonical import Document, parse_document
from ._errors import CanonicalJSONError, MessageError
from ._jsonout import dumps
from ._records import Idempotency, StepKind
from ._step_id import canonical_uuid

__all__ = [
    "MAX_DELTA_BYTES",
    "AgentMetadata",
    "AgentRegistration",
    "ApprovalDecision",
    "CreateExecution",
    "ExecutionCompletion",
    "ExecutionFailure",
    "PolicyUpload",
    "StepCompletion",
    "StepFailure",
    "StepSubmission",
    "StreamDelta",
    "WebhookPayload",
    "parse_agent_metadata",
    "parse_agent_registration",
    "parse_approval_decision",
    "parse_create_execution",
    "parse_execution_completion",
    "parse_execution_failure",
    "parse_policy_upload",
    "parse_step_completion",
    "parse_step_failure",
    "parse_step_submission",
    "parse_stream_delta",
    "parse_webhook",
]

#: A streamed delta's `data` may be at most this many UTF-8 bytes (PROTOCOL §4.2).
MAX_DELTA_BYTES: Final = 7000
#: An execution's failure reason is kept to this many characters.
MAX_REASON_CHARS: Final = 64 * 1024
_MAX_NAME: Final = 1024
_AGENT_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


class _Body:
    """A parsed JSON object body with typed, error-reporting field readers."""

    __slots__ = ("doc", "obj")

    def __init__(self, data: bytes, *, empty_is_object: bool = False) -> None:
        if not data.strip() and empty_is_object:
            data = b"{}"
        try:
            self.doc: Document = parse_document(data)
        except CanonicalJSONError as err:
            raise MessageError("", f"body is not valid JSON: {err}") from None
        if not isinstance(self.doc.value, dict):
            raise MessageError("", "body must be a JSON object")
        self.obj: dict[str, Any] = self.doc.value

    def _describe(self, node: Any) -> str:
        if node is None:
            return "null"
        if isinstance(node, bool):
            return "a boolean"
        if self.doc.is_number(node):
            return "a number"
        if self.doc.is_string(node):
            return "a string"
        return "an array" if isinstance(node, list) else "an object"

    def string(self, name: str, *, required: bool = False, max_len: int = _MAX_NAME) -> str:
        node = self.obj.get(name)
        if node is None:
            if required:
                raise MessageError(name, "is required")
            return ""
        if not self.doc.is_string(node):
            raise MessageError(name, f"must be a string, got {self._describe(node)}")
        if required and not node:
            raise MessageError(name, "must not be empty")
        if len(node) > max_len:
            raise MessageError(name, f"must be at most {max_len} characters")
        return str(self.doc.plain(node))

    def optional_string(self, name: str, *, max_len: int = 1 << 20) -> str | None:
        node = self.obj.get(name)
        return None if node is None else self.string(name, max_len=max_len)

    def integer(self, name: str, *, minimum: int) -> int:
        node = self.obj.get(name)
        if node is None:
            raise MessageError(name, "is required")
        value = self.doc.integer(node)
        if value is None or isinstance(node, bool):
            raise MessageError(name, f"must be an integer, got {self._describe(node)}")
        if value < minimum:
            raise MessageError(name, f"must be >= {minimum}, got {value}")
        return value

    def positive_number(self, name: str) -> float:
        node = self.obj.get(name)
        if node is None:
            raise MessageError(name, "is required")
        if not self.doc.is_number(node):
            raise MessageError(name, f"must be a number, got {self._describe(node)}")
        text = self.doc.number_text(node)
        assert text is not None
        value = float(text)  # a literal too large for a float reads as inf
        if not value > 0 or value == float("inf"):
            raise MessageError(name, f"must be a positive number, got {value}")
        return value

    def json(self, name: str) -> str:
        """The field's canonical JSON text; absent is `null`."""
        return self.doc.canonical(self.obj.get(name)).decode("utf-8")

    def object_or_null(self, name: str) -> str | None:
        node = self.obj.get(name)
        if node is None:
            return None
        if not isinstance(node, dict):
            raise MessageError(name, f"must be a JSON object or null, got {self._describe(node)}")
        return self.doc.canonical(node).decode("utf-8")

    def uuid(self, name: str) -> str:
        text = self.string(name, required=True, max_len=64)
        value = canonical_uuid(text)
        if value is None:
            raise MessageError(name, f"must be a UUID, got {text!r}")
        return value


# -- webhook (kernel -> agent) -------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookPayload:
    """The body of a dispatch webhook (PROTOCOL.md §3): the execution and the
    lease it is delivered under."""

    execution_id: str
    dispatch_id: str
    dispatch_attempt: int
    lease_timeout_seconds: float


def parse_webhook(data: bytes) -> WebhookPayload:
    """Parse a webhook body. Raises `MessageError` naming the bad field."""
    body = _Body(data)
    return WebhookPayload(
        execution_id=body.uuid("execution_id"),
        dispatch_id=body.uuid("dispatch_id"),
        dispatch_attempt=body.integer("dispatch_attempt", minimum=1),
        lease_timeout_seconds=body.positive_number("lease_timeout_seconds"),
    )


# -- agent -> kernel -----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSubmission:
    """`POST /v0/executions/{id}/steps`. `args` is canonical JSON text."""

    kind: StepKind
    target: str
    args: str
    idempotency: Idempotency


_KINDS: Final = {k.value: k for k in StepKind}
_IDEMPOTENCY: Final = {i.value: i for i in Idempotency}


def parse_step_submission(data: bytes) -> StepSubmission:
    """Parse a step submission; `idempotency` defaults to `safe_to_retry`."""
    body = _Body(data)
    kind_text = body.string("kind", required=True)
    kind = _KINDS.get(kind_text)
    if kind is None:
        raise MessageError("kind", f"must be one of tool_call, llm_call, local; got {kind_text!r}")
    target = body.string("target")
    idem_text = body.string("idempotency") or Idempotency.SAFE_TO_RETRY.value
    idempotency = _IDEMPOTENCY.get(idem_text)
    if idempotency is None:
        raise MessageError(
            "idempotency", f"must be safe_to_retry or at_most_once; got {idem_text!r}"
        )
    return StepSubmission(kind=kind, target=target, args=body.json("args"), idempotency=idempotency)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCompletion:
    result: str


def parse_step_completion(data: bytes) -> StepCompletion:
    """`.../complete`: `{"result": any}`; an absent result is `null`."""
    return StepCompletion(result=_Body(data).json("result"))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFailure:
    """`.../fail`. `error` is canonical JSON text of an object, always: the
    published SDK calls `.get` on a replayed error (PROTOCOL.md §5.2)."""

    error: str


def parse_step_failure(data: bytes) -> StepFailure:
    body = _Body(data)
    node = body.obj.get("error")
    if isinstance(node, dict):
        return StepFailure(error=body.doc.canonical(node).decode("utf-8"))
    if node is None:
        message: Any = "step failed"
    elif body.doc.is_string(node):
        message = body.doc.plain(node)
    else:
        message = body.json("error")
    return StepFailure(error=dumps({"message": message}))


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamDelta:
    seq: int
    data: str


def parse_stream_delta(data: bytes) -> StreamDelta:
    body = _Body(data)
    seq = body.integer("seq", minimum=0)
    text = body.string("data", max_len=MAX_DELTA_BYTES)
    if len(text.encode("utf-8")) > MAX_DELTA_BYTES:
        raise MessageError("data", f"must be at most {MAX_DELTA_BYTES} UTF-8 bytes")
    return StreamDelta(seq=seq, data=text)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionCompletion:
    output: str
    state: str | None


def parse_execution_completion(data: bytes) -> ExecutionCompletion:
    """`POST /v0/executions/{id}/complete`: `{"output": any, "state"?: any}`."""
    body = _Body(data)
    state = body.obj.get("state")
    return ExecutionCompletion(
        output=body.json("output"), state=None if state is None else body.json("state")
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionFailure:
    error: str


def parse_execution_failure(data: bytes) -> ExecutionFailure:
    """`POST /v0/executions/{id}/fail`: `{"error": string}` becomes the reason.

    A reason longer than `MAX_REASON_CHARS` is cut, not refused: an agent whose
    failure text is huge must still be able to fail its execution.
    """
    body = _Body(data)
    error = body.string("error", max_len=1 << 30)
    if len(error) > MAX_REASON_CHARS:
        cut = len(error) - MAX_REASON_CHARS
        error = f"{error[:MAX_REASON_CHARS]}... [{cut} more characters]"
    return ExecutionFailure(error=error or "agent_error")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentMetadata:
    description: str | None
    input_schema: str | None
    output_schema: str | None


def parse_agent_metadata(data: bytes) -> AgentMetadata:
    """`PUT /v0/agents/{id}/metadata`: description and JSON Schemas, each nullable."""
    body = _Body(data)
    return AgentMetadata(
        description=body.optional_string("description", max_len=64 * 1024),
        input_schema=body.object_or_null("input_schema"),
        output_schema=body.object_or_null("output_schema"),
    )


# -- client / admin -> kernel --------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateExecution:
    agent_id: str
    input: str
    session: str
    idempotency_key: str


def parse_create_execution(data: bytes) -> CreateExecution:
    """`POST /v0/executions`. Fields the kernel does not implement are ignored."""
    body = _Body(data)
    return CreateExecution(
        agent_id=body.string("agent_id", required=True, max_len=128),
        input=body.json("input"),
        session=body.string("session", max_len=256),
        idempotency_key=body.string("idempotency_key", max_len=256),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentRegistration:
    id: str
    webhook_url: str
    secret: str


def parse_agent_registration(data: bytes) -> AgentRegistration:
    """`POST /v0/agents`: `{"id", "webhook_url", "secret"}`."""
    body = _Body(data)
    agent_id = body.string("id", required=True, max_len=128)
    if not _AGENT_ID.fullmatch(agent_id):
        raise MessageError(
            "id", "must be 1-128 characters of letters, digits and _ . : - (starting alphanumeric)"
        )
    url = body.string("webhook_url", required=True, max_len=2048)
    if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s]*)?", url):
        raise MessageError("webhook_url", f"must be an http:// or https:// URL, got {url!r}")
    secret = body.string("secret", required=True, max_len=1024)
    return AgentRegistration(id=agent_id, webhook_url=url, secret=secret)


def valid_agent_id(agent_id: str) -> bool:
    """Whether `agent_id` is a well-formed agent id."""
    return _AGENT_ID.fullmatch(agent_id) is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalDecision:
    decided_by: str
    rationale: str


def parse_approval_decision(data: bytes) -> ApprovalDecision:
    """`POST /v0/approvals/{id}/grant|deny`; an empty body means no rationale."""
    body = _Body(data, empty_is_object=True)
    return ApprovalDecision(
        decided_by=body.string("decided_by", max_len=256),
        rationale=body.string("rationale", max_len=16 * 1024),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyUpload:
    bundle: str


def parse_policy_upload(data: bytes) -> PolicyUpload:
    """`POST /v0/policies/{agent_id}`: `{"bundle": "<raw YAML>"}`."""
    return PolicyUpload(bundle=_Body(data).string("bundle", required=True, max_len=1 << 20))

"""The exceptions agents and clients see, and how kernel errors map onto them.

The kernel's error envelope carries a `code`; the exception class is chosen by
that code, never by the HTTP status (PROTOCOL.md §4.0), exactly as the
published SDK does, so code written against either behaves the same.

Control-flow signals -- `Blocked`, `Terminated`, `LeaseSuperseded` -- unwind a
handler without failing the execution; the kernel's state stands.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Final

from rebuno_proto import HandlerOutcome
from rebuno_proto import failure_reason as _core_failure_reason

__all__ = [
    "REFUSAL_TYPE",
    "APIError",
    "Blocked",
    "ConflictError",
    "ForbiddenError",
    "KernelUnreachable",
    "LeaseSuperseded",
    "NetworkError",
    "NotFoundError",
    "PolicyError",
    "RateLimited",
    "RebunoError",
    "Terminated",
    "ToolError",
    "UnauthorizedError",
    "ValidationError",
    "error_from_body",
    "failure_reason",
    "raise_for_refusal",
    "refusal_message",
]


class RebunoError(Exception):
    """Base class of everything this SDK raises."""


class NetworkError(RebunoError):
    """The kernel could not be reached (connection refused, timeout...)."""


class KernelUnreachable(NetworkError):
    """An agent's own call to the kernel failed for good: refused past the retry
    budget, timed out, or its connection was lost.

    Inside a handler it is a control-flow signal like `LeaseSuperseded`: the
    dispatch unwinds without reporting anything, and the kernel delivers the
    execution again once the lease lapses.
    """


class APIError(RebunoError):
    """The kernel answered with an error envelope.

    Attributes:
        code: the envelope's `code` (`validation_error`, `not_found`, ...).
        status_code: the HTTP status.
    """

    def __init__(self, message: str, code: str = "internal_error", status_code: int = 500) -> None:
        super().__init__(message)
        self.code = code
        self.status_code = status_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return f"[{self.code}] {self.message} (HTTP {self.status_code})"


class ValidationError(APIError):
    """The request was malformed (400)."""


class UnauthorizedError(APIError):
    """Bad or missing credentials (401)."""


class ForbiddenError(APIError):
    """The caller may not do this (403)."""


class NotFoundError(APIError):
    """No such execution, step, agent or approval (404)."""


class ConflictError(APIError):
    """The request conflicts with the current state (409)."""


class PolicyError(APIError):
    """Policy denied a step. `reason` is the rule's reason; `rule_id` the rule."""

    def __init__(self, reason: str, rule_id: str = "") -> None:
        super().__init__(reason, "policy_denied", 403)
        self.rule_id = rule_id

    @property
    def reason(self) -> str:
        return self.message


class LeaseSuperseded(APIError):
    """A newer delivery owns this dispatch: stop, write nothing more."""

    def __init__(
        self,
        message: str = "dispatch lease superseded",
        code: str = "lease_superseded",
        status_code: int = 409,
    ) -> None:
        super().__init__(message, code, status_code)


class ToolError(RebunoError):
    """A tool or step body failed (now, or when it was first run: replayed)."""

    def __init__(
        self, message: str, tool_id: str = "", step_id: str = "", retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.tool_id = tool_id
        self.step_id = step_id
        self.retryable = retryable

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return f"{self.tool_id}: {self.message}" if self.tool_id else self.message


class RateLimited(RebunoError):
    """A policy rate limit refused the step."""

    def __init__(self, reason: str = "rate_limit_exceeded") -> None:
        super().__init__(reason)
        self.reason = reason


class Blocked(RebunoError):
    """The execution waits for a human approval: the dispatch unwinds."""

    def __init__(self, message: str = "step blocked") -> None:
        super().__init__(message)


class Terminated(RebunoError):
    """The execution is completed, failed or cancelled: the dispatch unwinds."""


_BY_CODE: Final[dict[str, type[APIError]]] = {
    "validation_error": ValidationError,
    "unauthorized": UnauthorizedError,
    "forbidden": ForbiddenError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "lease_superseded": LeaseSuperseded,
}


def error_from_body(status: int, body: Any, text: str = "") -> RebunoError:
    """The exception for an error response: by the envelope's `code`.

    Args:
        status: the HTTP status.
        body: the parsed JSON body (anything; non-objects count as no envelope).
        text: the raw body, used as the message when there is no envelope.
    """
    envelope = body if isinstance(body, dict) else {}
    code = str(envelope.get("code") or "internal_error")
    message = str(envelope.get("message") or text or "request failed")
    if code == "policy_denied":
        return PolicyError(message, rule_id=str(envelope.get("rule_id") or ""))
    if code == "execution_terminal":
        return Terminated(message)
    return _BY_CODE.get(code, APIError)(message, code, status)


# -- refusals carried through provider SDK errors -------------------------------------

REFUSAL_TYPE: Final = "rebuno_refusal"
_REFUSAL: Final = re.compile(REFUSAL_TYPE + r": ([a-z_]+)(?: reason=(.*))?")
_DEFAULT_REASONS: Final = {"denied": "policy_denied", "rate_limited": "rate_limit_exceeded"}


def refusal_message(decision: str, reason: str = "") -> str:
    """The marker text a refused LLM call carries in its synthetic error body."""
    return f"{REFUSAL_TYPE}: {decision}" + (f" reason={reason}" if reason else "")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the members of any exception group
    met on the way (anyio task groups wrap a child's error in one), depth first."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending and len(seen) < 64:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        linked = current.__cause__ or current.__context__
        if linked is not None:
            pending.append(linked)
        if isinstance(current, BaseExceptionGroup):
            pending.extend(reversed(current.exceptions))  # first member first


def _response_text(err: BaseException) -> str | None:
    """The body of the HTTP response an error carries (httpx.HTTPStatusError
    and provider SDK errors have `.response`), or None.

    Reading it must never raise: a streamed response that was not read raises
    `httpx.ResponseNotRead`, and an arbitrary exception's `response` may be a
    property that fails. Whatever goes wrong, there is no body to look at.
    """
    try:
        body = getattr(getattr(err, "response", None), "text", None)
    except Exception:
        return None
    return body if isinstance(body, str) else None


def _text(err: BaseException) -> str:
    try:
        return str(err)
    except Exception:
        return ""


def raise_for_refusal(exc: BaseException) -> None:
    """Re-raise a Rebuno refusal that reached you wrapped in a provider's error.

    A refused LLM call comes back to the provider SDK as an HTTP error whose body
    carries a `rebuno_refusal` marker; the provider raises its own exception.
    Call this on it: `Blocked`, `Terminated`, `LeaseSuperseded`, `PolicyError`
    or `RateLimited` is raised from it. Returns quietly for anything else.

    The exception's causes, contexts and exception-group members are searched
    too, so a refusal raised in a task group's child is found.
    """
    for err in _chain(exc):
        text = _text(err)
        body = _response_text(err)
        if body is not None:
            text = f"{text}\n{body}"
        match = _REFUSAL.search(text)
        if match is None:
            continue
        decision = match.group(1)
        reason = (match.group(2) or "").rstrip("'\"} \n\\") or _DEFAULT_REASONS.get(
            decision, decision
        )
        if decision in ("blocked", "execution_blocked"):
            raise Blocked() from exc
        if decision == "execution_terminal":
            raise Terminated(reason) from exc
        if decision == "lease_superseded":
            raise LeaseSuperseded() from exc
        if decision == "denied":
            raise PolicyError(reason) from exc
        if decision == "rate_limited":
            raise RateLimited(reason) from exc
        return


def unwrap_group(exc: BaseException) -> BaseException:
    """The single member of a (nested) one-member exception group, else `exc`.

    anyio task groups wrap a child's exception in an `ExceptionGroup` even
    when it is the only one; the member is what the handler meant to raise.
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def classify(exc: BaseException) -> tuple[HandlerOutcome, str, str]:
    """How an exception ends a handler: (outcome, detail, class name).

    A one-member exception group (however nested) is decided by its member.
    """
    exc = unwrap_group(exc)
    if isinstance(exc, Blocked):
        return HandlerOutcome.BLOCKED, "", ""
    if isinstance(exc, Terminated):
        return HandlerOutcome.TERMINATED, str(exc), ""
    if isinstance(exc, LeaseSuperseded):
        return HandlerOutcome.LEASE_SUPERSEDED, "", ""
    if isinstance(exc, PolicyError):
        return HandlerOutcome.POLICY_ERROR, exc.reason, ""
    if isinstance(exc, RateLimited):
        return HandlerOutcome.RATE_LIMITED, exc.reason, ""
    if isinstance(exc, ToolError):
        return HandlerOutcome.TOOL_ERROR, str(exc), ""
    detail = exc.message if isinstance(exc, APIError) else str(exc)
    return HandlerOutcome.OTHER_ERROR, detail, type(exc).__name__


def failure_reason(exc: BaseException) -> str:
    """The `failure_reason` an execution records when `exc` ends its handler
    (PROTOCOL.md §5.3): `policy_denied: ...`, a rate-limit reason,
    `tool_error: <tool>: <message>` or `agent_error: <Class>: <message>`."""
    outcome, detail, error_class = classify(exc)
    if outcome in (
        HandlerOutcome.BLOCKED,
        HandlerOutcome.TERMINATED,
        HandlerOutcome.LEASE_SUPERSEDED,
    ):
        outcome, detail, error_class = HandlerOutcome.OTHER_ERROR, str(exc), type(exc).__name__
    return _core_failure_reason(outcome, detail=detail, error_class=error_class)

"""The kernel's HTTP API (PROTOCOL.md §4), written once as a `Handler`.

The built-in h11 server (`rebuno_anyio._server`) and any ASGI server (through
`rebuno_asgi`) call the same `KernelAPI`. It authenticates the caller, parses
the body with the core's wire parsers, runs the kernel command and encodes the
reply. Every error is the envelope `{"code", "message"}` with the codes of
PROTOCOL.md §4.0, so the published SDK raises the matching exception.

Route classes (PROTOCOL.md §2.5): *open*; *bearer* (client and admin); *hmac*
(agent requests, `v1=` signature or the seeds' body form); *dual* (verified as
an agent when `Rebuno-Agent-Id` or `Rebuno-Signature` is present, else bearer).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

import anyio
import anyio.to_thread

from rebuno_proto import (
    ApprovalChoice,
    ErrorCode,
    Lease,
    MessageError,
    Refusal,
    RequestCheck,
    SignedHeaders,
    bearer_matches,
    canonical_uuid,
    check_agent_request,
    dumps,
    encode_agent,
    encode_approval,
    encode_decision,
    encode_error,
    encode_execution,
    encode_step,
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
)
from rebuno_proto._encode import (
    agent_fields,
    approval_fields,
    event_fields,
    execution_fields,
    step_fields,
)
from rebuno_proto._jsonout import RawJSON

from .._http import Request, Response
from ._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ._service import Kernel
from ._urls import webhook_url_problem

__all__ = ["KernelAPI", "PolicyLoader"]

_STEP_ID: Final = re.compile(r"[0-9a-f]{64}")
_JSON: Final = (("content-type", "application/json; charset=utf-8"),)
_STATUSES: Final = frozenset({"pending", "running", "blocked", "completed", "failed", "cancelled"})
_APPROVAL_STATUSES: Final = frozenset({"pending", "granted", "denied", "expired"})

#: Validates a raw policy bundle (YAML text); raises `ValueError` naming what is wrong.
#: Runs in a worker thread (a big bundle takes a while to check).
PolicyLoader = Callable[[str], object]

#: The largest policy bundle accepted, in UTF-8 bytes.
MAX_BUNDLE_BYTES: Final = 256 * 1024
#: A JSON body longer than this cannot carry a bundle within the limit (each
#: byte of it is at most six bytes in JSON: `\u0001`).
_MAX_POLICY_BODY: Final = 6 * MAX_BUNDLE_BYTES + 4096


class _Fail(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        self.refusal = Refusal(code, message)


def _error(refusal: Refusal) -> Response:
    return Response(refusal.status, encode_error(refusal), _JSON)


def _ok(body: bytes, status: int = 200) -> Response:
    return Response(status, body, _JSON)


def _no_content() -> Response:
    return Response(204)


@dataclass(frozen=True, slots=True)
class _Caller:
    agent_id: str | None = None  # authenticated agent (HMAC)
    principal: str = ""  # authenticated bearer principal ("" in dev mode)


_Handler = Callable[["KernelAPI", Request, _Caller, list[str]], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class _Route:
    method: str
    pattern: tuple[str, ...]
    auth: str  # open | bearer | hmac | dual
    handler: _Handler

    @property
    def name(self) -> str:
        """`METHOD /v0/executions/{}/steps`: the route pattern, for metrics."""
        return self.method + " /" + "/".join("{}" if p == "*" else p for p in self.pattern)

    def match(self, segments: list[str]) -> list[str] | None:
        if len(segments) != len(self.pattern):
            return None
        params = []
        for want, got in zip(self.pattern, segments, strict=True):
            if want == "*":
                params.append(got)
            elif want != got:
                return None
        return params


_ROUTES: list[_Route] = []


def _route(method: str, path: str, auth: str) -> Callable[[_Handler], _Handler]:
    pattern = tuple("*" if p.startswith("{") else p for p in path.strip("/").split("/"))

    def register(fn: _Handler) -> _Handler:
        _ROUTES.append(_Route(method, pattern, auth, fn))
        return fn

    return register


def _execution_id(text: str) -> str:
    value = canonical_uuid(text)
    if value is None:
        raise _Fail(ErrorCode.VALIDATION_ERROR, f"invalid execution id {text!r}: must be a UUID")
    return value


def _step_id(text: str) -> str:
    if not _STEP_ID.fullmatch(text):
        raise _Fail(ErrorCode.NOT_FOUND, "step not found")
    return text


def _lease(request: Request) -> Lease:
    dispatch_id = request.header("rebuno-dispatch-id")
    if not dispatch_id:
        raise _Fail(ErrorCode.VALIDATION_ERROR, "missing dispatch_id (Rebuno-Dispatch-Id header)")
    canonical = canonical_uuid(dispatch_id)
    if canonical is None:
        raise _Fail(ErrorCode.VALIDATION_ERROR, f"invalid dispatch_id {dispatch_id!r}")
    attempt = request.header("rebuno-dispatch-attempt")
    if not attempt:
        raise _Fail(
            ErrorCode.VALIDATION_ERROR, "missing dispatch attempt (Rebuno-Dispatch-Attempt header)"
        )
    if not attempt.isascii() or not attempt.isdigit() or len(attempt) > 9 or int(attempt) < 1:
        raise _Fail(ErrorCode.VALIDATION_ERROR, f"invalid dispatch attempt {attempt!r}")
    return Lease(dispatch_id=canonical, attempt=int(attempt))


def _int_param(params: Mapping[str, str], name: str, default: int, *, low: int, high: int) -> int:
    text = params.get(name, "")
    if not text:
        return default
    digits = text[1:] if text.startswith("-") else text
    # ASCII only: str.isdigit() also admits digits int() refuses ("²").
    if not digits.isascii() or not digits.isdigit():
        raise _Fail(ErrorCode.VALIDATION_ERROR, f"{name} must be an integer, got {text!r}")
    digits = digits.lstrip("0") or "0"
    if len(digits) > 18:  # past any bound (and int() refuses very long texts)
        return low if text.startswith("-") else high
    value = -int(digits) if text.startswith("-") else int(digits)
    return min(max(value, low), high)


def _events_limit(text: str) -> int:
    """`?limit=` of the event log: absent, <= 0 or not an integer means 100;
    at most 1000 (PROTOCOL.md §4.3)."""
    if not text.isascii() or not text.isdigit():
        return 100
    digits = text.lstrip("0")
    if not digits:
        return 100
    return 1000 if len(digits) > 4 else min(int(digits), 1000)


def _reply(result: object) -> None:
    if isinstance(result, Refusal):
        raise _Fail(result.code, result.message)


class KernelAPI:
    """The kernel's HTTP surface as one request handler.

    Args:
        kernel: the kernel service.
        bearer_token: the token client/admin routes require; `None` = dev mode
            (bearer routes open).
        principals: extra bearer tokens mapped to named principals; an approval
            decided with one is recorded as decided by that name.
        allow_body_form: accept agent requests signed in the seeds' body form.
        policy_loader: validates policy bundles (`None`: bundles are refused).
    """

    def __init__(
        self,
        kernel: Kernel,
        *,
        bearer_token: str | None = None,
        principals: Mapping[str, str] | None = None,
        allow_body_form: bool = True,
        policy_loader: PolicyLoader | None = None,
    ) -> None:
        self.kernel = kernel
        self.bearer_token = bearer_token
        self.principals = dict(principals or {})
        self.allow_body_form = allow_body_form
        self.policy_loader = policy_loader
        self._policy_threads = anyio.CapacityLimiter(2)
        self._by_shape: dict[tuple[str, int], list[_Route]] = {}
        self._paths: dict[int, list[_Route]] = {}
        for route in _ROUTES:
            self._by_shape.setdefault((route.method, len(route.pattern)), []).append(route)
            self._paths.setdefault(len(route.pattern), []).append(route)

    async def __call__(self, request: Request) -> Response:
        started = time.perf_counter()
        route, response = await self._dispatch(request)
        self.kernel.metrics.request(route, response.status, time.perf_counter() - started)
        return response

    async def _dispatch(self, request: Request) -> tuple[str, Response]:
        segments = [unquote(s) for s in request.route_path.strip("/").split("/")]
        method = "GET" if request.method == "HEAD" else request.method
        for route in self._by_shape.get((method, len(segments)), ()):
            params = route.match(segments)
            if params is None:
                continue
            try:
                caller = await self._authenticate(route.auth, request)
                return route.name, await route.handler(self, request, caller, params)
            except _Fail as fail:
                return route.name, _error(fail.refusal)
            except MessageError as err:
                return route.name, _error(Refusal(ErrorCode.VALIDATION_ERROR, str(err)))
        if any(r.match(segments) is not None for r in self._paths.get(len(segments), ())):
            return "unmatched", _error(
                Refusal(ErrorCode.METHOD_NOT_ALLOWED, f"{request.method} is not allowed here")
            )
        return "unmatched", _error(
            Refusal(ErrorCode.NOT_FOUND, f"no route for {request.method} {request.path}")
        )

    # -- authentication ------------------------------------------------------------------------

    async def _authenticate(self, auth: str, request: Request) -> _Caller:
        if auth == "open":
            return _Caller()
        if auth == "hmac" or (
            auth == "dual"
            and (
                request.header("rebuno-agent-id") is not None
                or request.header("rebuno-signature") is not None
            )
        ):
            return await self._agent(request)
        return self._bearer(request)

    def _bearer(self, request: Request) -> _Caller:
        if self.bearer_token is None and not self.principals:
            return _Caller()
        header = request.header("authorization")
        if self.bearer_token is not None and bearer_matches(header, self.bearer_token):
            return _Caller()
        for token, name in self.principals.items():
            if bearer_matches(header, token):
                return _Caller(principal=name)
        if header is None:
            raise _Fail(ErrorCode.UNAUTHORIZED, "missing bearer token (Authorization: Bearer ...)")
        raise _Fail(ErrorCode.UNAUTHORIZED, "invalid bearer token")

    async def _agent(self, request: Request) -> _Caller:
        ids = request.header_values("rebuno-agent-id")
        if len(ids) != 1 or not ids[0]:
            raise _Fail(ErrorCode.UNAUTHORIZED, "agent requests need exactly one Rebuno-Agent-Id")
        agent = await self.kernel.agent(ids[0])
        if agent is None:
            raise _Fail(ErrorCode.UNAUTHORIZED, f"unknown agent {ids[0]!r}")
        check = check_agent_request(
            agent.secret.encode("utf-8"),
            method=request.method,
            target=request.target,
            body=request.body,
            headers=SignedHeaders(
                signature=request.header_values("rebuno-signature"),
                timestamp=request.header_values("rebuno-timestamp"),
                dispatch_id=request.header_values("rebuno-dispatch-id"),
                attempt=request.header_values("rebuno-dispatch-attempt"),
            ),
            now=self.kernel.clock(),
            allow_body_form=self.allow_body_form,
        )
        if check is not RequestCheck.OK:
            raise _Fail(ErrorCode.UNAUTHORIZED, check.value)
        return _Caller(agent_id=agent.id)

    # -- open ----------------------------------------------------------------------------------

    @_route("GET", "/v0/health", "open")
    async def health(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        return _ok(b'{"status":"ok"}')

    @_route("GET", "/metrics", "open")
    async def metrics(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        body = self.kernel.metrics.exposition()
        return Response(200, body, (("content-type", METRICS_CONTENT_TYPE),))

    @_route("GET", "/v0/ready", "open")
    async def ready(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        with anyio.move_on_after(2.0):
            try:
                await self.kernel.read(lambda tx: tx.next_dispatch_at())
            except Exception:
                return Response(503, b'{"status":"unavailable"}', _JSON)
            return _ok(b'{"status":"ready"}')
        return Response(503, b'{"status":"unavailable"}', _JSON)

    # -- executions: reads (dual) --------------------------------------------------------------

    @_route("GET", "/v0/executions/{id}", "dual")
    async def get_execution(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        found = await self.kernel.execution(_execution_id(params[0]), caller.agent_id)
        _reply(found)
        assert not isinstance(found, Refusal)
        return _ok(encode_execution(found))

    @_route("GET", "/v0/executions/{id}/previous", "dual")
    async def previous(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        state = await self.kernel.previous(_execution_id(params[0]), caller.agent_id)
        _reply(state)
        assert isinstance(state, str)
        return _ok(dumps({"state": RawJSON(state)}).encode("utf-8"))

    @_route("GET", "/v0/executions/{id}/steps", "dual")
    async def list_steps(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        execution_id = _execution_id(params[0])
        status = request.query_params().get("status", "")
        if status not in ("", "terminal"):
            raise _Fail(
                ErrorCode.VALIDATION_ERROR, f"status must be 'terminal' or empty, got {status!r}"
            )
        found = await self.kernel.execution(execution_id, caller.agent_id)
        _reply(found)
        steps = await self.kernel.read(
            lambda tx: tx.steps(execution_id, terminal_only=bool(status))
        )
        return _ok(dumps([step_fields(s) for s in steps]).encode("utf-8"))

    @_route("GET", "/v0/executions/{id}/steps/{step_id}", "dual")
    async def get_step(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        execution_id, step_id = _execution_id(params[0]), _step_id(params[1])
        found = await self.kernel.execution(execution_id, caller.agent_id)
        _reply(found)
        step = await self.kernel.read(lambda tx: tx.step(step_id))
        if step is None or step.execution_id != execution_id:
            raise _Fail(ErrorCode.NOT_FOUND, "step not found")
        return _ok(encode_step(step))

    @_route("GET", "/v0/executions/{id}/events", "dual")
    async def events(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        execution_id = _execution_id(params[0])
        query = request.query_params()
        limit = _events_limit(query.get("limit", ""))
        after = _int_param(query, "after_seq", 0, low=0, high=2**62)
        wait_s = _int_param(query, "wait", 0, low=0, high=30)
        if caller.agent_id is not None:
            _reply(await self.kernel.execution(execution_id, caller.agent_id))
        found = await self.kernel.events(execution_id, after_seq=after, limit=limit, wait_s=wait_s)
        _reply(found)
        assert isinstance(found, list)
        return _ok(dumps([event_fields(e) for e in found]).encode("utf-8"))

    # -- executions: client commands (bearer) --------------------------------------------------

    @_route("POST", "/v0/executions", "bearer")
    async def create(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        created = await self.kernel.create(parse_create_execution(request.body))
        _reply(created)
        assert not isinstance(created, Refusal)
        return _ok(encode_execution(created.execution), 201 if created.is_new else 200)

    @_route("GET", "/v0/executions", "bearer")
    async def list_executions(
        self, request: Request, caller: _Caller, params: list[str]
    ) -> Response:
        query = request.query_params()
        status = query.get("status", "")
        if status and status not in _STATUSES:
            raise _Fail(ErrorCode.VALIDATION_ERROR, f"unknown status {status!r}")
        cursor = query.get("cursor", "")
        if cursor:
            cursor = _execution_id(cursor)
        limit = _int_param(query, "limit", 50, low=1, high=200)
        agent_id = query.get("agent_id", "")
        page = await self.kernel.read(
            lambda tx: tx.executions(
                agent_id=agent_id, status=status, before_id=cursor, limit=limit
            )
        )
        body: dict[str, object] = {"executions": [execution_fields(e) for e in page]}
        if len(page) == limit:
            body["next_cursor"] = page[-1].id
        return _ok(dumps(body).encode("utf-8"))  # type: ignore[arg-type]

    @_route("POST", "/v0/executions/{id}/cancel", "bearer")
    async def cancel(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        _reply(await self.kernel.cancel(_execution_id(params[0])))
        return _no_content()

    # -- executions: agent commands (hmac + lease) ---------------------------------------------

    def _agent_id(self, caller: _Caller) -> str:
        assert caller.agent_id is not None
        return caller.agent_id

    @_route("POST", "/v0/executions/{id}/steps", "hmac")
    async def submit(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        execution_id, lease = _execution_id(params[0]), _lease(request)
        submission = parse_step_submission(request.body)
        decision = await self.kernel.submit(execution_id, self._agent_id(caller), lease, submission)
        _reply(decision)
        assert not isinstance(decision, Refusal)
        return _ok(encode_decision(decision))

    async def _finish_step(
        self, request: Request, caller: _Caller, params: list[str], *, failed: bool
    ) -> Response:
        execution_id, step_id, lease = (
            _execution_id(params[0]),
            _step_id(params[1]),
            _lease(request),
        )
        if failed:
            outcome = await self.kernel.finish_step(
                execution_id,
                step_id,
                self._agent_id(caller),
                lease,
                error=parse_step_failure(request.body).error,
            )
        else:
            outcome = await self.kernel.finish_step(
                execution_id,
                step_id,
                self._agent_id(caller),
                lease,
                result=parse_step_completion(request.body).result,
            )
        _reply(outcome)
        assert not isinstance(outcome, Refusal)
        return _ok(encode_decision(outcome))

    @_route("POST", "/v0/executions/{id}/steps/{step_id}/complete", "hmac")
    async def complete_step(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        return await self._finish_step(request, caller, params, failed=False)

    @_route("POST", "/v0/executions/{id}/steps/{step_id}/fail", "hmac")
    async def fail_step(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        return await self._finish_step(request, caller, params, failed=True)

    @_route("POST", "/v0/executions/{id}/steps/{step_id}/stream", "hmac")
    async def stream_delta(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        # Live deltas are best effort and never persisted (PROTOCOL.md §4.6); this
        # kernel validates and drops them: the recorded step result is the truth.
        execution_id, _, lease = _execution_id(params[0]), _step_id(params[1]), _lease(request)
        parse_stream_delta(request.body)
        refusal = await self.kernel.check_lease(execution_id, self._agent_id(caller), lease)
        _reply(refusal)
        return _no_content()

    @_route("POST", "/v0/executions/{id}/heartbeat", "hmac")
    async def heartbeat(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        execution_id, lease = _execution_id(params[0]), _lease(request)
        _reply(await self.kernel.heartbeat(execution_id, self._agent_id(caller), lease))
        return _no_content()

    @_route("POST", "/v0/executions/{id}/complete", "hmac")
    async def complete(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        execution_id, lease = _execution_id(params[0]), _lease(request)
        ending = parse_execution_completion(request.body)
        _reply(await self.kernel.end(execution_id, self._agent_id(caller), lease, ending))
        return _no_content()

    @_route("POST", "/v0/executions/{id}/fail", "hmac")
    async def fail(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        execution_id, lease = _execution_id(params[0]), _lease(request)
        ending = parse_execution_failure(request.body)
        _reply(await self.kernel.end(execution_id, self._agent_id(caller), lease, ending))
        return _no_content()

    @_route("PUT", "/v0/agents/{agent_id}/metadata", "hmac")
    async def metadata(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        if params[0] != caller.agent_id:
            raise _Fail(ErrorCode.FORBIDDEN, "an agent may only describe itself")
        meta = parse_agent_metadata(request.body)
        updated = await self.kernel.update_agent(
            params[0],
            description=meta.description,
            input_schema=meta.input_schema,
            output_schema=meta.output_schema,
        )
        if updated is None:
            raise _Fail(ErrorCode.NOT_FOUND, "agent not found")
        return _no_content()

    # -- approvals (bearer) --------------------------------------------------------------------

    @_route("GET", "/v0/approvals", "bearer")
    async def list_approvals(
        self, request: Request, caller: _Caller, params: list[str]
    ) -> Response:
        query = request.query_params()
        status = query.get("status", "") or "pending"
        if status == "all":
            status = ""
        elif status not in _APPROVAL_STATUSES:
            raise _Fail(ErrorCode.VALIDATION_ERROR, f"unknown approval status {status!r}")
        limit = _int_param(query, "limit", 100, low=1, high=1000)
        found = await self.kernel.read(lambda tx: tx.approvals(status=status, limit=limit))
        return _ok(dumps([approval_fields(a) for a in found]).encode("utf-8"))

    def _approval_id(self, text: str) -> str:
        value = canonical_uuid(text)
        if value is None:
            raise _Fail(ErrorCode.VALIDATION_ERROR, f"invalid approval id {text!r}: must be a UUID")
        return value

    @_route("GET", "/v0/approvals/{id}", "bearer")
    async def get_approval(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        approval_id = self._approval_id(params[0])
        found = await self.kernel.read(lambda tx: tx.approval(approval_id))
        if found is None:
            raise _Fail(ErrorCode.NOT_FOUND, "approval not found")
        return _ok(encode_approval(found))

    async def _decide(
        self, request: Request, caller: _Caller, params: list[str], choice: ApprovalChoice
    ) -> Response:
        approval_id = self._approval_id(params[0])
        decision = parse_approval_decision(request.body)
        decided_by = decision.decided_by
        if caller.principal:
            # Named principals: the decider is who authenticated, not what was typed.
            if decided_by and decided_by != caller.principal:
                raise _Fail(
                    ErrorCode.FORBIDDEN,
                    f"decided_by {decided_by!r} does not match the authenticated principal",
                )
            decided_by = caller.principal
        _reply(
            await self.kernel.decide_approval(
                approval_id, choice, decided_by=decided_by, rationale=decision.rationale
            )
        )
        return _no_content()

    @_route("POST", "/v0/approvals/{id}/grant", "bearer")
    async def grant(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        return await self._decide(request, caller, params, ApprovalChoice.GRANT)

    @_route("POST", "/v0/approvals/{id}/deny", "bearer")
    async def deny(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        return await self._decide(request, caller, params, ApprovalChoice.DENY)

    # -- agents and policies (bearer, admin) ---------------------------------------------------

    @_route("POST", "/v0/agents", "bearer")
    async def register_agent(
        self, request: Request, caller: _Caller, params: list[str]
    ) -> Response:
        reg = parse_agent_registration(request.body)
        problem = webhook_url_problem(reg.webhook_url)
        if problem is not None:
            raise _Fail(ErrorCode.VALIDATION_ERROR, f"webhook_url: {problem}")
        # One transaction: a metadata or policy write racing a re-registration
        # must not be lost (a lost policy would let the agent run unchecked).
        agent = await self.kernel.register_agent(
            reg.id, webhook_url=reg.webhook_url, secret=reg.secret
        )
        return _ok(encode_agent(agent), 201)

    @_route("GET", "/v0/agents", "bearer")
    async def list_agents(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        agents = await self.kernel.read(lambda tx: tx.agents())
        return _ok(dumps([agent_fields(a) for a in agents]).encode("utf-8"))

    @_route("GET", "/v0/agents/{agent_id}", "bearer")
    async def get_agent(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        agent = await self.kernel.agent(params[0])
        if agent is None:
            raise _Fail(ErrorCode.NOT_FOUND, "agent not found")
        return _ok(encode_agent(agent))

    @_route("DELETE", "/v0/agents/{agent_id}", "bearer")
    async def delete_agent(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        if not await self.kernel.delete_agent(params[0]):
            raise _Fail(ErrorCode.NOT_FOUND, "agent not found")
        return _no_content()

    @_route("POST", "/v0/policies/{agent_id}", "bearer")
    async def load_policy(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        too_big = f"bundle exceeds {MAX_BUNDLE_BYTES} bytes"
        if len(request.body) > _MAX_POLICY_BODY:
            raise _Fail(ErrorCode.VALIDATION_ERROR, too_big)
        upload = parse_policy_upload(request.body)
        if len(upload.bundle.encode("utf-8", "surrogatepass")) > MAX_BUNDLE_BYTES:
            raise _Fail(ErrorCode.VALIDATION_ERROR, too_big)
        if self.policy_loader is None:
            raise _Fail(ErrorCode.NOT_IMPLEMENTED, "this kernel does not enforce policy bundles")
        try:
            # In a worker thread: checking a bundle is CPU work that would stall
            # every other request. Its own limiter: uploads must not take the
            # threads the SQLite store needs.
            await anyio.to_thread.run_sync(
                self.policy_loader, upload.bundle, limiter=self._policy_threads
            )
        except ValueError as err:
            raise _Fail(ErrorCode.VALIDATION_ERROR, f"invalid policy bundle: {err}") from None
        if await self.kernel.update_agent(params[0], policy=upload.bundle) is None:
            raise _Fail(ErrorCode.NOT_FOUND, "agent not found")
        return _no_content()

    @_route("GET", "/v0/policies/{agent_id}", "bearer")
    async def show_policy(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        agent = await self.kernel.agent(params[0])
        if agent is None:
            raise _Fail(ErrorCode.NOT_FOUND, "agent not found")
        return _ok(dumps({"agent_id": agent.id, "bundle": agent.policy}).encode("utf-8"))

    # -- optional features (PROTOCOL.md §4.6): not in this kernel ------------------------------

    async def _optional(self, request: Request, caller: _Caller, params: list[str]) -> Response:
        raise _Fail(
            ErrorCode.NOT_IMPLEMENTED,
            f"{request.method} {request.path} is an optional Rebuno feature "
            "this kernel does not offer",
        )


for _method, _path, _auth in (
    ("POST", "/v0/executions/{id}/suspend", "hmac"),
    ("POST", "/v0/executions/{id}/fork", "bearer"),
    ("GET", "/v0/executions/{id}/stream", "bearer"),
    ("POST", "/v0/executions/{id}/resources", "hmac"),
    ("POST", "/v0/executions/{id}/resources/checkpoints", "hmac"),
    ("POST", "/v0/executions/{id}/resources/{key}/binding", "hmac"),
):
    _route(_method, _path, _auth)(KernelAPI._optional)

"""The kernel's HTTP API, route by route (PROTOCOL.md §2-§8).

The bulk calls `KernelAPI` directly with `Request` objects: the real service on
a memory store, a clock the test moves, no sockets. A few tests go through the
built-in server (`inprocess_kernel`) for what only a socket shows: the 413 on an
oversize body and the raw request target a signature covers. Every test runs
on asyncio and on trio.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import httpx
import httpx2
import pytest
import rebuno.errors as sdk_errors
from kernels import inprocess_kernel

from rebuno_anyio import errors as our_errors
from rebuno_anyio._http import Request
from rebuno_anyio.kernel import Kernel, KernelAPI
from rebuno_anyio.kernel._api import _ROUTES
from rebuno_anyio.policy import compile_bundle_text, policy_hook
from rebuno_anyio.store import MemoryStore
from rebuno_proto import DeliveryResult, DispatchSettings, Lease, sign_request

pytestmark = pytest.mark.anyio

T0 = 1_800_000_000.0
AGENT = "alpha"
OTHER = "beta"
SECRET = "alpha-secret"
SECRETS = {AGENT: SECRET, OTHER: "beta-secret"}
TOKEN = "admin-token"
LEASE_S = 30.0
UNKNOWN = "0192f1a0-0000-7000-8000-00000000dead"
STEP_HEX = "ab" * 32
_DEFAULT: Any = object()

POLICY = """\
default_action: allow
rules:
  - id: hold-wire
    priority: 1
    when: {step_kind: tool_call, target: wire}
    then:
      decision: require_approval
      approval_config: {approvers: [alice, bob], message: "send money?"}
  - id: no-delete
    priority: 2
    when: {target: delete}
    then: {decision: deny, reason: never delete}
"""


# -- harness -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@dataclass
class Reply:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...]

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def content_type(self) -> str | None:
        for name, value in self.headers:
            if name.lower() == "content-type":
                return value
        return None


def assert_error(reply: Reply, status: int, code: str, *needles: str) -> dict[str, Any]:
    """The reply is the error envelope with this status and code, and its
    message mentions every needle."""
    assert reply.status == status, (reply.status, reply.body)
    assert reply.content_type is not None
    assert reply.content_type.startswith("application/json"), reply.content_type
    body = reply.json
    assert isinstance(body, dict)
    assert {"code", "message"} <= set(body) <= {"code", "message", "details"}, body
    assert body["code"] == code, body
    assert isinstance(body["message"], str)
    assert body["message"]
    for needle in needles:
        assert needle in body["message"], (needle, body["message"])
    return body


def ok(reply: Reply, status: int = 200) -> Any:
    assert reply.status == status, (reply.status, reply.body)
    if status == 204:
        assert reply.body == b""
        return None
    assert reply.content_type == "application/json; charset=utf-8"
    return reply.json


def body_bytes(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if body is None:
        return b""
    return json.dumps(body).encode()


class Harness:
    """A kernel service and its API with a hand-moved clock."""

    def __init__(
        self,
        *,
        bearer_token: str | None = None,
        principals: dict[str, str] | None = None,
        allow_body_form: bool = True,
        policy_loader: Any = compile_bundle_text,
    ) -> None:
        self.clock = Clock()
        self.store = MemoryStore()
        self.kernel = Kernel(
            self.store,
            clock=self.clock,
            settings=DispatchSettings(lease_timeout_s=LEASE_S),
            policy=policy_hook(dev_mode=True),
        )
        self.api = KernelAPI(
            self.kernel,
            bearer_token=bearer_token,
            principals=principals,
            allow_body_form=allow_body_form,
            policy_loader=policy_loader,
        )
        self.token = bearer_token

    async def call(
        self,
        method: str,
        target: str,
        body: Any = None,
        headers: Sequence[tuple[str, str]] = (),
        *,
        token: str | None = _DEFAULT,
    ) -> Reply:
        """A bearer call (with the harness token unless `token` says otherwise)."""
        all_headers = [("content-type", "application/json"), *headers]
        bearer = self.token if token is _DEFAULT else token
        if bearer is not None:
            all_headers.append(("authorization", f"Bearer {bearer}"))
        response = await self.api(Request(method, target, tuple(all_headers), body_bytes(body)))
        return Reply(response.status, response.body, response.headers)

    def signed(
        self,
        method: str,
        target: str,
        body: bytes = b"",
        *,
        agent: str = AGENT,
        secret: str | None = None,
        lease: Lease | None = None,
        ts: float | None = None,
    ) -> list[tuple[str, str]]:
        """The v1 signing headers the SDK sends."""
        stamp = int(self.clock() if ts is None else ts)
        headers = [("rebuno-agent-id", agent), ("rebuno-timestamp", str(stamp))]
        if lease is not None:
            headers += [
                ("rebuno-dispatch-id", lease.dispatch_id),
                ("rebuno-dispatch-attempt", str(lease.attempt)),
            ]
        signature = sign_request(
            (secret or SECRETS[agent]).encode(),
            method=method,
            target=target,
            timestamp=stamp,
            body=body,
            dispatch_id=None if lease is None else lease.dispatch_id,
            attempt=None if lease is None else lease.attempt,
        )
        return [*headers, ("rebuno-signature", signature)]

    async def agent_call(
        self,
        method: str,
        target: str,
        body: Any = None,
        *,
        agent: str = AGENT,
        secret: str | None = None,
        lease: Lease | None = None,
        ts: float | None = None,
    ) -> Reply:
        raw = body_bytes(body)
        headers = self.signed(method, target, raw, agent=agent, secret=secret, lease=lease, ts=ts)
        return await self.call(method, target, raw, headers, token=None)

    # -- set-up ------------------------------------------------------------------------

    async def register(self, agent_id: str = AGENT) -> None:
        reply = await self.call(
            "POST",
            "/v0/agents",
            {
                "id": agent_id,
                "webhook_url": "http://127.0.0.1:9/webhook",
                "secret": SECRETS[agent_id],
            },
        )
        ok(reply, 201)

    async def create(
        self, agent_id: str = AGENT, input: Any = None, **fields: Any
    ) -> dict[str, Any]:
        reply = await self.call(
            "POST", "/v0/executions", {"agent_id": agent_id, "input": input, **fields}
        )
        return ok(reply, 201)  # type: ignore[no-any-return]

    async def claim(self, execution_id: str) -> Lease:
        """Claim and acknowledge the execution's dispatch, as the dispatcher would."""
        delivery = await self.kernel.claim(execution_id)
        assert delivery is not None
        await self.kernel.delivered(delivery, DeliveryResult.ACKED)
        return delivery.lease()

    async def running(self, agent_id: str = AGENT, input: Any = None) -> tuple[str, Lease]:
        execution = await self.create(agent_id, input)
        return execution["id"], await self.claim(execution["id"])

    async def submit(
        self,
        execution_id: str,
        lease: Lease,
        target: str = "search",
        args: Any = None,
        *,
        kind: str = "tool_call",
        agent: str = AGENT,
        **extra: Any,
    ) -> Reply:
        body = {"kind": kind, "target": target, "args": args or {"q": target}, **extra}
        return await self.agent_call(
            "POST", f"/v0/executions/{execution_id}/steps", body, lease=lease, agent=agent
        )

    async def proceed(self, execution_id: str, lease: Lease, target: str = "search") -> str:
        decision = ok(await self.submit(execution_id, lease, target))
        assert decision["decision"] == "proceed", decision
        return str(decision["step_id"])

    async def complete_step(
        self, execution_id: str, lease: Lease, step_id: str, result: Any = "ok"
    ) -> Reply:
        return await self.agent_call(
            "POST",
            f"/v0/executions/{execution_id}/steps/{step_id}/complete",
            {"result": result},
            lease=lease,
        )

    async def events(self, execution_id: str, query: str = "limit=1000") -> list[dict[str, Any]]:
        return ok(await self.call("GET", f"/v0/executions/{execution_id}/events?{query}"))  # type: ignore[no-any-return]

    async def snapshot(self, execution_id: str) -> tuple[Any, ...]:
        """Everything the kernel keeps about an execution (for no-side-effect checks)."""

        def read(tx: Any) -> tuple[Any, ...]:
            return (
                tx.execution(execution_id),
                tx.events(execution_id, after_seq=0, limit=10_000),
                tx.steps(execution_id),
            )

        return await self.kernel.read(read)


@pytest.fixture
async def h(anyio_backend: str) -> Harness:
    harness = Harness()
    await harness.register(AGENT)
    await harness.register(OTHER)
    return harness


@pytest.fixture
async def secured(anyio_backend: str) -> Harness:
    harness = Harness(bearer_token=TOKEN, principals={"alice-token": "alice"})
    await harness.register(AGENT)
    await harness.register(OTHER)
    return harness


# -- every route ---------------------------------------------------------------------------

EID = "{eid}"
SID = "{sid}"
AID = "{aid}"

# (method, path template, auth class): the routes this file exercises.
ROUTES: list[tuple[str, str, str]] = [
    ("GET", "/v0/health", "open"),
    ("GET", "/v0/ready", "open"),
    ("GET", "/metrics", "open"),
    ("GET", f"/v0/executions/{EID}", "dual"),
    ("GET", f"/v0/executions/{EID}/previous", "dual"),
    ("GET", f"/v0/executions/{EID}/steps", "dual"),
    ("GET", f"/v0/executions/{EID}/steps/{SID}", "dual"),
    ("GET", f"/v0/executions/{EID}/events", "dual"),
    ("POST", "/v0/executions", "bearer"),
    ("GET", "/v0/executions", "bearer"),
    ("POST", f"/v0/executions/{EID}/cancel", "bearer"),
    ("POST", f"/v0/executions/{EID}/steps", "hmac"),
    ("POST", f"/v0/executions/{EID}/steps/{SID}/complete", "hmac"),
    ("POST", f"/v0/executions/{EID}/steps/{SID}/fail", "hmac"),
    ("POST", f"/v0/executions/{EID}/steps/{SID}/stream", "hmac"),
    ("POST", f"/v0/executions/{EID}/heartbeat", "hmac"),
    ("POST", f"/v0/executions/{EID}/complete", "hmac"),
    ("POST", f"/v0/executions/{EID}/fail", "hmac"),
    ("PUT", f"/v0/agents/{AID}/metadata", "hmac"),
    ("GET", "/v0/approvals", "bearer"),
    ("GET", f"/v0/approvals/{EID}", "bearer"),
    ("POST", f"/v0/approvals/{EID}/grant", "bearer"),
    ("POST", f"/v0/approvals/{EID}/deny", "bearer"),
    ("POST", "/v0/agents", "bearer"),
    ("GET", "/v0/agents", "bearer"),
    ("GET", f"/v0/agents/{AID}", "bearer"),
    ("DELETE", f"/v0/agents/{AID}", "bearer"),
    ("POST", f"/v0/policies/{AID}", "bearer"),
    ("GET", f"/v0/policies/{AID}", "bearer"),
    ("POST", f"/v0/executions/{EID}/suspend", "hmac"),
    ("POST", f"/v0/executions/{EID}/fork", "bearer"),
    ("GET", f"/v0/executions/{EID}/stream", "bearer"),
    ("POST", f"/v0/executions/{EID}/resources", "hmac"),
    ("POST", f"/v0/executions/{EID}/resources/checkpoints", "hmac"),
    ("POST", f"/v0/executions/{EID}/resources/{{key}}/binding", "hmac"),
]
BEARER = [(m, p) for m, p, a in ROUTES if a == "bearer"]
HMAC = [(m, p) for m, p, a in ROUTES if a == "hmac"]
DUAL = [(m, p) for m, p, a in ROUTES if a == "dual"]
OPTIONAL = [
    (m, p)
    for m, p, _ in ROUTES
    if any(w in p for w in ("suspend", "fork", "resources", f"{EID}/stream"))
]


def _shape(path: str) -> tuple[str, ...]:
    return tuple("*" if p.startswith("{") else p for p in path.strip("/").split("/"))


def fill(path: str, eid: str = UNKNOWN, sid: str = STEP_HEX, aid: str = AGENT) -> str:
    return path.replace(EID, eid).replace(SID, sid).replace(AID, aid).replace("{key}", "k")


def test_this_file_covers_every_route_of_the_api() -> None:
    """A route added to the API without a test here fails this test."""
    served = {(r.method, r.pattern, r.auth) for r in _ROUTES}
    tested = {(m, _shape(p), a) for m, p, a in ROUTES}
    assert served == tested


# -- open routes ------------------------------------------------------------------------------


async def test_health_and_ready(h: Harness) -> None:
    assert ok(await h.call("GET", "/v0/health", token=None)) == {"status": "ok"}
    assert ok(await h.call("GET", "/v0/ready", token=None)) == {"status": "ready"}
    head = await h.call("HEAD", "/v0/health", token=None)
    assert head.status == 200


async def test_metrics_count_events_and_requests(secured: Harness) -> None:
    await secured.register()
    execution_id, lease = await secured.running()
    await secured.proceed(execution_id, lease)
    await secured.call("GET", "/v0/nothing")
    reply = await secured.call("GET", "/metrics", token=None)  # open, like health
    assert reply.status == 200
    assert dict(reply.headers)["content-type"].startswith("text/plain")
    text = reply.body.decode()
    assert 'rebuno_events_total{type="execution.created"} 1.0' in text
    assert 'rebuno_events_total{type="step.executing"} 1.0' in text
    assert 'rebuno_http_requests_total{route="unmatched",status="404"} 1.0' in text
    assert 'route="POST /v0/executions/{}/steps",status="200"' in text
    assert 'rebuno_http_request_seconds_count{route="POST /v0/executions/{}/steps"} 1.0' in text
    assert 'rebuno_store_commands_total{outcome="ok"}' in text


async def test_ready_is_503_when_the_store_is_gone(h: Harness) -> None:
    await h.store.close()
    reply = await h.call("GET", "/v0/ready")
    assert reply.status == 503
    assert reply.json == {"status": "unavailable"}


async def test_open_routes_need_no_token(secured: Harness) -> None:
    assert ok(await secured.call("GET", "/v0/health", token=None)) == {"status": "ok"}
    assert ok(await secured.call("GET", "/v0/ready", token=None)) == {"status": "ready"}


async def test_unknown_route_is_404_and_wrong_method_is_405(h: Harness) -> None:
    assert_error(await h.call("GET", "/v0/nothing"), 404, "not_found", "/v0/nothing")
    assert_error(await h.call("GET", "/"), 404, "not_found")
    assert_error(await h.call("GET", "/v1/executions"), 404, "not_found")
    assert_error(await h.call("DELETE", "/v0/executions"), 405, "method_not_allowed", "DELETE")
    assert_error(await h.call("POST", "/v0/health"), 405, "method_not_allowed")
    assert_error(await h.call("PUT", f"/v0/executions/{UNKNOWN}"), 405, "method_not_allowed")
    assert_error(
        await h.call("GET", f"/v0/executions/{UNKNOWN}/heartbeat"), 405, "method_not_allowed"
    )


@pytest.mark.parametrize(("method", "path"), OPTIONAL)
async def test_optional_routes_answer_501_envelope(h: Harness, method: str, path: str) -> None:
    execution_id, lease = await h.running()
    target = fill(path, execution_id)
    if (method, path) in HMAC:
        reply = await h.agent_call(method, target, {}, lease=lease)
    else:
        reply = await h.call(method, target, {})
    assert_error(reply, 501, "not_implemented", "optional")


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "must be a JSON object"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"input": 1}', "agent_id: is required"),
        (b'{"agent_id": 5}', "agent_id: must be a string, got a number"),
        (b'{"agent_id": ""}', "agent_id: must not be empty"),
        (b'{"agent_id": "alpha", "session": 7}', "session: must be a string"),
        (b'{"agent_id": "alpha", "idempotency_key": []}', "idempotency_key: must be a string"),
        (b'{"agent_id": "alpha", "input": NaN}', "not valid JSON"),
    ],
)
async def test_create_refuses_bad_bodies_naming_the_field(
    h: Harness, body: bytes, needle: str
) -> None:
    assert_error(await h.call("POST", "/v0/executions", body), 400, "validation_error", needle)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"webhook_url": "http://a/b", "secret": "s"}, "id: is required"),
        ({"id": 1, "webhook_url": "http://a/b", "secret": "s"}, "id: must be a string"),
        ({"id": "has space", "webhook_url": "http://a/b", "secret": "s"}, "id: must be"),
        ({"id": "x", "webhook_url": "ftp://a/b", "secret": "s"}, "webhook_url: must be an http"),
        (
            {"id": "x", "webhook_url": True, "secret": "s"},
            "webhook_url: must be a string, got a boolean",
        ),
        ({"id": "x", "webhook_url": "http://a/b"}, "secret: is required"),
        ({"id": "x", "webhook_url": "http://a/b", "secret": 5}, "secret: must be a string"),
        # URLs the wire parser lets through but the dispatcher's HTTP client
        # refuses: refused here, not when the webhook is sent.
        ({"id": "x", "webhook_url": "http://h:abc/", "secret": "s"}, "webhook_url: is not a valid"),
        ({"id": "x", "webhook_url": "http://[::1/", "secret": "s"}, "webhook_url: is not a valid"),
        (
            {"id": "x", "webhook_url": "http://xn--zz/", "secret": "s"},
            "webhook_url: is not a valid",
        ),
        (
            {"id": "x", "webhook_url": "http://x\u0000y/", "secret": "s"},
            "webhook_url: must not contain whitespace or control characters",
        ),
        (
            {"id": "x", "webhook_url": "http://x/\u007f", "secret": "s"},
            "webhook_url: must not contain whitespace or control characters",
        ),
        ({"id": "x", "webhook_url": "http://:80/w", "secret": "s"}, "webhook_url: has no host"),
        ({"id": "x", "webhook_url": "http://h:99999/", "secret": "s"}, "webhook_url: port must"),
        ({"id": "x", "webhook_url": "http://h:0/", "secret": "s"}, "webhook_url: port must"),
    ],
)
async def test_register_refuses_bad_bodies_naming_the_field(
    h: Harness, body: Any, needle: str
) -> None:
    assert_error(await h.call("POST", "/v0/agents", body), 400, "validation_error", needle)
    assert_error(await h.call("GET", "/v0/agents/x"), 404, "not_found")


@pytest.mark.parametrize(
    ("suffix", "body", "needle"),
    [
        ("steps", b"{oops", "not valid JSON"),
        ("steps", {"target": "t"}, "kind: is required"),
        ("steps", {"kind": "shell", "target": "t"}, "kind: must be one of"),
        ("steps", {"kind": "tool_call", "target": 5}, "target: must be a string"),
        (
            "steps",
            {"kind": "tool_call", "target": "t", "idempotency": "maybe"},
            "idempotency: must be",
        ),
        ("steps", b'{"kind": "tool_call", "target": "t", "args": Infinity}', "not valid JSON"),
        ("steps/{sid}/complete", b"[", "not valid JSON"),
        ("steps/{sid}/fail", b"17", "must be a JSON object"),
        ("steps/{sid}/stream", {"seq": -1, "data": "x"}, "seq: must be >= 0"),
        ("steps/{sid}/stream", {"seq": "1", "data": "x"}, "seq: must be an integer"),
        ("steps/{sid}/stream", {"seq": 1, "data": 5}, "data: must be a string"),
        ("steps/{sid}/stream", {"seq": 1, "data": "é" * 3501}, "data: must be at most 7000"),
        ("complete", b"{", "not valid JSON"),
        ("fail", {"error": 5}, "error: must be a string"),
    ],
)
async def test_agent_bodies_are_refused_naming_the_field(
    h: Harness, suffix: str, body: Any, needle: str
) -> None:
    execution_id, lease = await h.running()
    step_id = await h.proceed(execution_id, lease)
    before = await h.snapshot(execution_id)
    target = f"/v0/executions/{execution_id}/{suffix.replace('{sid}', step_id)}"
    reply = await h.agent_call("POST", target, body, lease=lease)
    assert_error(reply, 400, "validation_error", needle)
    assert await h.snapshot(execution_id) == before


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"description": 5}, "description: must be a string"),
        ({"input_schema": "x"}, "input_schema: must be a JSON object or null"),
        ({"output_schema": [1]}, "output_schema: must be a JSON object or null"),
        (b"nope", "not valid JSON"),
    ],
)
async def test_metadata_bodies_are_refused_naming_the_field(
    h: Harness, body: Any, needle: str
) -> None:
    reply = await h.agent_call("PUT", f"/v0/agents/{AGENT}/metadata", body)
    assert_error(reply, 400, "validation_error", needle)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"rationale": 5}, "rationale: must be a string"),
        ({"decided_by": ["a"]}, "decided_by: must be a string"),
        (b"{", "not valid JSON"),
    ],
)
async def test_approval_decisions_are_refused_naming_the_field(
    h: Harness, body: Any, needle: str
) -> None:
    approval_id = await blocked_approval(h)
    reply = await h.call("POST", f"/v0/approvals/{approval_id}/grant", body)
    assert_error(reply, 400, "validation_error", needle)
    approval = ok(await h.call("GET", f"/v0/approvals/{approval_id}"))
    assert approval["status"] == "pending"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "bundle: is required"),
        ({"bundle": 5}, "bundle: must be a string"),
        (b"x", "not valid JSON"),
    ],
)
async def test_policy_bodies_are_refused_naming_the_field(
    h: Harness, body: Any, needle: str
) -> None:
    assert_error(
        await h.call("POST", f"/v0/policies/{AGENT}", body), 400, "validation_error", needle
    )


# -- unknown ids and bad ids in paths -----------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [*DUAL, ("POST", f"/v0/executions/{EID}/cancel")])
async def test_unknown_execution_is_404(h: Harness, method: str, path: str) -> None:
    reply = await h.call(method, fill(path))
    assert_error(reply, 404, "not_found", "not found")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        (m, p)
        for m, p in [*DUAL, *HMAC, *BEARER]
        if EID in p and "approvals" not in p and (m, p) not in OPTIONAL
    ],
)
async def test_bad_execution_uuid_in_path_is_400(h: Harness, method: str, path: str) -> None:
    target = fill(path, "not-a-uuid")
    if (method, path) in HMAC:
        reply = await h.agent_call(method, target, {}, lease=Lease(dispatch_id=UNKNOWN, attempt=1))
    else:
        reply = await h.call(method, target, {})
    assert_error(reply, 400, "validation_error", "not-a-uuid", "UUID")


@pytest.mark.parametrize("verb", ["", "/grant", "/deny"])
async def test_bad_approval_uuid_is_400_and_unknown_is_404(h: Harness, verb: str) -> None:
    method = "POST" if verb else "GET"
    assert_error(
        await h.call(method, f"/v0/approvals/xyz{verb}", {}), 400, "validation_error", "xyz"
    )
    assert_error(await h.call(method, f"/v0/approvals/{UNKNOWN}{verb}", {}), 404, "not_found")


async def test_uuid_spellings_are_normalised(h: Harness) -> None:
    execution_id, _ = await h.running()
    for spelling in (
        execution_id.upper(),
        execution_id.replace("-", ""),
        f"urn:uuid:{execution_id}",
    ):
        assert ok(await h.call("GET", f"/v0/executions/{spelling}"))["id"] == execution_id


async def test_unknown_agent_and_policy_are_404(h: Harness) -> None:
    assert_error(await h.call("GET", "/v0/agents/ghost"), 404, "not_found")
    assert_error(await h.call("DELETE", "/v0/agents/ghost"), 404, "not_found")
    assert_error(await h.call("GET", "/v0/policies/ghost"), 404, "not_found")
    assert_error(await h.call("POST", "/v0/policies/ghost", {"bundle": POLICY}), 404, "not_found")
    assert_error(
        await h.call("POST", "/v0/executions", {"agent_id": "ghost"}), 404, "not_found", "ghost"
    )


async def test_unknown_and_malformed_step_ids_are_404(h: Harness) -> None:
    execution_id, _ = await h.running()
    assert_error(
        await h.call("GET", f"/v0/executions/{execution_id}/steps/{STEP_HEX}"), 404, "not_found"
    )
    assert_error(await h.call("GET", f"/v0/executions/{execution_id}/steps/XYZ"), 404, "not_found")


# -- agent signatures --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("skew", "accepted"), [(-301, False), (301, False), (-300, True), (300, True), (0, True)]
)
async def test_v1_timestamp_window_is_300_seconds_inclusive(
    h: Harness, skew: int, accepted: bool
) -> None:
    execution_id, _ = await h.running()
    target = f"/v0/executions/{execution_id}"
    reply = await h.agent_call("GET", target, ts=T0 + skew)
    if accepted:
        assert ok(reply)["id"] == execution_id
    else:
        assert_error(reply, 401, "unauthorized", "300 s")


async def test_signature_failures_are_401(h: Harness) -> None:
    execution_id, lease = await h.running()
    target = f"/v0/executions/{execution_id}"
    assert_error(
        await h.agent_call("GET", target, secret="wrong"), 401, "unauthorized", "does not match"
    )
    assert_error(
        await h.agent_call("GET", target, agent="ghost", secret="x"), 401, "unauthorized", "ghost"
    )
    headers = [p for p in h.signed("GET", target) if p[0] != "rebuno-signature"]
    assert_error(
        await h.call("GET", target, None, headers, token=None), 401, "unauthorized", "missing"
    )
    headers = [
        ("rebuno-timestamp", "soon") if p[0] == "rebuno-timestamp" else p
        for p in h.signed("GET", target)
    ]
    assert_error(
        await h.call("GET", target, None, headers, token=None), 401, "unauthorized", "base-10"
    )
    # A signature covers the path and the body...
    body = {"kind": "tool_call", "target": "t", "args": {}}
    raw = body_bytes(body)
    headers = h.signed("POST", f"/v0/executions/{execution_id}/steps", raw, lease=lease)
    for method, path, sent in (
        ("POST", f"/v0/executions/{execution_id}/steps", raw + b" "),
        ("POST", f"/v0/executions/{execution_id}/heartbeat", raw),
    ):
        assert_error(await h.call(method, path, sent, headers, token=None), 401, "unauthorized")
    # ... and the lease headers.
    tampered = [
        ("rebuno-dispatch-attempt", "2") if p[0] == "rebuno-dispatch-attempt" else p
        for p in headers
    ]
    path = f"/v0/executions/{execution_id}/steps"
    assert_error(await h.call("POST", path, raw, tampered, token=None), 401, "unauthorized")


async def test_signature_is_bound_to_the_raw_target_with_its_query(h: Harness) -> None:
    execution_id, _ = await h.running()
    path = f"/v0/executions/{execution_id}/steps"
    signed_plain = h.signed("GET", path)
    assert ok(await h.call("GET", path, None, signed_plain, token=None)) == []
    assert_error(
        await h.call("GET", path + "?status=terminal", None, signed_plain, token=None),
        401,
        "unauthorized",
    )
    signed_query = h.signed("GET", path + "?status=terminal")
    assert ok(await h.call("GET", path + "?status=terminal", None, signed_query, token=None)) == []
    # Another execution's path: the signature does not carry over.
    other_id, _ = await h.running()
    headers = h.signed("GET", f"/v0/executions/{execution_id}")
    assert_error(
        await h.call("GET", f"/v0/executions/{other_id}", None, headers, token=None),
        401,
        "unauthorized",
    )


@pytest.mark.parametrize(
    "header",
    [
        "rebuno-agent-id",
        "rebuno-signature",
        "rebuno-timestamp",
        "rebuno-dispatch-id",
        "rebuno-dispatch-attempt",
    ],
)
async def test_repeated_rebuno_headers_are_401(h: Harness, header: str) -> None:
    execution_id, lease = await h.running()
    target = f"/v0/executions/{execution_id}/heartbeat"
    headers = h.signed("POST", target, lease=lease)
    value = dict(headers)[header]
    reply = await h.call("POST", target, b"", [*headers, (header, value)], token=None)
    assert_error(reply, 401, "unauthorized")
    # The same request without the repeat is fine.
    assert ok(await h.call("POST", target, b"", headers, token=None), 204) is None


async def test_header_with_a_line_break_is_401(h: Harness) -> None:
    execution_id, _ = await h.running()
    target = f"/v0/executions/{execution_id}"
    headers = [(n, v + "\n" if n == "rebuno-timestamp" else v) for n, v in h.signed("GET", target)]
    assert_error(
        await h.call("GET", target, None, headers, token=None), 401, "unauthorized", "line break"
    )


def body_form(agent: str, body: bytes, lease: Lease | None = None) -> list[tuple[str, str]]:
    """The seeds' body-only signature: sha256= over the body, no timestamp."""
    digest = hmac.new(SECRETS[agent].encode(), body, hashlib.sha256).hexdigest()
    headers = [("rebuno-agent-id", agent), ("rebuno-signature", f"sha256={digest}")]
    if lease is not None:
        headers += [
            ("rebuno-dispatch-id", lease.dispatch_id),
            ("rebuno-dispatch-attempt", str(lease.attempt)),
        ]
    return headers


async def test_body_form_signature_is_accepted_by_default(h: Harness) -> None:
    execution_id, lease = await h.running()
    body = body_bytes({"kind": "tool_call", "target": "search", "args": {"q": 1}})
    reply = await h.call(
        "POST",
        f"/v0/executions/{execution_id}/steps",
        body,
        body_form(AGENT, body, lease),
        token=None,
    )
    assert ok(reply)["decision"] == "proceed"
    bad = body_form(AGENT, body + b" ", lease)
    reply = await h.call("POST", f"/v0/executions/{execution_id}/steps", body, bad, token=None)
    assert_error(reply, 401, "unauthorized", "does not match")


async def test_body_form_signature_is_refused_when_v1_only(anyio_backend: str) -> None:
    strict = Harness(allow_body_form=False)
    await strict.register(AGENT)
    execution_id, lease = await strict.running()
    body = body_bytes({"kind": "tool_call", "target": "search", "args": {"q": 1}})
    before = await strict.snapshot(execution_id)
    reply = await strict.call(
        "POST",
        f"/v0/executions/{execution_id}/steps",
        body,
        body_form(AGENT, body, lease),
        token=None,
    )
    assert_error(reply, 401, "unauthorized", "v1=")
    assert await strict.snapshot(execution_id) == before
    assert ok(await strict.submit(execution_id, lease))["decision"] == "proceed"


@pytest.mark.parametrize("missing", ["rebuno-dispatch-id", "rebuno-dispatch-attempt", "both"])
@pytest.mark.parametrize(
    "suffix", ["steps", "heartbeat", "complete", "fail", "steps/{sid}/complete"]
)
async def test_missing_dispatch_headers_are_400(h: Harness, missing: str, suffix: str) -> None:
    execution_id, lease = await h.running()
    step_id = await h.proceed(execution_id, lease)
    target = f"/v0/executions/{execution_id}/{suffix.replace('{sid}', step_id)}"
    body = body_bytes({"kind": "tool_call", "target": "x", "output": 1, "error": "e", "result": 1})
    stamp = str(int(T0))
    dispatch_id = None if missing in ("rebuno-dispatch-id", "both") else lease.dispatch_id
    attempt = None if missing in ("rebuno-dispatch-attempt", "both") else lease.attempt
    headers = [("rebuno-agent-id", AGENT), ("rebuno-timestamp", stamp)]
    if dispatch_id is not None:
        headers.append(("rebuno-dispatch-id", dispatch_id))
    if attempt is not None:
        headers.append(("rebuno-dispatch-attempt", str(attempt)))
    signature = sign_request(
        SECRET.encode(),
        method="POST",
        target=target,
        timestamp=int(T0),
        body=body,
        dispatch_id=dispatch_id,
        attempt=attempt,
    )
    before = await h.snapshot(execution_id)
    reply = await h.call(
        "POST", target, body, [*headers, ("rebuno-signature", signature)], token=None
    )
    assert_error(reply, 400, "validation_error", "missing", "Rebuno-Dispatch")
    assert await h.snapshot(execution_id) == before


async def test_bad_and_foreign_dispatch_ids_are_400(h: Harness) -> None:
    execution_id, lease = await h.running()
    other_id, other_lease = await h.running()
    before = await h.snapshot(execution_id)
    reply = await h.submit(execution_id, Lease(dispatch_id=UNKNOWN, attempt=1))
    assert_error(reply, 400, "validation_error", "unknown dispatch_id")
    reply = await h.submit(execution_id, other_lease)
    assert_error(reply, 400, "validation_error", "another execution")
    target = f"/v0/executions/{execution_id}/heartbeat"
    for attempt in ("0", "x", "-1", "1.0", "²", "9" * 5000):
        headers = [
            ("rebuno-agent-id", AGENT),
            ("rebuno-timestamp", str(int(T0))),
            ("rebuno-dispatch-id", lease.dispatch_id),
            ("rebuno-dispatch-attempt", attempt),
            (
                "rebuno-signature",
                sign_request(
                    SECRET.encode(),
                    method="POST",
                    target=target,
                    timestamp=int(T0),
                    body=b"",
                    dispatch_id=lease.dispatch_id,
                    attempt=attempt,  # type: ignore[arg-type]  # signed as sent
                ),
            ),
        ]
        reply = await h.call("POST", target, b"", headers, token=None)
        assert_error(reply, 400, "validation_error", "invalid dispatch attempt")
    for dispatch_id in ("nope", "0192f1a0"):
        headers = h.signed("POST", target, lease=Lease(dispatch_id=dispatch_id, attempt=1))
        reply = await h.call("POST", target, b"", headers, token=None)
        assert_error(reply, 400, "validation_error", "invalid dispatch_id")
    assert await h.snapshot(execution_id) == before
    assert other_id != execution_id


# -- leases -----------------------------------------------------------------------------------


async def lapse(h: Harness, execution_id: str) -> None:
    """Let the lease lapse and the reaper re-queue the dispatch."""
    h.clock.now += LEASE_S + 1
    assert await h.kernel.reclaim(execution_id)


async def test_superseded_lease_is_409_with_no_side_effects(h: Harness) -> None:
    execution_id, old = await h.running()
    done = await h.proceed(execution_id, old, "first")
    ok(await h.complete_step(execution_id, old, done, "one"))
    open_step = await h.proceed(execution_id, old, "second")
    await lapse(h, execution_id)
    events = await h.events(execution_id)
    assert events[-1]["type"] == "dispatch.queued"
    assert events[-1]["payload"]["dispatch_id"] == old.dispatch_id

    async def every_mutation(lease: Lease) -> list[Reply]:
        base = f"/v0/executions/{execution_id}"
        return [
            await h.submit(execution_id, lease, "third"),
            await h.submit(execution_id, lease, "first"),
            await h.complete_step(execution_id, lease, open_step, "late"),
            await h.agent_call(
                "POST", f"{base}/steps/{open_step}/fail", {"error": {"message": "x"}}, lease=lease
            ),
            await h.agent_call(
                "POST", f"{base}/steps/{open_step}/stream", {"seq": 0, "data": "x"}, lease=lease
            ),
            await h.agent_call("POST", f"{base}/heartbeat", lease=lease),
            await h.agent_call("POST", f"{base}/complete", {"output": "stale"}, lease=lease),
            await h.agent_call("POST", f"{base}/fail", {"error": "stale"}, lease=lease),
        ]

    # Re-queued, not yet re-claimed: the old attempt is already out.
    before = await h.snapshot(execution_id)
    for reply in await every_mutation(old):
        body = assert_error(reply, 409, "lease_superseded")
        assert body["message"] == "dispatch lease superseded"
    assert await h.snapshot(execution_id) == before

    # Re-claimed as attempt 2: the old attempt stays out, the new one is in.
    new = await h.claim(execution_id)
    assert new == Lease(dispatch_id=old.dispatch_id, attempt=2)
    before = await h.snapshot(execution_id)
    for reply in await every_mutation(old):
        assert_error(reply, 409, "lease_superseded")
    assert await h.snapshot(execution_id) == before
    # No counter moved: the new attempt replays from occurrence 0.
    replay = ok(await h.submit(execution_id, new, "first"))
    assert replay == {"decision": "replay", "step_id": done, "result": "one", "resources": []}
    again = ok(await h.submit(execution_id, new, "second"))
    assert again["decision"] == "proceed"
    assert again["step_id"] == open_step


async def test_heartbeat_renews_the_lease(h: Harness) -> None:
    execution_id, lease = await h.running()
    h.clock.now += LEASE_S - 1
    ok(await h.agent_call("POST", f"/v0/executions/{execution_id}/heartbeat", lease=lease), 204)
    h.clock.now += LEASE_S - 1
    assert not await h.kernel.reclaim(execution_id)  # renewed: not lapsed
    h.clock.now += 2
    assert await h.kernel.reclaim(execution_id)


async def test_another_agents_execution_is_403_with_no_side_effects(h: Harness) -> None:
    execution_id, lease = await h.running(AGENT)
    step_id = await h.proceed(execution_id, lease)
    before = await h.snapshot(execution_id)
    base = f"/v0/executions/{execution_id}"
    for reply in (
        await h.agent_call("GET", base, agent=OTHER),
        await h.agent_call("GET", f"{base}/previous", agent=OTHER),
        await h.agent_call("GET", f"{base}/steps", agent=OTHER),
        await h.agent_call("GET", f"{base}/steps/{step_id}", agent=OTHER),
        await h.agent_call("GET", f"{base}/events", agent=OTHER),
        await h.submit(execution_id, lease, agent=OTHER),
        await h.agent_call(
            "POST", f"{base}/steps/{step_id}/complete", {"result": 1}, agent=OTHER, lease=lease
        ),
        await h.agent_call(
            "POST",
            f"{base}/steps/{step_id}/stream",
            {"seq": 0, "data": ""},
            agent=OTHER,
            lease=lease,
        ),
        await h.agent_call("POST", f"{base}/heartbeat", agent=OTHER, lease=lease),
        await h.agent_call("POST", f"{base}/complete", {"output": 1}, agent=OTHER, lease=lease),
        await h.agent_call("POST", f"{base}/fail", {"error": "x"}, agent=OTHER, lease=lease),
    ):
        assert_error(reply, 403, "forbidden", "another agent")
    assert await h.snapshot(execution_id) == before


async def test_step_of_another_execution_is_404(h: Harness) -> None:
    first, first_lease = await h.running()
    second, second_lease = await h.running()
    step_id = await h.proceed(first, first_lease)
    assert_error(await h.call("GET", f"/v0/executions/{second}/steps/{step_id}"), 404, "not_found")
    assert_error(
        await h.agent_call("GET", f"/v0/executions/{second}/steps/{step_id}"), 404, "not_found"
    )
    before = await h.snapshot(first)
    reply = await h.complete_step(second, second_lease, step_id, "stolen")
    assert_error(reply, 404, "not_found")
    assert await h.snapshot(first) == before
    assert (
        ok(await h.call("GET", f"/v0/executions/{first}/steps/{step_id}"))["status"] == "executing"
    )


async def test_metadata_for_another_agent_is_403_and_for_itself_204(h: Harness) -> None:
    meta = {"description": "d", "input_schema": {"type": "object"}, "output_schema": None}
    assert_error(await h.agent_call("PUT", f"/v0/agents/{OTHER}/metadata", meta), 403, "forbidden")
    assert ok(await h.call("GET", f"/v0/agents/{OTHER}"))["description"] is None
    ok(await h.agent_call("PUT", f"/v0/agents/{AGENT}/metadata", meta), 204)
    agent = ok(await h.call("GET", f"/v0/agents/{AGENT}"))
    assert agent["description"] == "d"
    assert agent["input_schema"] == {"type": "object"}
    assert agent["output_schema"] is None


# -- bearer and dual routes ----------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [*BEARER, *DUAL])
async def test_bearer_routes_need_the_token_when_one_is_set(
    secured: Harness, method: str, path: str
) -> None:
    target = fill(path)
    assert_error(
        await secured.call(method, target, {}, token=None), 401, "unauthorized", "missing bearer"
    )
    assert_error(
        await secured.call(method, target, {}, token="wrong"), 401, "unauthorized", "invalid bearer"
    )
    raw = [("authorization", f"bearer {TOKEN}")]  # exact match only
    assert_error(await secured.call(method, target, {}, raw, token=None), 401, "unauthorized")
    raw = [("authorization", TOKEN)]
    assert_error(await secured.call(method, target, {}, raw, token=None), 401, "unauthorized")
    for token in (TOKEN, "alice-token"):
        reply = await secured.call(method, target, {}, token=token)
        assert reply.status != 401, reply.body


@pytest.mark.parametrize(("method", "path"), [*BEARER, *DUAL])
async def test_bearer_routes_are_open_in_dev_mode(h: Harness, method: str, path: str) -> None:
    reply = await h.call(method, fill(path), {}, token=None)
    assert reply.status != 401, reply.body
    reply = await h.call(method, fill(path), {}, token="anything")
    assert reply.status != 401, reply.body


@pytest.mark.parametrize(("method", "path"), HMAC)
async def test_agent_routes_refuse_bearer_tokens(secured: Harness, method: str, path: str) -> None:
    assert_error(await secured.call(method, fill(path), {}), 401, "unauthorized", "Rebuno-Agent-Id")
    assert_error(await secured.call(method, fill(path), {}, token=None), 401, "unauthorized")


async def test_dual_routes_verify_agents_by_signature_and_others_by_token(secured: Harness) -> None:
    execution_id, _ = await secured.running()
    target = f"/v0/executions/{execution_id}"
    # No agent headers: bearer.
    assert ok(await secured.call("GET", target))["id"] == execution_id
    assert_error(await secured.call("GET", target, token=None), 401, "unauthorized")
    # Agent headers: HMAC, and a valid token does not rescue a bad signature.
    assert ok(await secured.agent_call("GET", target))["id"] == execution_id
    headers = secured.signed("GET", target, secret="wrong")
    assert_error(
        await secured.call("GET", target, None, headers), 401, "unauthorized", "does not match"
    )
    # A signature header alone also means "agent".
    assert_error(
        await secured.call("GET", target, None, [("rebuno-signature", "v1=00")]),
        401,
        "unauthorized",
        "Rebuno-Agent-Id",
    )


async def test_named_principal_decides_as_itself(secured: Harness) -> None:
    approval_id = await blocked_approval(secured)
    reply = await secured.call(
        "POST", f"/v0/approvals/{approval_id}/grant", {"decided_by": "bob"}, token="alice-token"
    )
    assert_error(reply, 403, "forbidden", "principal")
    reply = await secured.call(
        "POST", f"/v0/approvals/{approval_id}/grant", {"rationale": "fine"}, token="alice-token"
    )
    ok(reply, 204)
    approval = ok(await secured.call("GET", f"/v0/approvals/{approval_id}"))
    assert approval["status"] == "granted"
    assert approval["decided_by"] == "alice"
    assert approval["rationale"] == "fine"


# -- executions ---------------------------------------------------------------------------------


async def test_create_get_and_its_events(h: Harness) -> None:
    created = await h.create(AGENT, {"prompt": "hi", "n": 1.50})
    assert created["status"] == "running"
    assert created["agent_id"] == AGENT
    assert created["input"] == {"prompt": "hi", "n": 1.5}
    assert uuid.UUID(created["id"]).version == 7
    fetched = ok(await h.call("GET", f"/v0/executions/{created['id']}"))
    assert fetched == created
    events = await h.events(created["id"])
    assert [e["type"] for e in events] == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
    ]
    assert [e["event_seq"] for e in events] == [1, 2, 3]
    # Agent callers see the same record.
    assert ok(await h.agent_call("GET", f"/v0/executions/{created['id']}")) == created


async def test_create_without_input_and_with_unknown_fields(h: Harness) -> None:
    reply = await h.call(
        "POST", "/v0/executions", {"agent_id": AGENT, "spawned_by": None, "on_behalf_of": "x"}
    )
    created = ok(reply, 201)
    assert created["input"] is None


async def test_session_queues_and_continues(h: Harness) -> None:
    first = await h.create(AGENT, 1, session="chat")
    second = await h.create(AGENT, 2, session="chat")
    assert first["session"] == "chat"
    assert second["status"] == "pending"  # one active execution per session
    assert ok(await h.call("GET", f"/v0/executions/{second['id']}/previous")) == {"state": None}
    lease = await h.claim(first["id"])
    ok(
        await h.agent_call(
            "POST",
            f"/v0/executions/{first['id']}/complete",
            {"output": "o", "state": {"turn": 1}},
            lease=lease,
        ),
        204,
    )
    admitted = ok(await h.call("GET", f"/v0/executions/{second['id']}"))
    assert admitted["status"] == "running"
    assert admitted["parent_execution_id"] == first["id"]
    previous = ok(await h.call("GET", f"/v0/executions/{second['id']}/previous"))
    assert previous == {"state": {"turn": 1}}
    assert ok(await h.agent_call("GET", f"/v0/executions/{second['id']}/previous")) == previous
    # A plain output is the next execution's previous state.
    lease = await h.claim(second["id"])
    ok(
        await h.agent_call(
            "POST", f"/v0/executions/{second['id']}/complete", {"output": [2]}, lease=lease
        ),
        204,
    )
    third = await h.create(AGENT, 3, session="chat")
    assert ok(await h.call("GET", f"/v0/executions/{third['id']}/previous")) == {"state": [2]}


async def test_previous_without_session_is_null_state(h: Harness) -> None:
    execution_id, _ = await h.running()
    reply = await h.call("GET", f"/v0/executions/{execution_id}/previous")
    assert ok(reply) == {"state": None}
    assert reply.body == b'{"state":null}'


async def test_idempotency_key(h: Harness) -> None:
    first = ok(
        await h.call(
            "POST",
            "/v0/executions",
            {"agent_id": AGENT, "input": {"a": 1}, "idempotency_key": "k1"},
        ),
        201,
    )
    again = ok(
        await h.call(
            "POST",
            "/v0/executions",
            {"agent_id": AGENT, "input": {"a": 1}, "idempotency_key": "k1"},
        ),
        200,
    )
    assert again["id"] == first["id"]
    assert again["idempotency_key"] == "k1"
    reply = await h.call(
        "POST", "/v0/executions", {"agent_id": AGENT, "input": {"a": 2}, "idempotency_key": "k1"}
    )
    assert_error(reply, 409, "conflict", "k1")
    # Another key, or no key, is a new execution.
    other = ok(
        await h.call(
            "POST",
            "/v0/executions",
            {"agent_id": AGENT, "input": {"a": 1}, "idempotency_key": "k2"},
        ),
        201,
    )
    assert other["id"] != first["id"]
    page = ok(await h.call("GET", "/v0/executions"))
    assert len(page["executions"]) == 2


async def test_list_pages_newest_first_with_filters(h: Harness) -> None:
    ids = [(await h.create(AGENT if i % 2 else OTHER, i))["id"] for i in range(7)]
    page = ok(await h.call("GET", "/v0/executions"))
    assert [e["id"] for e in page["executions"]] == ids[::-1]
    assert "next_cursor" not in page
    seen: list[str] = []
    cursor = ""
    while True:
        query = "limit=3" + (f"&cursor={cursor}" if cursor else "")
        page = ok(await h.call("GET", f"/v0/executions?{query}"))
        seen += [e["id"] for e in page["executions"]]
        cursor = page.get("next_cursor", "")
        if not cursor:
            break
        assert len(page["executions"]) == 3
    assert seen == ids[::-1]
    mine = ok(await h.call("GET", f"/v0/executions?agent_id={AGENT}"))
    assert [e["id"] for e in mine["executions"]] == ids[1::2][::-1]
    cancelled = ids[2]
    ok(await h.call("POST", f"/v0/executions/{cancelled}/cancel"), 204)
    only = ok(await h.call("GET", "/v0/executions?status=cancelled"))
    assert [e["id"] for e in only["executions"]] == [cancelled]
    both = ok(await h.call("GET", f"/v0/executions?status=running&agent_id={OTHER}"))
    assert [e["id"] for e in both["executions"]] == [ids[6], ids[4], ids[0]]
    assert_error(
        await h.call("GET", "/v0/executions?status=bogus"), 400, "validation_error", "bogus"
    )
    assert_error(await h.call("GET", "/v0/executions?cursor=nope"), 400, "validation_error", "nope")
    assert_error(await h.call("GET", "/v0/executions?limit=lots"), 400, "validation_error", "limit")
    capped = ok(await h.call("GET", "/v0/executions?limit=100000"))
    assert len(capped["executions"]) == 7


async def test_list_limit_default_50_max_200(h: Harness) -> None:
    for i in range(201):
        await h.create(AGENT, i)
    assert len(ok(await h.call("GET", "/v0/executions"))["executions"]) == 50
    page = ok(await h.call("GET", "/v0/executions?limit=500"))
    assert len(page["executions"]) == 200
    assert "next_cursor" in page
    rest = ok(await h.call("GET", f"/v0/executions?limit=200&cursor={page['next_cursor']}"))
    assert len(rest["executions"]) == 1


async def test_events_after_seq_and_limit(h: Harness) -> None:
    execution_id, lease = await h.running()
    for i in range(40):  # 40 * 4 events, plus the first 4
        step_id = await h.proceed(execution_id, lease, f"t{i}")
        ok(await h.complete_step(execution_id, lease, step_id, i))
    total = 4 + 40 * 4
    everything = await h.events(execution_id, "limit=1000")
    assert [e["event_seq"] for e in everything] == list(range(1, total + 1))
    assert len(await h.events(execution_id, "")) == 100
    for garbage in ("limit=abc", "limit=0", "limit=-5", "limit=", "limit=1.5"):
        assert len(await h.events(execution_id, garbage)) == 100, garbage
    assert len(await h.events(execution_id, "limit=7")) == 7
    page = await h.events(execution_id, "after_seq=150&limit=5")
    assert [e["event_seq"] for e in page] == [151, 152, 153, 154, 155]
    assert await h.events(execution_id, f"after_seq={total}") == []
    assert_error(
        await h.call("GET", f"/v0/executions/{execution_id}/events?after_seq=x"),
        400,
        "validation_error",
        "after_seq",
    )
    # Numbers int() cannot read are answered, never a 500.
    assert len(await h.events(execution_id, "limit=%C2%B2")) == 100
    assert len(await h.events(execution_id, "limit=" + "9" * 5000)) == total
    assert len(await h.events(execution_id, "limit=" + "0" * 5000 + "3")) == 3
    assert await h.events(execution_id, "after_seq=" + "9" * 5000) == []
    assert_error(
        await h.call("GET", f"/v0/executions/{execution_id}/events?after_seq=%C2%B2"),
        400,
        "validation_error",
    )
    assert_error(
        await h.call("GET", "/v0/executions?limit=%C2%B2"), 400, "validation_error", "limit"
    )
    assert len(ok(await h.call("GET", "/v0/executions?limit=" + "9" * 5000))["executions"]) == 1
    types = {e["type"] for e in everything}
    assert types == {
        "execution.created",
        "execution.started",
        "dispatch.queued",
        "dispatch.acked",
        "step.proposed",
        "step.allowed",
        "step.executing",
        "step.succeeded",
    }


async def test_events_limit_is_capped_at_1000(h: Harness) -> None:
    execution_id, lease = await h.running()
    for i in range(260):
        step_id = await h.proceed(execution_id, lease, f"t{i}")
        ok(await h.complete_step(execution_id, lease, step_id, i))
    assert len(await h.events(execution_id, "limit=5000")) == 1000
    assert len(await h.events(execution_id, "limit=1000&after_seq=100")) == 4 + 260 * 4 - 100


async def test_events_long_poll_returns_as_soon_as_an_event_arrives(h: Harness) -> None:
    execution_id, _ = await h.running()
    seen = len(await h.events(execution_id))
    got: list[Any] = []

    async def poll() -> None:
        got.append(await h.events(execution_id, f"after_seq={seen}&wait=30"))

    with anyio.fail_after(10):  # far less than the 30 s wait
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            await anyio.wait_all_tasks_blocked()
            assert got == []  # still waiting
            ok(await h.call("POST", f"/v0/executions/{execution_id}/cancel"), 204)
    assert [e["type"] for e in got[0]] == ["execution.cancelled"]
    assert got[0][0]["event_seq"] == seen + 1


async def test_events_long_poll_returns_at_once_when_events_exist_and_empty_after_the_wait(
    h: Harness,
) -> None:
    execution_id, _ = await h.running()
    with anyio.fail_after(5):
        assert len(await h.events(execution_id, "wait=30")) == 4
    start = anyio.current_time()
    assert await h.events(execution_id, "after_seq=4&wait=1") == []
    assert 0.9 <= anyio.current_time() - start < 5


async def test_cancel(h: Harness) -> None:
    execution_id, lease = await h.running()
    step_id = await h.proceed(execution_id, lease)
    reply = await h.call("POST", f"/v0/executions/{execution_id}/cancel")
    ok(reply, 204)
    execution = ok(await h.call("GET", f"/v0/executions/{execution_id}"))
    assert execution["status"] == "cancelled"
    assert execution["failure_reason"] == "client_cancelled"
    types = [e["type"] for e in await h.events(execution_id)]
    assert types[-2:] == ["execution.cancelled", "step.cancelled"]
    step = ok(await h.call("GET", f"/v0/executions/{execution_id}/steps/{step_id}"))
    assert step["status"] == "cancelled"
    before = await h.snapshot(execution_id)
    body = assert_error(
        await h.call("POST", f"/v0/executions/{execution_id}/cancel"), 409, "execution_terminal"
    )
    assert "cancelled" in body["message"]
    assert await h.snapshot(execution_id) == before
    # The agent's calls now meet a terminal execution.
    reply = await h.submit(execution_id, lease, "next")
    assert ok(reply) == {"decision": "execution_terminal", "resources": []}
    reply = await h.agent_call(
        "POST", f"/v0/executions/{execution_id}/complete", {"output": 1}, lease=lease
    )
    assert_error(reply, 409, "execution_terminal")


async def test_steps_list_and_get(h: Harness) -> None:
    execution_id, lease = await h.running()
    done = await h.proceed(execution_id, lease, "done")
    ok(await h.complete_step(execution_id, lease, done, {"rows": [1, 2]}))
    failed = await h.proceed(execution_id, lease, "broken")
    ok(
        await h.agent_call(
            "POST",
            f"/v0/executions/{execution_id}/steps/{failed}/fail",
            {"error": {"message": "boom"}},
            lease=lease,
        )
    )
    running = await h.proceed(execution_id, lease, "running")
    every = ok(await h.call("GET", f"/v0/executions/{execution_id}/steps"))
    assert sorted(s["step_id"] for s in every) == sorted([done, failed, running])
    assert [s["step_id"] for s in every] == sorted(s["step_id"] for s in every)
    terminal = ok(await h.call("GET", f"/v0/executions/{execution_id}/steps?status=terminal"))
    assert sorted(s["step_id"] for s in terminal) == sorted([done, failed])
    assert_error(
        await h.call("GET", f"/v0/executions/{execution_id}/steps?status=open"),
        400,
        "validation_error",
        "open",
    )
    step = ok(await h.call("GET", f"/v0/executions/{execution_id}/steps/{done}"))
    assert step["step_id"] == done
    assert step["execution_id"] == execution_id
    assert step["kind"] == "tool_call"
    assert step["target"] == "done"
    assert step["args"] == {"q": "done"}
    assert step["status"] == "succeeded"
    assert step["result"] == {"rows": [1, 2]}
    assert step["occurrence"] == 0
    assert step["idempotency"] == "safe_to_retry"
    assert len(step["args_hash"]) == 64
    bad = ok(await h.call("GET", f"/v0/executions/{execution_id}/steps/{failed}"))
    assert bad["status"] == "failed"
    assert bad["error"] == {"message": "boom"}
    # Agents read the same through their signature.
    assert ok(await h.agent_call("GET", f"/v0/executions/{execution_id}/steps/{done}")) == step


async def test_step_decisions_through_the_api(h: Harness) -> None:
    execution_id, lease = await h.running()
    first = await h.proceed(execution_id, lease, "same")
    ok(await h.complete_step(execution_id, lease, first, 1))
    second = ok(await h.submit(execution_id, lease, "same"))  # occurrence 1: a new step
    assert second["decision"] == "proceed"
    assert second["step_id"] != first
    # The recorded step answers replay; complete on it again is a replay too.
    again = ok(await h.complete_step(execution_id, lease, first, 2))
    assert again["decision"] == "replay"
    assert ok(await h.call("GET", f"/v0/executions/{execution_id}/steps/{first}"))["result"] == 1
    recorded = ok(await h.complete_step(execution_id, lease, second["step_id"], 2))
    assert recorded == {"decision": "recorded", "resources": []}
    stream = await h.agent_call(
        "POST",
        f"/v0/executions/{execution_id}/steps/{first}/stream",
        {"seq": 0, "data": "partial"},
        lease=lease,
    )
    ok(stream, 204)


async def test_complete_and_fail_execution(h: Harness) -> None:
    execution_id, lease = await h.running()
    ok(
        await h.agent_call(
            "POST",
            f"/v0/executions/{execution_id}/complete",
            {"output": {"answer": 42}},
            lease=lease,
        ),
        204,
    )
    execution = ok(await h.call("GET", f"/v0/executions/{execution_id}"))
    assert execution["status"] == "completed"
    assert execution["output"] == {"answer": 42}
    before = await h.snapshot(execution_id)
    reply = await h.agent_call(
        "POST", f"/v0/executions/{execution_id}/fail", {"error": "late"}, lease=lease
    )
    assert_error(reply, 409, "execution_terminal")
    assert await h.snapshot(execution_id) == before
    failing, lease = await h.running()
    ok(
        await h.agent_call(
            "POST", f"/v0/executions/{failing}/fail", {"error": "tool_error: x: boom"}, lease=lease
        ),
        204,
    )
    failed = ok(await h.call("GET", f"/v0/executions/{failing}"))
    assert failed["status"] == "failed"
    assert failed["failure_reason"] == "tool_error: x: boom"
    assert (await h.events(failing))[-1]["payload"] == {
        "execution_id": failing,
        "status": "failed",
        "reason": "tool_error: x: boom",
    }


# -- agents and policies -------------------------------------------------------------------------


async def test_agents_register_list_get_delete_never_show_the_secret(h: Harness) -> None:
    reply = await h.call(
        "POST",
        "/v0/agents",
        {"id": "gamma", "webhook_url": "https://agents.example/hook", "secret": "topsecret"},
    )
    created = ok(reply, 201)
    assert created["id"] == "gamma"
    assert created["webhook_url"] == "https://agents.example/hook"
    assert created["has_policy"] is False
    listed = ok(await h.call("GET", "/v0/agents"))
    assert [a["id"] for a in listed] == ["alpha", "beta", "gamma"]
    fetched = ok(await h.call("GET", "/v0/agents/gamma"))
    assert fetched == created
    for text in (
        reply.body,
        (await h.call("GET", "/v0/agents")).body,
        (await h.call("GET", "/v0/agents/gamma")).body,
    ):
        assert b"secret" not in text
    # Re-registering updates the URL and the secret, keeps registered_at.
    h.clock.now += 60
    updated = ok(
        await h.call(
            "POST", "/v0/agents", {"id": "gamma", "webhook_url": "http://new/hook", "secret": "s2"}
        ),
        201,
    )
    assert updated["webhook_url"] == "http://new/hook"
    assert updated["registered_at"] == created["registered_at"]
    ok(await h.call("DELETE", "/v0/agents/gamma"), 204)
    assert_error(await h.call("GET", "/v0/agents/gamma"), 404, "not_found")
    assert_error(await h.call("DELETE", "/v0/agents/gamma"), 404, "not_found")
    assert [a["id"] for a in ok(await h.call("GET", "/v0/agents"))] == ["alpha", "beta"]


async def test_deleted_agent_can_no_longer_sign(h: Harness) -> None:
    execution_id, _ = await h.running(OTHER)
    assert ok(await h.agent_call("GET", f"/v0/executions/{execution_id}", agent=OTHER))
    ok(await h.call("DELETE", f"/v0/agents/{OTHER}"), 204)
    assert_error(
        await h.agent_call("GET", f"/v0/executions/{execution_id}", agent=OTHER),
        401,
        "unauthorized",
    )


async def test_policy_load_and_show(h: Harness) -> None:
    assert ok(await h.call("GET", f"/v0/policies/{AGENT}")) == {"agent_id": AGENT, "bundle": None}
    ok(await h.call("POST", f"/v0/policies/{AGENT}", {"bundle": POLICY}), 204)
    assert ok(await h.call("GET", f"/v0/policies/{AGENT}")) == {"agent_id": AGENT, "bundle": POLICY}
    assert ok(await h.call("GET", f"/v0/agents/{AGENT}"))["has_policy"] is True
    # The bundle now decides new steps.
    execution_id, lease = await h.running()
    denied = ok(await h.submit(execution_id, lease, "delete"))
    assert denied["decision"] == "denied"
    assert denied["reason"] == "never delete"
    assert denied["rule_id"] == "no-delete"
    assert ok(await h.submit(execution_id, lease, "search"))["decision"] == "proceed"


@pytest.mark.parametrize(
    ("bundle", "needles"),
    [
        ("rules: [{id: r1, priority: 1, when: {}, then: {decision: maybe}}]", ["r1", "decision"]),
        ("rules: [{id: r2, when: {}, then: {decision: allow}}]", ["r2", "priority"]),
        ("default_action: sometimes", ["default_action"]),
        (
            "rules: [{id: r3, priority: 1, when: {step_kind: shell}, then: {decision: allow}}]",
            ["r3", "step_kind"],
        ),
        (
            "rules: [{id: r4, priority: 1, when: {},"
            " then: {decision: allow, rate_limit: {max_calls: 0, window: 1m}}}]",
            ["r4", "max_calls"],
        ),
        ("{{{", ["YAML"]),
    ],
)
async def test_invalid_policy_is_400_naming_rule_and_field(
    h: Harness, bundle: str, needles: list[str]
) -> None:
    reply = await h.call("POST", f"/v0/policies/{AGENT}", {"bundle": bundle})
    assert_error(reply, 400, "validation_error", "invalid policy bundle", *needles)
    assert ok(await h.call("GET", f"/v0/policies/{AGENT}"))["bundle"] is None


MAX_BUNDLE = 262_144


def padded(size: int, pad: str = "x") -> str:
    """A valid bundle of exactly `size` UTF-8 bytes (a YAML comment pads it)."""
    head = "default_action: allow\n# "
    count = (size - len(head.encode())) // len(pad.encode())
    text = head + pad * count
    text += "x" * (size - len(text.encode()))
    assert len(text.encode()) == size
    return text


async def test_policy_bundles_are_at_most_256_kib(h: Harness) -> None:
    ok(await h.call("POST", f"/v0/policies/{AGENT}", {"bundle": padded(MAX_BUNDLE)}), 204)
    for bundle in (padded(MAX_BUNDLE + 1), padded(MAX_BUNDLE + 1, "€")):  # bytes, not characters
        reply = await h.call("POST", f"/v0/policies/{AGENT}", {"bundle": bundle})
        assert_error(reply, 400, "validation_error", f"bundle exceeds {MAX_BUNDLE} bytes")
    # A body too big to hold an acceptable bundle is refused before it is parsed.
    huge = b'{"bundle": "' + b"x" * (7 * MAX_BUNDLE) + b'"}'
    reply = await h.call("POST", f"/v0/policies/{AGENT}", huge)
    assert_error(reply, 400, "validation_error", f"bundle exceeds {MAX_BUNDLE} bytes")
    # Escapes count as what they stand for: a bundle of control characters
    # (six bytes each in JSON) at the limit is not refused for its size.
    escaped = json.dumps({"bundle": "\x01" * MAX_BUNDLE}).encode()
    assert len(escaped) > 6 * MAX_BUNDLE
    reply = await h.call("POST", f"/v0/policies/{AGENT}", escaped)
    assert_error(reply, 400, "validation_error", "invalid policy bundle")
    assert ok(await h.call("GET", f"/v0/policies/{AGENT}"))["bundle"] == padded(MAX_BUNDLE)


async def test_policy_validation_does_not_block_the_event_loop(anyio_backend: str) -> None:
    """The loader runs in a worker thread: while it works, other requests are
    answered."""
    import threading

    entered = anyio.Event()
    finish = threading.Event()
    token = anyio.lowlevel.current_token()

    loop_thread = threading.get_ident()

    def slow_loader(text: str) -> object:
        # (On the event loop's own thread, waiting below would freeze it.)
        assert threading.get_ident() != loop_thread, "the loader runs on the event loop"
        anyio.from_thread.run_sync(entered.set, token=token)
        assert finish.wait(timeout=10), "the test never let the loader finish"
        return compile_bundle_text(text)

    harness = Harness(policy_loader=slow_loader)
    await harness.register(AGENT)
    replies: list[Reply] = []

    async def upload() -> None:
        replies.append(await harness.call("POST", f"/v0/policies/{AGENT}", {"bundle": POLICY}))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(upload)
            await entered.wait()
            # The loader is still running; the kernel still answers.
            assert ok(await harness.call("GET", "/v0/health")) == {"status": "ok"}
            assert ok(await harness.call("GET", f"/v0/agents/{AGENT}"))["has_policy"] is False
            finish.set()
    ok(replies[0], 204)
    assert ok(await harness.call("GET", f"/v0/policies/{AGENT}"))["bundle"] == POLICY


async def test_policy_without_a_loader_is_501(anyio_backend: str) -> None:
    bare = Harness(policy_loader=None)
    await bare.register(AGENT)
    assert_error(
        await bare.call("POST", f"/v0/policies/{AGENT}", {"bundle": POLICY}), 501, "not_implemented"
    )


# -- approvals -----------------------------------------------------------------------------------


async def blocked_approval(h: Harness, execution: tuple[str, Lease] | None = None) -> str:
    """Load the policy and submit a step that needs approval; return the approval id."""
    ok(await h.call("POST", f"/v0/policies/{AGENT}", {"bundle": POLICY}), 204)
    execution_id, lease = execution or await h.running()
    decision = ok(await h.submit(execution_id, lease, "wire", {"amount": 5}))
    assert decision["decision"] == "blocked"
    return str(decision["approval_id"])


async def test_approvals_list_get_grant(h: Harness) -> None:
    execution_id, lease = await h.running()
    approval_id = await blocked_approval(h, (execution_id, lease))
    assert ok(await h.call("GET", f"/v0/executions/{execution_id}"))["status"] == "blocked"
    pending = ok(await h.call("GET", "/v0/approvals"))
    assert [a["id"] for a in pending] == [approval_id]
    approval = ok(await h.call("GET", f"/v0/approvals/{approval_id}"))
    assert approval["execution_id"] == execution_id
    assert approval["status"] == "pending"
    assert approval["approvers"] == ["alice", "bob"]
    assert approval["message"] == "send money?"
    step = ok(await h.call("GET", f"/v0/executions/{execution_id}/steps/{approval['step_id']}"))
    assert step["status"] == "awaiting_approval"
    reply = await h.call("POST", f"/v0/approvals/{approval_id}/grant", {"decided_by": "mallory"})
    assert_error(reply, 403, "forbidden")
    ok(
        await h.call(
            "POST", f"/v0/approvals/{approval_id}/grant", {"decided_by": "bob", "rationale": "ok"}
        ),
        204,
    )
    assert_error(
        await h.call("POST", f"/v0/approvals/{approval_id}/grant", {"decided_by": "bob"}),
        409,
        "conflict",
    )
    assert_error(
        await h.call("POST", f"/v0/approvals/{approval_id}/deny", {"decided_by": "bob"}),
        409,
        "conflict",
    )
    granted = ok(await h.call("GET", f"/v0/approvals/{approval_id}"))
    assert granted["status"] == "granted"
    assert granted["decided_by"] == "bob"
    assert ok(await h.call("GET", "/v0/approvals")) == []
    assert [a["id"] for a in ok(await h.call("GET", "/v0/approvals?status=granted"))] == [
        approval_id
    ]
    assert [a["id"] for a in ok(await h.call("GET", "/v0/approvals?status=all"))] == [approval_id]
    assert_error(
        await h.call("GET", "/v0/approvals?status=maybe"), 400, "validation_error", "maybe"
    )
    types = [e["type"] for e in await h.events(execution_id)]
    assert types[-4:] == [
        "approval.granted",
        "step.allowed",
        "execution.resumed",
        "dispatch.queued",
    ]
    # The next dispatch's resubmission proceeds.
    lease = await h.claim(execution_id)
    decision = ok(await h.submit(execution_id, lease, "wire", {"amount": 5}))
    assert decision["decision"] == "proceed"
    assert decision["step_id"] == approval["step_id"]


async def test_approvals_deny(h: Harness) -> None:
    execution_id, lease = await h.running()
    approval_id = await blocked_approval(h, (execution_id, lease))
    reply = await h.call("POST", f"/v0/approvals/{approval_id}/deny", {"rationale": "x"})
    assert_error(reply, 403, "forbidden", "alice, bob")  # approvers are named: say who decides
    ok(
        await h.call(
            "POST",
            f"/v0/approvals/{approval_id}/deny",
            {"decided_by": "alice", "rationale": "too_much"},
        ),
        204,
    )
    denied = ok(await h.call("GET", f"/v0/approvals/{approval_id}"))
    assert denied["status"] == "denied"
    assert [a["id"] for a in ok(await h.call("GET", "/v0/approvals?status=denied"))] == [
        approval_id
    ]
    lease = await h.claim(execution_id)
    decision = ok(await h.submit(execution_id, lease, "wire", {"amount": 5}))
    assert decision["decision"] == "denied"
    assert decision["reason"] == "too_much"


# -- the published SDK's reading of our errors ---------------------------------------------------


async def error_replies(h: Harness) -> dict[str, Reply]:
    """One real reply of the API for each error code it uses."""
    execution_id, lease = await h.running()
    await lapse(h, execution_id)
    done, done_lease = await h.running()
    ok(
        await h.agent_call(
            "POST", f"/v0/executions/{done}/complete", {"output": 1}, lease=done_lease
        ),
        204,
    )
    return {
        "validation_error": await h.call("POST", "/v0/executions", b"{"),
        "unauthorized": await h.agent_call("GET", f"/v0/executions/{execution_id}", secret="x"),
        "forbidden": await h.agent_call("GET", f"/v0/executions/{execution_id}", agent=OTHER),
        "not_found": await h.call("GET", f"/v0/executions/{UNKNOWN}"),
        "conflict": await h.call(
            "POST", "/v0/executions", {"agent_id": AGENT, "input": 1, "idempotency_key": "a"}
        )
        and await h.call(
            "POST", "/v0/executions", {"agent_id": AGENT, "input": 2, "idempotency_key": "a"}
        ),
        "execution_terminal": await h.call("POST", f"/v0/executions/{done}/cancel"),
        "lease_superseded": await h.agent_call(
            "POST", f"/v0/executions/{execution_id}/heartbeat", lease=lease
        ),
        "method_not_allowed": await h.call("DELETE", "/v0/executions"),
        "not_implemented": await h.call("POST", f"/v0/executions/{execution_id}/fork", {}),
    }


SDK_CLASSES = {
    "validation_error": sdk_errors.ValidationError,
    "unauthorized": sdk_errors.UnauthorizedError,
    "forbidden": sdk_errors.ForbiddenError,
    "not_found": sdk_errors.NotFoundError,
    "conflict": sdk_errors.ConflictError,
    "execution_terminal": sdk_errors.Terminated,
    "lease_superseded": sdk_errors.LeaseSuperseded,
    "method_not_allowed": sdk_errors.APIError,
    "not_implemented": sdk_errors.APIError,
}
OUR_CLASSES = {
    "validation_error": our_errors.ValidationError,
    "unauthorized": our_errors.UnauthorizedError,
    "forbidden": our_errors.ForbiddenError,
    "not_found": our_errors.NotFoundError,
    "conflict": our_errors.ConflictError,
    "execution_terminal": our_errors.Terminated,
    "lease_superseded": our_errors.LeaseSuperseded,
    "method_not_allowed": our_errors.APIError,
    "not_implemented": our_errors.APIError,
}


async def test_published_sdk_maps_every_error_envelope_to_its_class(h: Harness) -> None:
    replies = await error_replies(h)
    assert set(replies) == set(SDK_CLASSES)
    for code, reply in replies.items():
        body = assert_error(reply, reply.status, code)
        response = httpx2.Response(reply.status, headers=list(reply.headers), content=reply.body)
        error = sdk_errors.error_from_response(response)
        assert type(error) is SDK_CLASSES[code], (code, error)
        if isinstance(error, sdk_errors.APIError):
            assert error.code == code
            assert error.status_code == reply.status
        assert body["message"] in str(error)
        ours = our_errors.error_from_body(reply.status, body, reply.body.decode())
        assert type(ours) is OUR_CLASSES[code], (code, ours)


# -- through the built-in server -----------------------------------------------------------------


async def test_oversize_body_is_413_through_the_real_server(anyio_backend: str) -> None:
    async with inprocess_kernel() as kernel:
        port = int(kernel.url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=kernel.url, timeout=30) as client:
            big = b'{"agent_id": "x", "input": "' + b"a" * (10 * 1024 * 1024) + b'"}'
            reply = await client.post(
                "/v0/executions", content=big, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 413
            assert reply.headers["content-type"].startswith("application/json")
            assert reply.json()["code"] == "validation_error"
            assert "exceeds" in reply.json()["message"]
            # Declared too large: refused before a byte of the body is sent.
            with anyio.fail_after(10):
                stream = await anyio.connect_tcp("127.0.0.1", port)
                async with stream:
                    await stream.send(
                        b"POST /v0/executions HTTP/1.1\r\nHost: k\r\n"
                        b"Content-Type: application/json\r\n"
                        b"Content-Length: 10485761\r\n\r\n"
                    )
                    head = b""
                    while b"\r\n\r\n" not in head:
                        head += await stream.receive()
            assert head.startswith(b"HTTP/1.1 413 ")
            # Just under the limit is read and parsed (and refused for what it says).
            fits = (
                b'{"agent_id": "'
                + b"a" * 200
                + b'", "pad": "'
                + b"b" * (10 * 1024 * 1024 - 300)
                + b'"}'
            )
            assert len(fits) <= 10 * 1024 * 1024
            reply = await client.post("/v0/executions", content=fits)
            assert reply.status_code == 400
            assert "agent_id" in reply.json()["message"]


async def test_signed_requests_and_errors_through_the_real_server(anyio_backend: str) -> None:
    async with inprocess_kernel() as kernel:
        await kernel.register(AGENT, "http://127.0.0.1:9/webhook", SECRET)
        async with httpx.AsyncClient(base_url=kernel.url, timeout=10) as client:
            created = (await client.post("/v0/executions", json={"agent_id": AGENT})).json()
            # A percent-encoded path and a query: the signature covers the raw target.
            target = f"/v0/executions/{created['id'].replace('-', '%2D', 1)}/steps?status=terminal"
            stamp = int(kernel.running.kernel.clock())
            signature = sign_request(
                SECRET.encode(), method="GET", target=target, timestamp=stamp, body=b""
            )
            headers = {
                "Rebuno-Agent-Id": AGENT,
                "Rebuno-Timestamp": str(stamp),
                "Rebuno-Signature": signature,
            }
            reply = await client.get(target, headers=headers)
            assert reply.status_code == 200, reply.text
            assert reply.json() == []
            decoded = target.replace("%2D", "-")
            reply = await client.get(decoded, headers=headers)
            assert reply.status_code == 401
            assert reply.headers["content-type"] == "application/json; charset=utf-8"
            reply = await client.request("PATCH", "/v0/executions")
            assert reply.status_code == 405
            assert reply.json()["code"] == "method_not_allowed"


async def test_reregistration_keeps_policy_and_metadata_and_rotates_the_secret(h: Harness) -> None:
    ok(await h.call("POST", f"/v0/policies/{AGENT}", {"bundle": POLICY}), 204)
    meta = {"description": "d", "input_schema": {"type": "object"}, "output_schema": None}
    ok(await h.agent_call("PUT", f"/v0/agents/{AGENT}/metadata", meta), 204)
    execution_id, _ = await h.running()
    target = f"/v0/executions/{execution_id}"
    assert ok(await h.agent_call("GET", target))["id"] == execution_id  # caches the agent
    body = {"id": AGENT, "webhook_url": "http://10.0.0.1/hook", "secret": "rotated"}
    again = ok(await h.call("POST", "/v0/agents", body), 201)
    assert again["has_policy"] is True
    assert again["description"] == "d"
    assert again["input_schema"] == {"type": "object"}
    assert ok(await h.call("GET", f"/v0/policies/{AGENT}"))["bundle"] == POLICY
    # The new secret counts at once, the old one no longer.
    assert_error(await h.agent_call("GET", target), 401, "unauthorized")
    assert ok(await h.agent_call("GET", target, secret="rotated"))["id"] == execution_id


async def test_made_up_agent_ids_do_not_grow_the_kernel(h: Harness) -> None:
    execution_id, _ = await h.running()
    for i in range(50):
        reply = await h.agent_call(
            "GET", f"/v0/executions/{execution_id}", agent=f"x{i}", secret="s"
        )
        assert_error(reply, 401, "unauthorized", f"x{i}")
        reply = await h.call("GET", f"/v0/executions/{UNKNOWN[:-4]}{i:04d}/events?wait=5")
        assert_error(reply, 404, "not_found")
    assert not any(key.startswith("x") for key in h.kernel._agents)
    assert h.kernel._event_waiters == {}


async def test_the_api_routes_under_a_mount_prefix_and_signs_the_full_target(h: Harness) -> None:
    """Mounted under `/kernel` (ASGI root_path), routing ignores the prefix but
    the v1 signature still covers the raw target the agent sent, prefix and all."""
    await h.register()
    execution_id, _ = await h.running()
    target = f"/kernel/v0/executions/{execution_id}"
    headers = (("content-type", "application/json"), *h.signed("GET", target))
    response = await h.api(Request("GET", target, headers, b"", root_path="/kernel"))
    assert response.status == 200, response.body
    assert json.loads(response.body)["id"] == execution_id
    # Signed for the path without the prefix: refused.
    unprefixed = h.signed("GET", f"/v0/executions/{execution_id}")
    response = await h.api(
        Request(
            "GET",
            target,
            (("content-type", "application/json"), *unprefixed),
            b"",
            root_path="/kernel",
        )
    )
    assert response.status == 401

"""Hostile input: whatever arrives, the kernel answers a clear 4xx with the
error envelope, never a 500, and an error changes nothing.

Hypothesis throws generated requests at `KernelAPI` (the real service on a
memory store): random routes and methods, forged or missing credentials, and
bodies that are garbage, almost-JSON, deeply nested, or valid JSON of the
wrong shape -- also correctly signed as the registered agent, so the body
parsers and the lease checks face them, not just the signature check.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rebuno_anyio._http import Request
from rebuno_anyio.kernel import Kernel, KernelAPI
from rebuno_anyio.store import MemoryStore
from rebuno_proto import Agent, CreateExecution, sign_request

TOKEN = "admin-token"
AGENT = "alpha"
SECRET = "alpha-secret"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "kind",
        "target",
        "args",
        "idempotency",
        "result",
        "error",
        "output",
        "state",
        "agent_id",
        "input",
        "session",
        "idempotency_key",
        "id",
        "webhook_url",
        "secret",
        "seq",
        "data",
        "bundle",
        "decided_by",
        "rationale",
        "description",
        "input_schema",
    ]
)
objects = st.dictionaries(fields, json_values, max_size=6)
bodies = st.one_of(
    st.binary(max_size=200),
    objects.map(lambda o: json.dumps(o).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.sampled_from([b"", b"{", b'{"kind":', b"NaN", b'{"args": Infinity}', b"\xff\xfe", b"null"]),
)
segments = st.one_of(
    st.sampled_from(
        [
            "v0",
            "executions",
            "steps",
            "agents",
            "approvals",
            "policies",
            "events",
            "complete",
            "fail",
            "heartbeat",
            "cancel",
            "previous",
            "metadata",
            "grant",
            "deny",
            "stream",
            "suspend",
            "fork",
            "health",
            "ready",
            "%2e%2e",
            "..",
            "",
        ]
    ),
    st.text(alphabet="abcdef0123456789-%/", max_size=40),
    st.uuids().map(str),
)
random_paths = st.lists(segments, min_size=1, max_size=7).map(lambda parts: "/" + "/".join(parts))
ROUTES = [
    ("GET", "/v0/executions/{e}"),
    ("GET", "/v0/executions/{e}/previous"),
    ("GET", "/v0/executions/{e}/steps"),
    ("GET", "/v0/executions/{e}/steps/{s}"),
    ("POST", "/v0/executions/{e}/steps"),
    ("POST", "/v0/executions/{e}/steps/{s}/complete"),
    ("POST", "/v0/executions/{e}/steps/{s}/fail"),
    ("POST", "/v0/executions/{e}/steps/{s}/stream"),
    ("POST", "/v0/executions/{e}/heartbeat"),
    ("POST", "/v0/executions/{e}/complete"),
    ("POST", "/v0/executions/{e}/fail"),
    ("PUT", "/v0/agents/{a}/metadata"),
    ("POST", "/v0/executions"),
    ("GET", "/v0/executions"),
    ("GET", "/v0/executions/{e}/events"),
    ("POST", "/v0/executions/{e}/cancel"),
    ("GET", "/v0/approvals"),
    ("GET", "/v0/approvals/{x}"),
    ("POST", "/v0/approvals/{x}/grant"),
    ("POST", "/v0/approvals/{x}/deny"),
    ("POST", "/v0/agents"),
    ("GET", "/v0/agents/{a}"),
    ("DELETE", "/v0/agents/{a}"),
    ("POST", "/v0/policies/{a}"),
    ("GET", "/v0/policies/{a}"),
]
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
routes = st.one_of(
    st.sampled_from(ROUTES), st.sampled_from(ROUTES), st.tuples(methods, random_paths)
)
# Weighted towards the live execution, where a bug could change state.
ids = st.one_of(st.just("LIVE"), st.just("LIVE"), st.just("LIVE"), st.uuids().map(str), segments)
queries = st.sampled_from(
    [
        "",
        "?limit=-1",
        "?limit=abc",
        "?after_seq=99999999999999999999",
        "?cursor=x",
        "?status=terminal",
        "?wait=1000",
        "?limit=%00",
    ]
)
header_values = st.text(max_size=80).map(
    lambda t: t.encode("utf-8", "surrogateescape").decode("latin-1")
)
auth_modes = st.sampled_from(
    ["none", "bad_bearer", "bearer", "forged_agent", "agent", "agent_lease"]
)


class World:
    """A kernel with one agent and one running execution; its state is snapshotted."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.kernel = Kernel(self.store)
        self.api = KernelAPI(self.kernel, bearer_token=TOKEN)
        self.execution_id = ""
        self.dispatch_id = ""

    async def setup(self) -> None:
        await self.kernel.put_agent(
            Agent(
                id=AGENT, webhook_url="http://127.0.0.1:9/webhook", secret=SECRET, registered_at=0.0
            )
        )
        created = await self.kernel.create(
            CreateExecution(agent_id=AGENT, input="{}", session="", idempotency_key="")
        )
        self.execution_id = created.execution.id  # type: ignore[union-attr]
        delivery = await self.kernel.claim(self.execution_id)
        assert delivery is not None
        self.dispatch_id = delivery.dispatch_id

    async def snapshot(self) -> Any:
        def read(tx: Any) -> Any:
            ex = tx.executions(agent_id="", status="", before_id="", limit=100)
            return (
                ex,
                [tx.events(e.id, after_seq=0, limit=1000) for e in ex],
                [tx.steps(e.id) for e in ex],
                tx.agents(),
                tx.approvals(status="", limit=100),
            )

        return await self.store.run(read)


def _request(
    world: World,
    method: str,
    path: str,
    query: str,
    body: bytes,
    auth: str,
    extra: list[tuple[str, str]],
) -> Request:
    target = path + query
    headers: list[tuple[str, str]] = [("content-type", "application/json")]
    if auth == "bad_bearer":
        headers.append(("authorization", "Bearer nope"))
    elif auth == "bearer":
        headers.append(("authorization", f"Bearer {TOKEN}"))
    elif auth in ("forged_agent", "agent", "agent_lease"):
        ts = int(time.time())
        lease = auth == "agent_lease"
        secret = SECRET.encode() if auth != "forged_agent" else b"wrong"
        signature = sign_request(
            secret,
            method=method,
            target=target,
            timestamp=ts,
            body=body,
            dispatch_id=world.dispatch_id if lease else None,
            attempt=1 if lease else None,
        )
        headers += [
            ("rebuno-agent-id", AGENT),
            ("rebuno-timestamp", str(ts)),
            ("rebuno-signature", signature),
        ]
        if lease:
            headers += [("rebuno-dispatch-id", world.dispatch_id), ("rebuno-dispatch-attempt", "1")]
    headers += [(k.lower(), v) for k, v in extra]
    return Request(method=method, target=target, headers=tuple(headers), body=body)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    route=routes,
    fill=st.tuples(ids, ids, st.sampled_from([AGENT, "beta", "", "%00"])),
    query=queries,
    body=bodies,
    auth=auth_modes,
    extra=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "rebuno-dispatch-id",
                    "rebuno-dispatch-attempt",
                    "rebuno-timestamp",
                    "rebuno-agent-id",
                    "x-junk",
                ]
            ),
            header_values,
        ),
        max_size=2,
    ),
)
def test_hostile_requests_get_a_clear_4xx_and_change_nothing(
    anyio_backend: str,
    route: tuple[str, str],
    fill: tuple[str, str, str],
    query: str,
    body: bytes,
    auth: str,
    extra: list[tuple[str, str]],
) -> None:
    async def main() -> None:
        world = World()
        await world.setup()
        method, template = route
        execution, other, agent = fill
        path = (
            template.replace("{e}", world.execution_id if execution == "LIVE" else execution)
            .replace("{s}", "ab" * 32 if other == "LIVE" else other)
            .replace("{x}", other)
            .replace("{a}", agent)
        )
        before = await world.snapshot()
        with anyio.fail_after(10):
            response = await world.api(_request(world, method, path, query, body, auth, extra))
        assert response.status < 500, (response.status, response.body)
        if response.status >= 400:
            envelope = json.loads(response.body)
            assert isinstance(envelope["code"], str)
            assert envelope["code"]
            assert isinstance(envelope["message"], str)
            assert envelope["message"]
            assert dict(response.headers)["content-type"].startswith("application/json")
            assert await world.snapshot() == before, "an error response changed the kernel's state"

    anyio.run(main, backend=anyio_backend)

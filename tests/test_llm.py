"""LLM calls through `http_client()` / `RebunoTransport` (PROTOCOL.md §9).

Two layers. End to end: the real kernel in-process, agents served in-process,
and a fake OpenAI-compatible provider that counts its requests -- a call is
recorded once, and a re-delivered execution replays it without contacting the
provider. Unit level: a real `ExecutionContext` over a scripted kernel and an
`httpx.MockTransport` provider, for every decision and stream edge.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import anyio
import httpx
import pytest
from kernels import InProcessKernel, inprocess_kernel

import rebuno_anyio
from rebuno_anyio import (
    Agent,
    Blocked,
    LeaseSuperseded,
    PolicyError,
    RateLimited,
    RebunoError,
    RebunoTransport,
    Terminated,
    http_client,
    raise_for_refusal,
)
from rebuno_anyio._http import Request, Response
from rebuno_anyio._server import HttpServer
from rebuno_anyio.agent import _llm
from rebuno_anyio.agent._context import ExecutionContext, activate, deactivate
from rebuno_anyio.agent._kernel_client import KernelClient
from rebuno_anyio.types import Step
from rebuno_proto import ALLOW, Action, Lease, Verdict

pytestmark = pytest.mark.anyio

AGENT_ID = "llm-agent"
SECRET = "test-secret"
CHAT = "/v1/chat/completions"
SSE_EVENTS = 100  # enough for a body over 4096 bytes: replayed in several chunks


def sse_body(n: int) -> str:
    """An OpenAI-style event stream; `n` (the request count) makes each answer unique."""
    events = [
        {"id": f"chatcmpl-{n}", "choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}
        for i in range(SSE_EVENTS)
    ]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


class FakeProvider:
    """An OpenAI-compatible chat completions endpoint that counts its requests.

    Model `broken` answers 500; `stream: true` gets an event stream; anything
    else a completion that names the request count, so a second contact could
    never produce the same content.
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.url = ""

    async def handle(self, request: Request) -> Response:
        if request.path != CHAT:
            return Response(404)
        body = json.loads(request.body)
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        n = len(self.requests)
        if body.get("model") == "broken":
            error = {"error": {"message": "upstream exploded", "request": n}}
            return Response.json(500, json.dumps(error).encode())
        if body.get("stream") is True:
            return Response(200, sse_body(n).encode(), (("content-type", "text/event-stream"),))
        question = body["messages"][-1]["content"]
        completion = {
            "id": f"chatcmpl-{n}",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"answer #{n} to {question}"},
                    "finish_reason": "stop",
                }
            ],
        }
        return Response.json(200, json.dumps(completion).encode())


@asynccontextmanager
async def serving(provider: FakeProvider) -> AsyncIterator[FakeProvider]:
    async with anyio.create_task_group() as tg:
        port = await tg.start(HttpServer(provider.handle).serve)
        provider.url = f"http://127.0.0.1:{port}"
        yield provider
        tg.cancel_scope.cancel()


@asynccontextmanager
async def agent_served(
    k: InProcessKernel, process: Callable[..., Awaitable[Any]], *, agent: Agent | None = None
) -> AsyncIterator[Agent]:
    """Serve an agent and point the kernel's registration at it. Leaving the
    block kills it like a crash: handlers are cancelled, nothing is reported."""
    agent = agent or Agent(AGENT_ID, secret=SECRET, base_url=k.url)
    async with anyio.create_task_group() as tg:
        port = await tg.start(partial(agent.serve, process, host="127.0.0.1", port=0))
        await k.register(agent.agent_id, f"http://127.0.0.1:{port}/webhook", SECRET)
        yield agent
        tg.cancel_scope.cancel()
    # Workaround: `Agent.running()` skips closing its kernel client when `serve()`
    # is cancelled, which would leak a socket; `close()` still does it.
    await agent.close()


async def list_steps(client: rebuno_anyio.Client, execution_id: str) -> list[Step]:
    # The cast works around `Client.list` shadowing `list` in _client.py's annotations.
    return cast("list[Step]", await client.list_steps(execution_id))


# -- end to end: the real kernel ------------------------------------------------------------


async def test_calls_recorded_once_then_replayed_without_the_provider() -> None:
    """A handler makes a plain call, a call the provider fails (500) and a
    streamed call, then its agent dies. The lease lapses, the kernel re-delivers
    to a new agent, and the handler sees identical responses while the provider
    gets no further request."""
    runs: list[dict[str, Any]] = []
    stream_chunks: list[list[int]] = []
    crashed = anyio.Event()

    async def process(question: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": question}]
        async with http_client(base_url=provider.url, timeout=10) as llm:
            ok = await llm.post(CHAT, json={"model": "gpt-test", "messages": messages})
            broken = await llm.post(CHAT, json={"model": "broken", "messages": messages})
            request = {"model": "gpt-test", "messages": messages, "stream": True}
            chunks: list[bytes] = []
            async with llm.stream("POST", CHAT, json=request) as streamed:
                chunks = [chunk async for chunk in streamed.aiter_raw()]
        seen = {
            "answer": ok.json()["choices"][0]["message"]["content"],
            "ok": [ok.status_code, ok.headers["content-type"]],
            "broken": [broken.status_code, broken.headers["content-type"], broken.json()],
            "stream": [
                streamed.status_code,
                streamed.headers["content-type"],
                b"".join(chunks).decode(),
            ],
        }
        runs.append(seen)
        stream_chunks.append([len(chunk) for chunk in chunks])
        if len(runs) == 1:
            crashed.set()
            await anyio.sleep_forever()  # the agent process dies here
        return seen

    with anyio.fail_after(30):
        async with (
            serving(FakeProvider()) as provider,
            inprocess_kernel(lease_timeout_s=1.0, poll_interval_s=0.1) as k,
            rebuno_anyio.Client(k.url) as client,
        ):
            async with agent_served(k, process):
                execution = await client.create(AGENT_ID, {"question": "why?"})
                await crashed.wait()
            assert len(provider.requests) == 3
            async with agent_served(k, process):
                final = await client.wait(execution.id, timeout=20)
            steps = await list_steps(client, execution.id)

    assert final.status == "completed", final.failure_reason
    assert len(provider.requests) == 3  # the second dispatch never reached the provider
    assert len(runs) == 2
    assert runs[1] == runs[0]
    assert final.output == runs[0]
    first = runs[0]
    assert first["answer"] == "answer #1 to why?"
    assert first["ok"] == [200, "application/json; charset=utf-8"]
    assert first["broken"][:2] == [500, "application/json; charset=utf-8"]
    assert first["broken"][2] == {"error": {"message": "upstream exploded", "request": 2}}
    assert first["stream"] == [200, "text/event-stream", sse_body(3)]
    # Live, the stream came as the provider sent it; replayed, in 4096-byte chunks.
    size = len(sse_body(3).encode())
    assert stream_chunks[1] == [4096] * (size // 4096) + [size % 4096]

    assert len(steps) == 3
    assert {(s.kind, s.status, s.idempotency) for s in steps} == {
        ("llm_call", "succeeded", "safe_to_retry")
    }
    by_args = {json.dumps(step.args, sort_keys=True): step for step in steps}
    for request in provider.requests:
        recorded = by_args[json.dumps(request, sort_keys=True)]  # args: the whole body
        assert recorded.target == request["model"]
    broken_step = by_args[json.dumps(provider.requests[1], sort_keys=True)]
    assert broken_step.result == {
        "status": 500,
        "headers": {"content-type": "application/json; charset=utf-8"},
        "body": json.dumps({"error": {"message": "upstream exploded", "request": 2}}),
    }
    stream_step = by_args[json.dumps(provider.requests[2], sort_keys=True)]
    assert stream_step.result == {
        "status": 200,
        "headers": {"content-type": "text/event-stream"},
        "body": sse_body(3),
    }


def deny_model(model: str, reason: str) -> Any:
    """A kernel policy hook that denies LLM calls to one model."""

    def hook(tx: object, execution: object, agent: object, submission: Any, now: float) -> Any:
        if submission.target == model:
            return Verdict(action=Action.DENY, rule_id="no-model", reason=reason), ()
        return ALLOW, ()

    return hook


async def test_policy_denial_reaches_the_handler_as_a_provider_error() -> None:
    """A denied call never reaches the provider; `raise_for_status()` raises
    and the agent, via `raise_for_refusal`, fails the execution as denied."""
    seen: list[Any] = []

    async def process(question: str) -> str:
        async with http_client(base_url=provider.url) as llm:
            response = await llm.post(
                CHAT,
                json={
                    "model": "gpt-forbidden",
                    "messages": [{"role": "user", "content": question}],
                },
            )
        seen.append([response.status_code, response.json()])
        response.raise_for_status()
        return "unreachable"

    with anyio.fail_after(20):
        async with (
            serving(FakeProvider()) as provider,
            inprocess_kernel(policy_hook=deny_model("gpt-forbidden", "model not allowed")) as k,
            rebuno_anyio.Client(k.url) as client,
            agent_served(k, process),
        ):
            execution = await client.create(AGENT_ID, {"question": "hi"})
            final = await client.wait(execution.id, timeout=15)
            steps = await list_steps(client, execution.id)

    assert provider.requests == []
    message = "rebuno_refusal: denied reason=model not allowed"
    assert seen == [[403, {"error": {"type": "rebuno_refusal", "message": message}}]]
    assert final.status == "failed"
    assert final.failure_reason == "policy_denied: model not allowed"
    assert [(s.kind, s.target, s.status) for s in steps] == [
        ("llm_call", "gpt-forbidden", "denied")
    ]


def load_example() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "examples" / "llm.py"
    spec = importlib.util.spec_from_file_location("example_llm", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_example_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(FakeProvider()) as provider, inprocess_kernel() as k:
        monkeypatch.setenv("REBUNO_URL", k.url)
        monkeypatch.setenv("REBUNO_AGENT_SECRET", SECRET)
        monkeypatch.setenv("OPENAI_BASE_URL", provider.url + "/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("LLM_MODEL", "gpt-test")
        example = load_example()
        with anyio.fail_after(20):
            async with (
                rebuno_anyio.Client(k.url) as client,
                agent_served(k, example.process, agent=example.agent),
            ):
                execution = await client.create("llm", {"question": "what is 2+2?"})
                final = await client.wait(execution.id, timeout=15)

    assert final.status == "completed", final.failure_reason
    assert final.output["answer"] == "answer #1 to what is 2+2?"
    assert provider.requests[0]["model"] == "gpt-test"
    assert provider.headers[0]["authorization"] == "Bearer sk-test"


# -- unit level: a scripted kernel under a real ExecutionContext ---------------------------


class ScriptedKernel:
    """Stands in for `KernelClient`: answers every submission with `decision`
    (or raises it) and records what the context sends."""

    def __init__(self, decision: dict[str, Any] | Exception | None = None) -> None:
        self.decision = decision or {"decision": "proceed", "step_id": "step-1"}
        self.submitted: list[dict[str, Any]] = []
        self.completed: list[tuple[str, Any]] = []
        self.failed: list[tuple[str, Any]] = []
        self.deltas: list[tuple[str, int, str]] = []
        self.on_delta: Callable[[], None] = lambda: None

    async def submit_step(
        self,
        execution_id: str,
        lease: Lease,
        *,
        kind: str,
        target: str,
        args: Any,
        idempotency: str,
    ) -> dict[str, Any]:
        self.submitted.append(
            {"kind": kind, "target": target, "args": args, "idempotency": idempotency}
        )
        if isinstance(self.decision, Exception):
            raise self.decision
        return dict(self.decision)

    async def complete_step(
        self, execution_id: str, step_id: str, lease: Lease, *, result: Any
    ) -> None:
        self.completed.append((step_id, result))

    async def fail_step(self, execution_id: str, step_id: str, lease: Lease, *, error: Any) -> None:
        self.failed.append((step_id, error))

    async def stream_delta(
        self, execution_id: str, step_id: str, lease: Lease, *, seq: int, data: str
    ) -> None:
        self.on_delta()
        self.deltas.append((step_id, seq, data))


@contextmanager
def in_execution(kernel: ScriptedKernel) -> Iterator[ExecutionContext]:
    ctx = ExecutionContext(
        kernel=cast(KernelClient, kernel),
        execution_id="exec-1",
        agent_id=AGENT_ID,
        lease=Lease(dispatch_id="dispatch-1", attempt=1),
        input=None,
        on_lease_lost=lambda: None,
    )
    token = activate(ctx)
    try:
        yield ctx
    finally:
        deactivate(token)


class Chunks(httpx.AsyncByteStream):
    """A provider body in chunks. Optionally fails after `fail_after` chunks,
    waits for `gate` before chunk `gate_at`, or pauses `pause_s` before each."""

    def __init__(
        self,
        chunks: list[bytes],
        *,
        fail_after: int | None = None,
        gate: anyio.Event | None = None,
        gate_at: int = 1,
        pause_s: float = 0.0,
    ) -> None:
        self.chunks = chunks
        self.fail_after = fail_after
        self.gate = gate
        self.gate_at = gate_at
        self.pause_s = pause_s
        self.index = 0
        self.closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self.index == self.fail_after:
            raise httpx.ReadError("connection reset mid-body")
        if self.index >= len(self.chunks):
            raise StopAsyncIteration
        if self.gate is not None and self.index == self.gate_at:
            await self.gate.wait()
        if self.pause_s:
            # The provider's pacing between tokens, not a wait for a condition.
            await anyio.sleep(self.pause_s)
        self.index += 1
        return self.chunks[self.index - 1]

    async def aclose(self) -> None:
        self.closed = True


class Provider:
    """An `httpx.MockTransport` provider that counts the requests it gets."""

    def __init__(self, respond: Callable[[httpx.Request], httpx.Response] | None = None) -> None:
        self.requests: list[httpx.Request] = []
        self._respond = respond or (lambda request: httpx.Response(200, json={"ok": True}))
        self.transport = httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self._respond(request)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=RebunoTransport(self.transport), base_url="http://provider.test"
        )


REQUEST = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


async def test_no_execution_context_passes_through() -> None:
    provider = Provider()
    async with provider.client() as llm:
        response = await llm.post(CHAT, json=REQUEST)
    assert response.json() == {"ok": True}
    assert len(provider.requests) == 1


@pytest.mark.parametrize(
    ("method", "content"),
    [
        ("GET", b""),
        ("POST", b""),
        ("POST", b"[1, 2]"),
        ("POST", b'"a string"'),
        ("POST", b"not json"),
        ("POST", b"model=gpt-test&x=1"),
        ("POST", b'{"model": "gpt-test", "temperature": NaN}'),
        ("POST", b"\xff\xfe\x00garbage"),
    ],
)
async def test_body_not_a_json_object_passes_through(method: str, content: bytes) -> None:
    kernel = ScriptedKernel()
    provider = Provider()
    with in_execution(kernel):
        async with provider.client() as llm:
            response = await llm.request(method, "/v1/files", content=content)
    assert response.json() == {"ok": True}
    assert len(provider.requests) == 1
    assert kernel.submitted == []
    assert kernel.completed == []


@pytest.mark.parametrize("status", [200, 400, 429, 500])
async def test_proceed_records_any_status_as_success(status: int) -> None:
    kernel = ScriptedKernel()
    provider = Provider(
        lambda request: httpx.Response(
            status,
            content=b'{"answer": 42}',
            headers={"content-type": "application/json", "x-request-id": "req-1"},
        )
    )
    with in_execution(kernel):
        async with provider.client() as llm:
            response = await llm.post(CHAT, json=REQUEST)
    assert kernel.submitted == [
        {"kind": "llm_call", "target": "gpt-test", "args": REQUEST, "idempotency": "safe_to_retry"}
    ]
    record = {
        "status": status,
        "headers": {"content-type": "application/json"},
        "body": '{"answer": 42}',
    }
    assert kernel.completed == [("step-1", record)]
    assert kernel.failed == []
    # What the caller gets is what a replay would give: the record, rebuilt.
    assert response.status_code == status
    assert response.json() == {"answer": 42}
    assert "x-request-id" not in response.headers


async def test_proceed_without_model_or_content_type() -> None:
    kernel = ScriptedKernel()
    provider = Provider(lambda request: httpx.Response(200, content=b"plain"))
    with in_execution(kernel):
        async with provider.client() as llm:
            await llm.post("/v1/embeddings", json={"input": "x", "model": None})
    assert kernel.submitted[0]["target"] == ""
    assert kernel.completed == [
        (
            "step-1",
            {"status": 200, "headers": {"content-type": "application/json"}, "body": "plain"},
        )
    ]


async def test_declared_charset_survives_record_and_replay() -> None:
    latin = "text/plain; charset=iso-8859-1"
    kernel = ScriptedKernel()
    provider = Provider(
        lambda request: httpx.Response(
            200, content="caf\u00e9".encode("latin-1"), headers={"content-type": latin}
        )
    )
    with in_execution(kernel):
        async with provider.client() as llm:
            live = await llm.post(CHAT, json=REQUEST)
    record = kernel.completed[0][1]
    assert record["body"] == "caf\u00e9"
    with in_execution(ScriptedKernel(replay(record))):
        async with provider.client() as llm:
            replayed = await llm.post(CHAT, json=REQUEST)
    assert live.text == replayed.text == "caf\u00e9"
    assert live.content == replayed.content == b"caf\xe9"


async def test_proceed_body_read_failure_fails_the_step() -> None:
    kernel = ScriptedKernel()
    body = Chunks([b'{"partial": '], fail_after=1)
    provider = Provider(
        lambda request: httpx.Response(
            200, headers={"content-type": "application/json"}, stream=body
        )
    )
    with in_execution(kernel), pytest.raises(httpx.ReadError):
        async with provider.client() as llm:
            await llm.post(CHAT, json=REQUEST)
    assert kernel.completed == []
    assert kernel.failed == [("step-1", {"message": "connection reset mid-body"})]
    assert body.closed


async def test_proceed_without_a_response_is_not_recorded() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    kernel = ScriptedKernel()
    with in_execution(kernel), pytest.raises(httpx.ConnectError):
        async with Provider(refuse).client() as llm:
            await llm.post(CHAT, json=REQUEST)
    assert len(kernel.submitted) == 1
    assert kernel.completed == []
    assert kernel.failed == []  # safe_to_retry: a later attempt runs it again


# -- replay ------------------------------------------------------------------------------------


def replay(result: Any) -> dict[str, Any]:
    return {"decision": "replay", "step_id": "step-1", "result": result}


@pytest.mark.parametrize(
    ("result", "status", "content_type", "body"),
    [
        (
            {"status": 200, "headers": {"content-type": "application/json"}, "body": '{"a": 1}'},
            200,
            "application/json",
            b'{"a": 1}',
        ),
        (
            {
                "status": 503,
                "headers": {
                    "Content-Type": "text/plain; charset=utf-8",
                    "content-encoding": "gzip",
                    "content-length": "999",
                },
                "body": "overloaded \u2713",
            },
            503,
            "text/plain; charset=utf-8",
            "overloaded \u2713".encode(),
        ),
        ({"status": 200, "body": {"k": [1, 2]}}, 200, "application/json", b'{"k": [1, 2]}'),
        ({"status": 201}, 201, "application/json", b""),
        (["not", "a", "dict"], 200, "application/json", b'["not", "a", "dict"]'),
        ("just text", 200, "application/json", b'"just text"'),
    ],
)
async def test_replay_rebuilds_status_content_type_and_body(
    result: Any, status: int, content_type: str, body: bytes
) -> None:
    kernel = ScriptedKernel(replay(result))
    provider = Provider()
    with in_execution(kernel):
        async with provider.client() as llm:
            response = await llm.post(CHAT, json=REQUEST)
    assert provider.requests == []
    assert kernel.completed == []
    assert response.status_code == status
    assert response.headers["content-type"] == content_type
    assert response.content == body
    assert "content-encoding" not in response.headers
    assert set(response.headers) <= {"content-type", "content-length"}


async def test_replay_of_an_event_stream_is_a_stream_in_4096_byte_chunks() -> None:
    text = sse_body(7)
    record = {"status": 200, "headers": {"content-type": "text/event-stream"}, "body": text}
    kernel = ScriptedKernel(replay(record))
    provider = Provider()
    with in_execution(kernel):
        async with provider.client() as llm, llm.stream("POST", CHAT, json=REQUEST) as response:
            assert not response.is_stream_consumed
            chunks = [chunk async for chunk in response.aiter_raw()]
    size = len(text.encode())
    assert [len(c) for c in chunks] == [4096] * (size // 4096) + [size % 4096]
    assert b"".join(chunks).decode() == text
    assert provider.requests == []


@pytest.mark.parametrize(
    "decision",
    [
        {"decision": "replay", "step_id": "step-1", "error": {"message": "provider unreachable"}},
        {"decision": "replay", "step_id": "step-1", "error": {"reason": "provider unreachable"}},
    ],
)
async def test_replayed_error_raises_rebuno_error(decision: dict[str, Any]) -> None:
    provider = Provider()
    with in_execution(ScriptedKernel(decision)), pytest.raises(RebunoError) as caught:
        async with provider.client() as llm:
            await llm.post(CHAT, json=REQUEST)
    assert str(caught.value) == "provider unreachable"
    assert type(caught.value) is RebunoError
    assert provider.requests == []


async def test_unexpected_decision_raises() -> None:
    provider = Provider()
    with in_execution(ScriptedKernel({"decision": "recorded"})), pytest.raises(RebunoError):
        async with provider.client() as llm:
            await llm.post(CHAT, json=REQUEST)
    assert provider.requests == []


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("decision", "status", "message", "error", "reason"),
    [
        (
            {"decision": "blocked", "step_id": "s", "approval_id": "a"},
            403,
            "rebuno_refusal: blocked",
            Blocked,
            None,
        ),
        ({"decision": "execution_blocked"}, 403, "rebuno_refusal: blocked", Blocked, None),
        (
            {"decision": "denied", "step_id": "s", "reason": "model not allowed", "rule_id": "r"},
            403,
            "rebuno_refusal: denied reason=model not allowed",
            PolicyError,
            "model not allowed",
        ),
        (
            {"decision": "denied", "step_id": "s"},
            403,
            "rebuno_refusal: denied reason=policy_denied",
            PolicyError,
            "policy_denied",
        ),
        (
            {"decision": "rate_limited", "reason": "rate_limiter_unavailable"},
            429,
            "rebuno_refusal: rate_limited reason=rate_limiter_unavailable",
            RateLimited,
            "rate_limiter_unavailable",
        ),
        (
            {"decision": "execution_terminal"},
            403,
            "rebuno_refusal: execution_terminal",
            Terminated,
            None,
        ),
        (LeaseSuperseded(), 409, "rebuno_refusal: lease_superseded", LeaseSuperseded, None),
    ],
)
async def test_refusal_becomes_a_provider_error(
    decision: dict[str, Any] | Exception,
    status: int,
    message: str,
    error: type[Exception],
    reason: str | None,
) -> None:
    provider = Provider()
    with in_execution(ScriptedKernel(decision)) as ctx:
        async with provider.client() as llm:
            response = await llm.post(CHAT, json=REQUEST)
    assert provider.requests == []
    assert response.status_code == status
    assert response.json() == {"error": {"type": "rebuno_refusal", "message": message}}
    assert response.headers["x-should-retry"] == "false"
    if error in (Blocked, Terminated):
        assert isinstance(ctx.suspension, error)  # the agent unwinds even if this is swallowed
    assert ctx.is_superseded == (error is LeaseSuperseded)  # the handler is being stopped

    # httpx's own error carries the marker in its reason phrase...
    with pytest.raises(httpx.HTTPStatusError) as status_error:
        response.raise_for_status()
    with pytest.raises(error) as recovered:
        raise_for_refusal(status_error.value)
    # ...and a provider SDK's error (openai, anthropic) carries the body.
    sdk_error = RuntimeError(f"Error code: {status} - {response.json()}")
    with pytest.raises(error) as recovered_from_sdk:
        raise_for_refusal(sdk_error)
    if reason is not None:
        assert getattr(recovered.value, "reason", None) == reason
        assert getattr(recovered_from_sdk.value, "reason", None) == reason


async def test_raise_for_refusal_ignores_real_provider_errors() -> None:
    provider = Provider(lambda request: httpx.Response(403, json={"error": {"message": "bad key"}}))
    with in_execution(ScriptedKernel()):
        async with provider.client() as llm:
            response = await llm.post(CHAT, json=REQUEST)
    with pytest.raises(httpx.HTTPStatusError) as caught:
        response.raise_for_status()
    raise_for_refusal(caught.value)  # returns: not a refusal


async def test_raise_for_refusal_never_fails_reading_a_response_body() -> None:
    """A streamed response nobody read has no `.text` (httpx raises
    `ResponseNotRead`); an arbitrary error's `response` may be anything. Neither
    is a refusal, and neither makes `raise_for_refusal` raise."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b"rebuno_refusal: denied"  # never read, so never seen

    transport = httpx.MockTransport(lambda request: httpx.Response(500, content=chunks()))
    async with (
        httpx.AsyncClient(transport=transport) as http,
        http.stream("GET", "http://provider.test/") as response,
    ):
        with pytest.raises(httpx.HTTPStatusError) as caught:
            response.raise_for_status()
    raise_for_refusal(caught.value)

    class Hostile:
        @property
        def text(self) -> str:
            raise OSError("the body is gone")

    class WithResponse(Exception):
        response = Hostile()

    raise_for_refusal(WithResponse("no marker here"))


async def test_raise_for_refusal_looks_inside_exception_groups() -> None:
    """A refusal raised in a task group's child arrives in an ExceptionGroup
    (nested, or as the cause of a member): it is found all the same."""
    provider_error = RuntimeError("Error code: 403 - rebuno_refusal: denied reason=not here")
    wrapped = ValueError("the framework's own error")
    wrapped.__cause__ = RuntimeError("Error code: 429 - rebuno_refusal: rate_limited")
    with pytest.raises(PolicyError, match="not here"):
        raise_for_refusal(ExceptionGroup("tg", [ExceptionGroup("inner", [provider_error])]))
    with pytest.raises(RateLimited):
        raise_for_refusal(ExceptionGroup("tg", [KeyError("other"), wrapped]))
    with pytest.raises(Blocked):
        raise_for_refusal(BaseExceptionGroup("tg", [RuntimeError("403 - rebuno_refusal: blocked")]))
    raise_for_refusal(ExceptionGroup("tg", [KeyError("a"), ValueError("b")]))


# -- streaming ---------------------------------------------------------------------------------


def sse_response(stream: httpx.AsyncByteStream, status: int = 200) -> httpx.Response:
    return httpx.Response(
        status, headers={"content-type": "text/event-stream; charset=utf-8"}, stream=stream
    )


async def test_stream_passes_through_publishes_deltas_and_records_once() -> None:
    # Non-ASCII text cut into 700-byte chunks, splitting characters across chunks.
    text = "".join(f"data: h\u00e9llo w\u00f6rld \u2713 {i}\n\n" for i in range(400))
    data = text.encode()
    body = Chunks([data[i : i + 700] for i in range(0, len(data), 700)])
    kernel = ScriptedKernel()
    consumed: list[int] = [0]
    consumed_at_delta: list[int] = []
    kernel.on_delta = lambda: consumed_at_delta.append(consumed[0])
    provider = Provider(lambda request: sse_response(body))
    received: list[bytes] = []
    with in_execution(kernel):
        async with provider.client() as llm:
            request = {**REQUEST, "stream": True}
            async with llm.stream("POST", CHAT, json=request) as response:
                assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
                assert kernel.completed == []
                async for chunk in response.aiter_raw():
                    received.append(chunk)
                    consumed[0] += len(chunk)
                assert len(kernel.completed) == 1  # recorded at the end of the body
    assert b"".join(received) == data
    record = {
        "status": 200,
        "headers": {"content-type": "text/event-stream; charset=utf-8"},
        "body": text,
    }
    assert kernel.completed == [("step-1", record)]
    assert kernel.failed == []
    assert body.closed
    seqs = [seq for _, seq, _ in kernel.deltas]
    assert seqs == list(range(len(seqs)))
    assert all(len(delta) <= _llm.DELTA_MAX_CHARS for _, _, delta in kernel.deltas)
    assert "".join(delta for _, _, delta in kernel.deltas) == text
    assert consumed_at_delta[0] < len(data)  # live: published while the body still flowed


async def test_stream_flushes_deltas_by_time() -> None:
    chunks = [b"alpha ", b"beta ", b"gamma ", b"delta "]
    # Each chunk arrives 60 ms after the last: past the 50 ms flush interval.
    body = Chunks(chunks, pause_s=0.06)
    kernel = ScriptedKernel()
    provider = Provider(lambda request: sse_response(body))
    with in_execution(kernel):
        async with provider.client() as llm, llm.stream("POST", CHAT, json=REQUEST) as response:
            await response.aread()
    assert [(seq, data) for _, seq, data in kernel.deltas] == [
        (i, chunk.decode()) for i, chunk in enumerate(chunks)
    ]
    assert kernel.completed[0][1]["body"] == "alpha beta gamma delta "


async def test_stream_chosen_by_the_request_flag_or_the_content_type() -> None:
    kernel = ScriptedKernel()
    provider = Provider(
        lambda request: (
            httpx.Response(200, json={"streamed": "no"})
            if b"stream" in request.content
            else sse_response(Chunks([b"data: x\n\n"]))
        )
    )
    with in_execution(kernel):
        async with provider.client() as llm:
            # stream: true, but the provider answered JSON: teed all the same
            await llm.post(CHAT, json={**REQUEST, "stream": True})
            # no flag, but an event stream came back
            await llm.post(CHAT, json=REQUEST)
    assert [result for _, result in kernel.completed] == [
        {
            "status": 200,
            "headers": {"content-type": "application/json"},
            "body": '{"streamed":"no"}',
        },
        {
            "status": 200,
            "headers": {"content-type": "text/event-stream; charset=utf-8"},
            "body": "data: x\n\n",
        },
    ]


async def test_stream_error_status_is_recorded_whole() -> None:
    kernel = ScriptedKernel()
    provider = Provider(lambda request: httpx.Response(429, json={"error": "slow down"}))
    with in_execution(kernel):
        async with provider.client() as llm:
            response = await llm.post(CHAT, json={**REQUEST, "stream": True})
    assert response.status_code == 429
    assert kernel.deltas == []
    assert kernel.completed == [
        (
            "step-1",
            {
                "status": 429,
                "headers": {"content-type": "application/json"},
                "body": '{"error":"slow down"}',
            },
        )
    ]


# Breaking out of a stream abandons httpx's own async generators (the consumer's
# `aiter_raw`, and the one this transport reads from); trio reports each one.
@pytest.mark.filterwarnings("ignore:Async generator:ResourceWarning")
async def test_stream_closed_early_records_what_arrived_once() -> None:
    body = Chunks([b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"])
    kernel = ScriptedKernel()
    provider = Provider(lambda request: sse_response(body))
    with in_execution(kernel):
        async with provider.client() as llm:
            async with llm.stream("POST", CHAT, json={**REQUEST, "stream": True}) as response:
                async for _ in response.aiter_raw():
                    break
            await response.aclose()  # closing again records nothing more
    assert [result["body"] for _, result in kernel.completed] == ["data: one\n\n"]
    assert "".join(data for _, _, data in kernel.deltas) == "data: one\n\n"
    assert kernel.failed == []
    assert body.closed


async def read_stream(llm: httpx.AsyncClient, request: dict[str, Any]) -> None:
    async with llm.stream("POST", CHAT, json=request) as response:
        await response.aread()


async def test_stream_error_fails_the_step() -> None:
    body = Chunks([b"data: one\n\n", b"data: two\n\n"], fail_after=1)
    kernel = ScriptedKernel()
    provider = Provider(lambda request: sse_response(body))
    with in_execution(kernel):
        async with provider.client() as llm:
            with pytest.raises(httpx.ReadError):
                await read_stream(llm, {**REQUEST, "stream": True})
    assert kernel.completed == []
    assert kernel.failed == [("step-1", {"message": "connection reset mid-body"})]
    assert body.closed


async def test_cancelled_stream_records_nothing() -> None:
    body = Chunks([b"data: one\n\n", b"data: two\n\n"], gate=anyio.Event())
    kernel = ScriptedKernel()
    provider = Provider(lambda request: sse_response(body))
    with in_execution(kernel), anyio.fail_after(5):
        async with provider.client() as llm:
            with anyio.CancelScope() as scope:
                async with llm.stream("POST", CHAT, json={**REQUEST, "stream": True}) as response:
                    async for _ in response.aiter_raw():
                        scope.cancel()  # e.g. the lease was lost mid-stream
    assert scope.cancelled_caught
    assert kernel.completed == []
    assert kernel.failed == []  # the step stays open; a later attempt runs it again
    assert body.closed


# -- http_client -------------------------------------------------------------------------------


async def test_http_client_passes_options_and_wraps_transports() -> None:
    kernel = ScriptedKernel()
    provider, mounted = Provider(), Provider()
    with in_execution(kernel):
        async with http_client(
            base_url="http://provider.test",
            timeout=7,
            transport=provider.transport,
            mounts={"http://other.test": mounted.transport},
            trust_env=False,
        ) as llm:
            assert llm.base_url == httpx.URL("http://provider.test")
            assert llm.timeout == httpx.Timeout(7)
            assert llm.trust_env is False
            await llm.post(CHAT, json=REQUEST)
            await llm.post("http://other.test/v1/chat/completions", json=REQUEST)
    assert len(provider.requests) == 1
    assert len(mounted.requests) == 1
    assert len(kernel.completed) == 2  # both went through the recording transport


async def test_http_client_builds_its_inner_transport() -> None:
    async with http_client(
        http2=False, verify=False, limits=httpx.Limits(max_connections=3)
    ) as llm:
        assert isinstance(llm._transport, RebunoTransport)
        assert isinstance(llm._transport._inner, httpx.AsyncHTTPTransport)
    async with http_client(proxy="http://127.0.0.1:9") as llm:
        assert llm._mounts == {}  # no proxy mount routing around the recording transport
        assert isinstance(llm._transport, RebunoTransport)
    with pytest.raises(TypeError, match="verify"):
        http_client(transport=Provider().transport, verify=False)

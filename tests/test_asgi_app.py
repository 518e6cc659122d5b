"""`asgi_app`: in process through httpx's ASGI transport, by hand-fed ASGI messages,
and under real uvicorn and hypercorn servers on loopback, on both backends."""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import cast

import anyio
import httpx
import hypercorn
import hypercorn.asyncio
import hypercorn.trio
import hypercorn.typing
import pytest
import uvicorn

from rebuno_anyio._http import Request, Response, error_body
from rebuno_asgi import ASGIApp, Message, Scope, asgi_app

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def echo(request: Request) -> Response:
    """Describe the request back as JSON."""
    described = {
        "method": request.method,
        "target": request.target,
        "params": request.query_params(),
        "headers": [list(pair) for pair in request.headers],
        "body": request.body.decode("latin-1"),
        "client": list(request.client) if request.client else None,
    }
    return Response.json(200, json.dumps(described).encode())


def http(app: ASGIApp) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 4567))
    return httpx.AsyncClient(transport=transport, base_url="http://t")


async def call(app: ASGIApp, scope: Scope, inbox: list[Message]) -> list[dict[str, object]]:
    """Run `app` on one scope, feeding it `inbox` and returning what it sent."""
    sent: list[dict[str, object]] = []

    async def receive() -> Message:
        return inbox.pop(0)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def http_scope(**overrides: object) -> dict[str, object]:
    scope: dict[str, object] = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "raw_path": b"/",
        "query_string": b"",
        "headers": [],
        "client": ["127.0.0.1", 5000],
    }
    scope.update(overrides)
    return scope


async def test_round_trip() -> None:
    async with http(asgi_app(echo)) as client:
        got = await client.post("/p", content=b"hello", headers={"X-Thing": "v"})
    assert got.status_code == 200
    assert got.headers["content-type"] == "application/json; charset=utf-8"
    assert got.headers["content-length"] == str(len(got.content))
    described = got.json()
    assert (described["method"], described["target"], described["body"]) == ("POST", "/p", "hello")
    assert ["x-thing", "v"] in described["headers"]
    assert described["client"] == ["10.1.2.3", 4567]


async def test_raw_target_and_header_repeats_are_preserved() -> None:
    target = "/v0/executions/a%2Fb/%7Euser?q=a%20b&q=c%26d&empty="
    async with http(asgi_app(echo)) as client:
        got = await client.get(target, headers=[("X-Tag", "one"), ("X-TAG", "two")])
    described = got.json()
    assert described["target"] == target
    assert described["params"] == {"q": "c&d", "empty": ""}
    assert [pair for pair in described["headers"] if pair[0] == "x-tag"] == [
        ["x-tag", "one"],
        ["x-tag", "two"],
    ]


async def test_target_without_raw_path_is_percent_encoded() -> None:
    scope = http_scope(path="/a b/é", query_string=b"x=%20")
    del scope["raw_path"]
    sent = await call(asgi_app(echo), scope, [{"type": "http.request", "body": b""}])
    body = sent[1]["body"]
    assert isinstance(body, bytes)
    assert json.loads(body)["target"] == "/a%20b/%C3%A9?x=%20"


async def test_root_path_is_passed_on_and_the_target_stays_whole() -> None:
    """Mounted under a prefix (ASGI `root_path`), the request keeps its full raw
    target (signatures cover it) and routes on the path below the prefix."""
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response(200)

    app = asgi_app(handler)
    inbox: list[Message] = [{"type": "http.request", "body": b""}]
    await call(
        app,
        http_scope(path="/agent/webhook", raw_path=b"/agent/webhook?x=1", root_path="/agent"),
        list(inbox),
    )
    await call(
        app,
        http_scope(path="/my agent/hook", raw_path=b"/my%20agent/hook", root_path="/my agent"),
        list(inbox),
    )
    await call(app, http_scope(path="/hook", raw_path=b"/hook"), list(inbox))
    assert [(r.target, r.root_path, r.route_path) for r in seen] == [
        ("/agent/webhook", "/agent", "/webhook"),
        ("/my%20agent/hook", "/my%20agent", "/hook"),
        ("/hook", "", "/hook"),
    ]


@pytest.mark.parametrize(
    ("root_path", "target", "route_path"),
    [
        ("", "/webhook?q=1", "/webhook"),
        ("/agent", "/agent/webhook?q=1", "/webhook"),
        ("/agent/", "/agent/webhook", "/webhook"),
        ("/agent", "/agent", "/"),
        ("/agent", "/agent/", "/"),
        ("/agent", "/agents/webhook", "/agents/webhook"),  # not on a segment boundary
        ("/agent", "/webhook", "/webhook"),  # a server that stripped it already
    ],
)
def test_route_path_drops_the_root_path_prefix(
    root_path: str, target: str, route_path: str
) -> None:
    request = Request("POST", target, (), b"", root_path=root_path)
    assert request.route_path == route_path
    assert request.target == target


async def test_oversize_declared_body_gets_413_without_being_read() -> None:
    called: list[Request] = []

    async def handler(request: Request) -> Response:
        called.append(request)
        return Response(200)

    scope = http_scope(headers=[(b"content-length", b"1000000000")])
    # An empty inbox: any attempt to read the body would fail the test.
    sent = await call(asgi_app(handler, max_body_bytes=1000), scope, [])
    assert sent[0]["status"] == 413
    assert sent[1]["body"] == error_body("validation_error", "request body exceeds 1000 bytes")
    assert called == []


async def test_oversize_streamed_body_gets_413_once_past_the_limit() -> None:
    inbox: list[Message] = [{"type": "http.request", "body": b"x" * 400, "more_body": True}] * 100
    sent = await call(asgi_app(echo, max_body_bytes=1000), http_scope(), inbox)
    assert sent[0]["status"] == 413
    assert sent[1]["body"] == error_body("validation_error", "request body exceeds 1000 bytes")
    assert len(inbox) == 97  # 1200 bytes passed the limit; nothing more was read


async def test_oversize_body_through_httpx_gets_413() -> None:
    async with http(asgi_app(echo, max_body_bytes=1000)) as client:
        got = await client.post("/", content=b"x" * 1001)
    assert got.status_code == 413
    assert got.json()["code"] == "validation_error"


async def test_client_disconnect_before_the_body_ends_calls_nothing() -> None:
    called: list[Request] = []

    async def handler(request: Request) -> Response:
        called.append(request)
        return Response(200)

    inbox: list[Message] = [
        {"type": "http.request", "body": b"part", "more_body": True},
        {"type": "http.disconnect"},
    ]
    assert await call(asgi_app(handler), http_scope(), inbox) == []
    assert called == []


async def test_handler_exception_gets_500(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(request: Request) -> Response:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR):
        async with http(asgi_app(handler)) as client:
            got = await client.get("/x")
    assert got.status_code == 500
    assert got.content == error_body("internal_error", "internal server error")
    assert any(r.exc_info for r in caplog.records)


async def test_head_and_204_framing() -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/none":
            return Response.empty()
        return Response(200, b"abc", (("Content-Length", "99"), ("X-Ok", "1")))

    async with http(asgi_app(handler)) as client:
        head = await client.head("/")
        none = await client.get("/none")
        full = await client.get("/")
    assert (head.status_code, head.headers["content-length"], head.content) == (200, "3", b"")
    assert "content-length" not in none.headers
    assert (full.content, full.headers["content-length"], full.headers["x-ok"]) == (
        b"abc",
        "3",
        "1",
    )


async def test_lifespan_enters_on_startup_and_exits_on_shutdown() -> None:
    log: list[object] = []

    @asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        log.append("enter")
        yield
        log.append("exit")

    async def send(message: dict[str, object]) -> None:
        log.append(message["type"])

    inbox: list[Message] = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> Message:
        return inbox.pop(0)

    await asgi_app(echo, lifespan=lifespan)({"type": "lifespan"}, receive, send)
    assert log == ["enter", "lifespan.startup.complete", "exit", "lifespan.shutdown.complete"]


async def test_lifespan_failures_are_reported() -> None:
    @asynccontextmanager
    async def broken() -> AsyncIterator[None]:
        raise RuntimeError("no database")
        yield  # pragma: no cover

    inbox: list[Message] = [{"type": "lifespan.startup"}]
    sent = await call(asgi_app(echo, lifespan=broken), {"type": "lifespan"}, inbox)
    assert sent[0]["type"] == "lifespan.startup.failed"
    assert "no database" in str(sent[0]["message"])


async def test_lifespan_failure_on_exit_is_reported() -> None:
    @asynccontextmanager
    async def leaky() -> AsyncIterator[None]:
        yield
        raise RuntimeError("could not flush")

    inbox: list[Message] = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = await call(asgi_app(echo, lifespan=leaky), {"type": "lifespan"}, inbox)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.failed"]
    assert "could not flush" in str(sent[1]["message"])


async def test_without_lifespan_startup_and_shutdown_complete() -> None:
    inbox: list[Message] = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = await call(asgi_app(echo), {"type": "lifespan"}, inbox)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_websocket_is_refused() -> None:
    sent = await call(asgi_app(echo), {"type": "websocket"}, [{"type": "websocket.connect"}])
    assert sent == [{"type": "websocket.close", "code": 1003}]


# --- real servers on loopback -------------------------------------------------


class Lifecycle:
    """A lifespan that records, across threads, that it was entered and exited."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.exited = threading.Event()

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[None]:
        self.entered.set()
        yield
        self.exited.set()

    async def wait_entered(self) -> None:
        # The server runs lifespan startup before it accepts; the socket is
        # already listening, so requests sent from now on wait in its backlog.
        assert await anyio.to_thread.run_sync(self.entered.wait, 10), "startup never ran"


@contextmanager
def listening_socket() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


async def round_trip(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        got = await client.post("/v0/a%2Fb?x=1", content=b"hi")
        again = await client.get("/second")
    assert got.status_code == 200
    described = got.json()
    assert (described["target"], described["body"]) == ("/v0/a%2Fb?x=1", "hi")
    assert described["client"][0] == "127.0.0.1"
    assert again.json()["method"] == "GET"


async def test_under_uvicorn() -> None:
    lifecycle = Lifecycle()
    app = asgi_app(echo, lifespan=lifecycle)
    config = uvicorn.Config(
        app, lifespan="on", log_level="warning", loop="asyncio", http="h11", ws="none"
    )
    server = uvicorn.Server(config)
    with listening_socket() as sock:
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
        thread.start()
        try:
            await lifecycle.wait_entered()
            await round_trip(sock.getsockname()[1])
        finally:
            server.should_exit = True
            await anyio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()
    assert lifecycle.exited.is_set()


async def test_under_hypercorn(anyio_backend: str) -> None:
    """Hypercorn's asyncio worker on the asyncio backend, its trio worker on trio."""
    lifecycle = Lifecycle()
    app = asgi_app(echo, lifespan=lifecycle)
    serve = hypercorn.trio.serve if anyio_backend == "trio" else hypercorn.asyncio.serve
    stop = threading.Event()

    async def shutdown_trigger() -> None:
        await anyio.to_thread.run_sync(stop.wait)  # in the server's loop: no polling

    with listening_socket() as sock:
        port = sock.getsockname()[1]
        config = hypercorn.Config()
        config.loglevel = "WARNING"
        config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns and closes it from here
        # hypercorn types messages as TypedDicts, the app as plain dicts.
        app_ = cast("hypercorn.typing.ASGIFramework", app)
        main = functools.partial(serve, app_, config, shutdown_trigger=shutdown_trigger)
        thread = threading.Thread(target=anyio.run, args=(main,), kwargs={"backend": anyio_backend})
        thread.start()
        try:
            await lifecycle.wait_entered()
            await round_trip(port)
        finally:
            stop.set()
            await anyio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()
    assert lifecycle.exited.is_set()

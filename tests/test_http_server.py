"""The built-in HTTP/1.1 server, driven over loopback with raw sockets on both backends."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
from anyio.abc import SocketStream

from rebuno_anyio._http import Handler, Request, Response, encode_response, error_body
from rebuno_anyio._server import HttpServer, ServerLimits

pytestmark = pytest.mark.anyio

GET = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def json(self) -> dict[str, object]:
        value = json.loads(self.body)
        assert isinstance(value, dict)
        return value


class RawClient:
    """A keep-alive client that writes raw bytes and parses responses itself."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def _fill(self) -> bool:
        try:
            self.buffer += await self.stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return False
        return True

    async def reply(self, *, is_head: bool = False) -> Reply:
        while b"\r\n\r\n" not in self.buffer:
            if not await self._fill():
                raise EOFError(f"connection closed; got {self.buffer!r}")
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = [(k.strip().lower(), v.strip()) for k, v in (x.split(":", 1) for x in lines)]
        length = 0 if is_head else int(dict(headers).get("content-length", "0"))
        while len(self.buffer) < length:
            assert await self._fill(), "connection closed mid-body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Reply(int(status_line.split()[1]), headers, body)

    async def is_closed(self) -> bool:
        """True once the server has closed the connection with nothing more sent."""
        return not await self._fill() and self.buffer == b""


async def echo(request: Request) -> Response:
    """Describe the request back as JSON."""
    described = {
        "method": request.method,
        "target": request.target,
        "path": request.path,
        "query": request.query,
        "params": request.query_params(),
        "headers": [list(pair) for pair in request.headers],
        "body": request.body.decode("latin-1"),
        "client": list(request.client) if request.client else None,
    }
    return Response.json(200, json.dumps(described).encode())


@asynccontextmanager
async def running(handler: Handler = echo, **limits: float) -> AsyncIterator[HttpServer]:
    server = HttpServer(handler, limits=ServerLimits(**limits))  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        yield server
        tg.cancel_scope.cancel()


@asynccontextmanager
async def client(server: HttpServer) -> AsyncIterator[RawClient]:
    assert server.port is not None
    async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
        yield RawClient(stream)


async def test_get_and_post() -> None:
    async with running() as server, client(server) as c:
        await c.send(GET)
        got = await c.reply()
        assert got.status == 200
        assert got.header("content-type") == "application/json; charset=utf-8"
        assert got.header("content-length") == str(len(got.body))
        assert got.json()["method"] == "GET"
        await c.send(b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        posted = (await c.reply()).json()
        assert (posted["method"], posted["path"], posted["body"]) == ("POST", "/p", "hello")
        local_port = c.stream.extra(anyio.abc.SocketAttribute.local_port)
        assert posted["client"] == ["127.0.0.1", local_port]


async def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    peers: set[tuple[str, int] | None] = set()

    async def handler(request: Request) -> Response:
        peers.add(request.client)
        return Response(200, b"ok")

    async with running(handler) as server, client(server) as c:
        for _ in range(5):
            await c.send(GET)
            assert (await c.reply()).body == b"ok"
            assert server.connection_count == 1
    assert len(peers) == 1


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with running() as server, client(server) as c:
        await c.send(b"".join(b"GET /%d HTTP/1.1\r\nHost: t\r\n\r\n" % i for i in range(4)))
        paths = [(await c.reply()).json()["path"] for _ in range(4)]
        assert paths == ["/0", "/1", "/2", "/3"]


async def test_chunked_request_body() -> None:
    async with running() as server, client(server) as c:
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.send(b"5\r\nhello\r\n1\r\n \r\n")
        await c.send(b"5\r\nworld\r\n0\r\n\r\n")
        assert (await c.reply()).json()["body"] == "hello world"


async def test_content_length_body_split_across_writes() -> None:
    async with running() as server, client(server) as c:
        await c.send(b"PUT / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n01234")
        await c.send(b"56789")
        assert (await c.reply()).json()["body"] == "0123456789"


async def test_oversize_content_length_gets_413_without_reading_the_body() -> None:
    called: list[Request] = []

    async def handler(request: Request) -> Response:
        called.append(request)
        return Response(200)

    async with running(handler, max_body_bytes=1024) as server, client(server) as c:
        # Declares a gigabyte and sends none of it: the answer cannot wait for it.
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000\r\n\r\n")
        with anyio.fail_after(5):
            got = await c.reply()
            assert await c.is_closed()
    assert got.status == 413
    assert got.json() == {"code": "validation_error", "message": "request body exceeds 1024 bytes"}
    assert called == []


async def test_oversize_chunked_body_gets_413_once_past_the_limit() -> None:
    async with running(max_body_bytes=1000) as server, client(server) as c:
        # 2048 bytes in one chunk and no last chunk: the 413 must not wait for the end.
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        await c.send(b"800\r\n" + b"x" * 2048 + b"\r\n")
        with anyio.fail_after(5):
            got = await c.reply()
            assert await c.is_closed()
    assert got.status == 413
    assert got.json()["code"] == "validation_error"
    assert "1000 bytes" in str(got.json()["message"])


@pytest.mark.parametrize("is_complete", [True, False], ids=["whole-head", "endless-head"])
async def test_oversize_head_gets_413(is_complete: bool) -> None:
    async with running(max_header_bytes=4096) as server, client(server) as c:
        head = b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"y" * 10_000
        await c.send(head + (b"\r\n\r\n" if is_complete else b""))
        with anyio.fail_after(5):
            got = await c.reply()
            assert await c.is_closed()
    assert got.status == 413
    assert got.json() == {"code": "validation_error", "message": "request head exceeds 4096 bytes"}


@pytest.mark.parametrize(
    "garbage",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: x\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["request-line", "content-length", "chunk-size"],
)
async def test_malformed_request_gets_400(garbage: bytes) -> None:
    async with running() as server, client(server) as c:
        await c.send(garbage)
        with anyio.fail_after(5):
            got = await c.reply()
            assert await c.is_closed()
    assert got.status == 400
    assert got.json()["code"] == "validation_error"


async def test_slow_head_gets_408_and_is_closed() -> None:
    async with running(header_timeout_s=0.2) as server, client(server) as c:
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\n")  # and never the blank line
        with anyio.fail_after(5):
            got = await c.reply()
            assert await c.is_closed()
    assert got.status == 408
    assert got.json()["code"] == "validation_error"


async def test_slow_body_gets_408_and_is_closed() -> None:
    async with running(body_timeout_s=0.2) as server, client(server) as c:
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
        with anyio.fail_after(5):
            got = await c.reply()
            assert await c.is_closed()
    assert got.status == 408


async def test_silent_and_idle_connections_are_closed_without_an_answer() -> None:
    async with running(header_timeout_s=0.2, keepalive_timeout_s=0.2) as server:
        async with client(server) as silent:
            with anyio.fail_after(5):
                assert await silent.is_closed()
        async with client(server) as idle:
            await idle.send(GET)
            assert (await idle.reply()).status == 200
            with anyio.fail_after(5):
                assert await idle.is_closed()


async def test_handler_exception_gets_500_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("boom")
        return Response(200, b"fine")

    with caplog.at_level(logging.ERROR):
        async with running(handler) as server, client(server) as c:
            await c.send(b"GET /boom HTTP/1.1\r\nHost: t\r\n\r\n")
            failed = await c.reply()
            await c.send(GET)
            assert (await c.reply()).body == b"fine"
    assert failed.status == 500
    assert failed.body == error_body("internal_error", "internal server error")
    assert any("/boom" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_invalid_response_from_handler_gets_500() -> None:
    async def handler(request: Request) -> Response:
        return Response(200, b"", (("x-bad", "line\r\nbreak"),))

    async with running(handler) as server, client(server) as c:
        await c.send(GET)
        assert (await c.reply()).status == 500


async def test_graceful_shutdown_finishes_in_flight_requests_then_serve_returns() -> None:
    entered, release, returned = anyio.Event(), anyio.Event(), anyio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            entered.set()
            await release.wait()
        return Response(200, request.path.encode())

    server = HttpServer(handler)

    async def serve(*, task_status: anyio.abc.TaskStatus[int]) -> None:
        await server.serve(task_status=task_status)
        returned.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            port = await tg.start(serve)
            async with client(server) as idle, client(server) as busy:
                await idle.send(GET)
                assert (await idle.reply()).status == 200
                await busy.send(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
                await entered.wait()
                server.shutdown()
                assert await idle.is_closed()  # idle keep-alive connections go at once
                assert not returned.is_set()
                release.set()
                got = await busy.reply()
                assert (got.status, got.body) == (200, b"/slow")
                assert got.header("connection") == "close"
                assert await busy.is_closed()
            await returned.wait()
    assert server.port is None
    with pytest.raises(OSError, match="connection attempts failed"):
        await anyio.connect_tcp("127.0.0.1", port)


async def test_raw_target_is_preserved() -> None:
    target = "/v0/executions/a%2Fb/%7Euser?q=a%20b&q=c%26d&empty=&plus=x+y"
    async with running() as server, client(server) as c:
        await c.send(f"GET {target} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        got = (await c.reply()).json()
    assert got["target"] == target
    assert got["path"] == "/v0/executions/a%2Fb/%7Euser"
    assert got["query"] == "q=a%20b&q=c%26d&empty=&plus=x+y"
    assert got["params"] == {"q": "c&d", "empty": "", "plus": "x y"}


async def test_header_names_lowered_and_repeats_kept() -> None:
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response(204)

    async with running(handler) as server, client(server) as c:
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\nX-Tag: one\r\nx-other: \xe9\r\n")
        await c.send(b"X-TAG: two\r\n\r\n")
        got = await c.reply()
    assert got.status == 204
    assert got.header("content-length") is None  # RFC 9110 §8.6: never on a 204
    (request,) = seen
    assert request.headers == (("host", "t"), ("x-tag", "one"), ("x-other", "é"), ("x-tag", "two"))
    assert request.header("X-Tag") == "one"
    assert request.header_values("x-TAG") == ("one", "two")
    assert request.header("missing") is None


async def test_head_gets_the_headers_of_a_get_and_no_body() -> None:
    async with running() as server, client(server) as c:
        await c.send(b"HEAD / HTTP/1.1\r\nHost: t\r\n\r\n")
        head = await c.reply(is_head=True)
        await c.send(GET)  # the connection is still in step after a bodiless reply
        got = await c.reply()
    assert head.status == 200
    assert int(head.header("content-length") or 0) > 0
    assert got.json()["method"] == "GET"


async def test_expect_100_continue() -> None:
    async with running(max_body_bytes=100) as server:
        async with client(server) as c:
            await c.send(
                b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
            )
            assert (await c.reply()).status == 100
            await c.send(b"hello")
            assert (await c.reply()).json()["body"] == "hello"
        async with client(server) as c:
            await c.send(
                b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 500\r\n\r\n"
            )
            assert (await c.reply()).status == 413  # refused without inviting the body


async def test_connection_close_from_client_is_honoured() -> None:
    async with running() as server, client(server) as c:
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert (await c.reply()).status == 200
        assert await c.is_closed()


async def test_connections_are_served_concurrently() -> None:
    second_arrived = anyio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/first":
            await second_arrived.wait()  # would deadlock if connections were serialized
        else:
            second_arrived.set()
        return Response(200, request.path.encode())

    async with running(handler) as server, client(server) as a, client(server) as b:
        await a.send(b"GET /first HTTP/1.1\r\nHost: t\r\n\r\n")
        await b.send(b"GET /second HTTP/1.1\r\nHost: t\r\n\r\n")
        with anyio.fail_after(5):
            assert (await b.reply()).body == b"/second"
            assert (await a.reply()).body == b"/first"


async def test_handler_framing_headers_are_replaced() -> None:
    async def handler(request: Request) -> Response:
        return Response(200, b"abc", (("Content-Length", "99"), ("X-Ok", "1")))

    async with running(handler) as server, client(server) as c:
        await c.send(GET)
        got = await c.reply()
    assert got.header("content-length") == "3"
    assert got.header("x-ok") == "1"


def test_request_and_response_model() -> None:
    request = Request("GET", "/a%20b?x=1&x=2&y=%C3%A9", (("k", "v"),), b"")
    assert (request.path, request.query) == ("/a%20b", "x=1&x=2&y=%C3%A9")
    assert request.query_params() == {"x": "2", "y": "é"}
    assert Request("GET", "/plain", (), b"").query == ""
    ok = Response.json(201, b"{}", (("x", "y"),))
    assert ok.headers == (("content-type", "application/json; charset=utf-8"), ("x", "y"))
    assert Response.empty() == Response(204, b"", ())
    assert json.loads(error_body("not_found", "no such execution")) == {
        "code": "not_found",
        "message": "no such execution",
    }
    with pytest.raises(ValueError, match="nonsense"):
        error_body("nonsense", "x")


def test_encode_response_frames_the_body() -> None:
    given = Response(
        200, b"abc", (("X-A", "é"), ("Content-Length", "9"), ("transfer-encoding", "x"))
    )
    assert encode_response(given) == ([(b"X-A", b"\xe9"), (b"content-length", b"3")], b"abc")
    assert encode_response(given, is_head=True)[1] == b""
    assert encode_response(Response(304, b"ignored", (("etag", "1"),))) == ([(b"etag", b"1")], b"")


async def test_closing_connection_delivers_a_large_response_whole() -> None:
    big = bytes(range(256)) * 32 * 1024  # 8 MiB: more than the socket buffers hold

    async def handler(request: Request) -> Response:
        return Response(200, big)

    async with running(handler) as server, client(server) as c:
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        with anyio.fail_after(10):
            got = await c.reply()
            assert await c.is_closed()
    assert got.body == big


async def test_413_survives_a_client_still_sending_its_body() -> None:
    async with running(max_body_bytes=1000) as server, client(server) as c:
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4000000\r\n\r\n")
        # The client sends its body regardless of the early answer, and only then reads.
        await c.send(b"z" * 4_000_000)
        with anyio.fail_after(10):
            got = await c.reply()
    assert got.status == 413


async def test_a_broken_connection_does_not_take_the_server_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/bug":
            return None  # type: ignore[return-value]
        return Response(200, b"still here")

    with caplog.at_level(logging.ERROR):
        async with running(handler) as server:
            async with client(server) as c:
                await c.send(b"GET /bug HTTP/1.1\r\nHost: t\r\n\r\n")
                with anyio.fail_after(5):
                    assert await c.is_closed()
            async with client(server) as c:
                await c.send(GET)
                assert (await c.reply()).body == b"still here"
    assert any(r.exc_info for r in caplog.records)

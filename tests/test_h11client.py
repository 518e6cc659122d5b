"""Tests for the kernel HTTP client (rebuno_anyio._h11client) on asyncio and trio.

The server is a tiny h11 server on an anyio TCP listener, written here so these tests
depend on nothing else in rebuno_anyio. Each request path picks a server behaviour.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from socket import IPPROTO_TCP, TCP_NODELAY

import anyio
import h11
import pytest
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.tls import TLSListener
from tls_support import SelfSigned, self_signed

from rebuno_anyio._h11client import (
    ClientResponse,
    ConnectError,
    ConnectionLost,
    HttpClient,
    HttpClientError,
    RequestTimeout,
    TLSError,
    _Reader,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass
class Seen:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes


KEEP, CLOSE, RAW_KEEP = "keep", "close", "raw-keep"


@dataclass
class Conn:
    """One server-side connection, as a handler sees it."""

    stream: ByteStream
    h: h11.Connection = field(default_factory=lambda: h11.Connection(h11.SERVER))
    method: str = ""

    async def respond(
        self,
        status: int = 200,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
        chunks: list[bytes] | None = None,
    ) -> None:
        """Respond through h11; `chunks` makes h11 use chunked framing."""
        fields = list(headers or [])
        if chunks is None:
            fields.append(("content-length", str(len(body))))
        out = self.h.send(h11.Response(status_code=status, headers=fields))
        for data in [] if self.method == "HEAD" else chunks if chunks is not None else [body]:
            if data:
                out += self.h.send(h11.Data(data=data))
        await self.stream.send(out + self.h.send(h11.EndOfMessage()))


Handler = Callable[[Conn, Seen], Awaitable[str]]


class Server:
    def __init__(self, port: int, scheme: str = "http") -> None:
        self.port = port
        self.url = f"{scheme}://127.0.0.1:{port}"
        self.connections = 0
        self.ended = 0
        self.requests: list[Seen] = []
        self.in_flight = 0
        self.release = anyio.Event()
        self.routes: dict[str, Handler] = {}
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait, with no polling, until the server's counters satisfy `predicate`."""
        with anyio.fail_after(5):
            while not predicate():
                await self._changed.wait()

    async def serve_connection(self, stream: ByteStream) -> None:
        self.connections += 1
        self._notify()
        conn = Conn(stream)
        try:
            async with stream:
                while (seen := await self._read_request(conn)) is not None:
                    self.requests.append(seen)
                    self._notify()
                    conn.method = seen.method
                    route = self.routes.get(seen.target.split("?")[0], _echo)
                    outcome = await route(conn, seen)
                    if outcome == CLOSE or conn.h.our_state is not h11.DONE:
                        if outcome != RAW_KEEP:
                            return
                        conn.h = h11.Connection(h11.SERVER)
                    else:
                        conn.h.start_next_cycle()
        finally:
            self.ended += 1
            self._notify()

    async def _read_request(self, conn: Conn) -> Seen | None:
        request, body = None, b""
        while True:
            try:
                event = conn.h.next_event()
            except h11.RemoteProtocolError:  # not HTTP at all (a TLS handshake, say)
                return None
            if event is h11.NEED_DATA:
                try:
                    conn.h.receive_data(await conn.stream.receive())
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return None
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                headers = [(k.decode(), v.decode()) for k, v in request.headers]
                return Seen(request.method.decode(), request.target.decode(), headers, body)
            else:
                return None


async def _echo(conn: Conn, seen: Seen) -> str:
    reply = {"method": seen.method, "target": seen.target, "body": seen.body.decode()}
    await conn.respond(200, [("content-type", "application/json")], json.dumps(reply).encode())
    return KEEP


async def _hang(conn: Conn, seen: Seen) -> str:
    """Never respond; return once the client closes the connection."""
    with suppress(anyio.EndOfStream, anyio.BrokenResourceError):
        await conn.stream.receive()
    return CLOSE


def _raw(data: bytes, outcome: str = CLOSE) -> Handler:
    async def handler(conn: Conn, seen: Seen) -> str:
        await conn.stream.send(data)
        return outcome

    return handler


@asynccontextmanager
async def serving(
    routes: dict[str, Handler] | None = None, *, tls: ssl.SSLContext | None = None
) -> AsyncIterator[Server]:
    """Serve on a loopback port; with `tls` (a server context), over TLS."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as tcp:
        port = tcp.extra(SocketAttribute.local_port)
        server = Server(port, "http" if tls is None else "https")
        server.routes.update(routes or {})
        listener = tcp if tls is None else TLSListener(tcp, tls, standard_compatible=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, server.serve_connection, tg)
            yield server
            tg.cancel_scope.cancel()


async def test_get_and_post_round_trip() -> None:
    async with serving() as server, HttpClient(server.url) as client:
        got = await client.request("GET", "/v0/things?x=1")
        assert got.status == 200
        assert got.header("Content-Type") == "application/json"
        assert got.header("x-missing") is None
        assert got.json() == {"method": "GET", "target": "/v0/things?x=1", "body": ""}
        posted = await client.request("POST", "/v0/things", body=b'{"a": 1}')
        assert posted.json()["body"] == '{"a": 1}'
        assert isinstance(posted, ClientResponse)
        assert posted.headers[0][0] == "content-type"


async def test_headers_sent() -> None:
    async with serving() as server, HttpClient(server.url) as client:
        await client.request("POST", "/a", headers=[("X-Sig", "v1=abc"), ("x-two", "2")])
        await client.request("GET", "/b")
        await client.request("PUT", "/c", body=b"xyz")
    post, get, put = (dict(seen.headers) for seen in server.requests)
    assert post["host"] == f"127.0.0.1:{server.port}"
    assert post["content-length"] == "0"
    assert post["x-sig"] == "v1=abc"
    assert post["x-two"] == "2"
    assert "content-length" not in get
    assert get["host"] == f"127.0.0.1:{server.port}"
    assert put["content-length"] == "3"


async def test_invalid_request_is_refused_before_sending() -> None:
    async with serving() as server, HttpClient(server.url) as client:
        with pytest.raises(ValueError, match="invalid header"):
            await client.request("GET", "/", headers=[("x-a", "1\r\nx-b: 2")])
        with pytest.raises(ValueError, match="set by the client"):
            await client.request("POST", "/", headers=[("Content-Length", "5")])
        with pytest.raises(ValueError, match="method"):
            await client.request("GE T", "/")
        with pytest.raises(ValueError, match="path"):
            await client.request("GET", "/a b")
        with pytest.raises(ValueError, match="latin-1"):
            await client.request("GET", "/", headers=[("x-a", "\u2603")])
    assert server.connections == 0


async def test_content_length_and_chunked_responses() -> None:
    big = bytes(range(256)) * 4096  # 1 MiB: many reads
    routes = {
        "/chunked": _respond(chunks=[b"hello ", b"", b"chunked ", b"world"]),
        "/big": _respond(body=big),
        "/big-chunked": _respond(chunks=[big[:300_000], big[300_000:]]),
        "/empty": _respond(status=204),
        "/ext": _raw(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b"5;name=value\r\nhello\r\n1 ; x\r\n!\r\n0\r\nx-trailer: yes\r\n\r\n",
            RAW_KEEP,
        ),
        "/repeated": _raw(
            b"HTTP/1.1 200 OK\r\nx-a: 1\r\nX-A: 2\r\ncontent-length: 0\r\n\r\n", RAW_KEEP
        ),
        "/interim": _raw(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
            b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
            RAW_KEEP,
        ),
    }
    async with serving(routes) as server, HttpClient(server.url) as client:
        assert (await client.request("GET", "/chunked")).body == b"hello chunked world"
        assert (await client.request("GET", "/big")).body == big
        assert (await client.request("GET", "/big-chunked")).body == big
        empty = await client.request("DELETE", "/empty")
        assert (empty.status, empty.body) == (204, b"")
        assert (await client.request("GET", "/ext")).body == b"hello!"
        assert (await client.request("GET", "/repeated")).header("X-a") == "1, 2"
        large = bytes(100_000)  # sent as its own write, not copied into the head
        assert (await client.request("PUT", "/echo", body=large)).json()["body"] == large.decode()
        interim = await client.request("POST", "/interim")
        assert (interim.status, interim.body) == (201, b"ok")
        head = await client.request("HEAD", "/big")
        assert (head.status, head.body, head.header("content-length")) == (200, b"", str(len(big)))
        assert (await client.request("GET", "/x")).status == 200
    assert server.connections == 1


def _respond(status: int = 200, body: bytes = b"", chunks: list[bytes] | None = None) -> Handler:
    async def handler(conn: Conn, seen: Seen) -> str:
        await conn.respond(status, body=body, chunks=chunks)
        return KEEP

    return handler


async def test_fifty_sequential_requests_use_one_connection() -> None:
    async with serving() as server, HttpClient(server.url) as client:
        for i in range(50):
            assert (await client.request("POST", f"/n/{i}")).json()["target"] == f"/n/{i}"
        stream = client._idle[0]
        assert stream.extra(SocketAttribute.raw_socket).getsockopt(IPPROTO_TCP, TCP_NODELAY)
    assert server.connections == 1
    assert len(server.requests) == 50


async def _barrier(server: Server) -> None:
    server.in_flight += 1
    server._notify()
    await server.release.wait()
    server.in_flight -= 1


async def test_concurrent_requests_open_several_connections_and_reuse_them() -> None:
    async def gated(conn: Conn, seen: Seen) -> str:
        await _barrier(server)
        return await _echo(conn, seen)

    async with serving({"/gated": gated}) as server, HttpClient(server.url) as client:
        for round_ in range(3):
            server.release = anyio.Event()
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(client.request, "GET", "/gated")
                await server.wait_for(lambda: server.in_flight == 8)
                server.release.set()
            assert server.connections == 8, round_
    assert len(server.requests) == 24


async def test_callers_beyond_max_connections_wait_for_a_free_one() -> None:
    async def gated(conn: Conn, seen: Seen) -> str:
        await _barrier(server)
        return await _echo(conn, seen)

    results: list[int] = []

    async def call() -> None:
        results.append((await client.request("GET", "/gated")).status)

    async with (
        serving({"/gated": gated}) as server,
        HttpClient(server.url, max_connections=2) as client,
        anyio.create_task_group() as tg,
    ):
        for _ in range(6):
            tg.start_soon(call)
        await server.wait_for(lambda: server.in_flight == 2)
        await anyio.wait_all_tasks_blocked()
        assert (server.connections, server.in_flight) == (2, 2)
        server.release.set()
    assert results == [200] * 6
    assert server.connections == 2


async def test_idle_connection_closed_by_server_is_retried_once() -> None:
    async def close_after(conn: Conn, seen: Seen) -> str:
        await _echo(conn, seen)
        return CLOSE  # an idle timeout: the server closes without telling

    async with serving({"/close-after": close_after}) as server, HttpClient(server.url) as client:
        assert (await client.request("GET", "/close-after")).status == 200
        await server.wait_for(lambda: server.ended == 1)
        again = await client.request("POST", "/again", body=b"x")
        assert again.json()["body"] == "x"
        assert server.connections == 2
        assert [seen.target for seen in server.requests] == ["/close-after", "/again"]


async def test_retry_happens_only_once() -> None:
    async def close_after(conn: Conn, seen: Seen) -> str:
        await _echo(conn, seen)
        server.routes["/x"] = _raw(b"")  # from now on, close without responding
        return CLOSE

    async with serving({"/x": close_after}) as server, HttpClient(server.url) as client:
        await client.request("GET", "/x")
        await server.wait_for(lambda: server.ended == 1)
        with pytest.raises(ConnectionLost):
            await client.request("GET", "/x")
        assert server.connections == 2


_CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_broken_responses_raise_connection_lost_and_discard_the_connection() -> None:
    routes = {
        "/partial": _raw(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part"),
        "/partial-head": _raw(b"HTTP/1.1 200 OK\r\ncontent-len"),
        "/partial-chunk": _raw(_CHUNKED + b"5\r\nab"),
        "/garbage": _raw(b"SMTP ready\r\n\r\n", RAW_KEEP),
        "/bad-length": _raw(b"HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\nx", RAW_KEEP),
        "/bad-chunk": _raw(_CHUNKED + b"0x1\r\n", RAW_KEEP),
        "/nothing": _raw(b""),
        "/bad-header": _raw(b"HTTP/1.1 200 OK\r\nbad name: x\r\n\r\n", RAW_KEEP),
        "/control": _raw(b"HTTP/1.1 200 OK\r\nx: a\x01b\r\ncontent-length: 0\r\n\r\n", RAW_KEEP),
        "/huge-head": _raw(b"HTTP/1.1 200 OK\r\nx: " + b"a" * 70_000),
        "/huge-chunk-line": _raw(_CHUNKED + b"1;" + b"x" * 70_000),
        "/huge-trailers": _raw(_CHUNKED + b"0\r\n" + (b"x: " + b"a" * 1000 + b"\r\n") * 70),
        "/no-crlf": _raw(_CHUNKED + b"3\r\nabcXY0\r\n\r\n", RAW_KEEP),
        "/101": _raw(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n", RAW_KEEP),
    }
    async with serving(routes) as server:
        for n, path in enumerate(routes, start=1):
            async with HttpClient(server.url) as client:
                with pytest.raises(ConnectionLost):
                    await client.request("GET", path)
                assert (await client.request("GET", "/ok")).status == 200
            assert server.connections == 2 * n, path  # the broken one was not reused


async def test_connection_refused_raises_connect_error() -> None:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(SocketAttribute.local_port)
    async with HttpClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(ConnectError, match="could not connect"):
            await client.request("GET", "/")


async def test_slow_server_raises_request_timeout_and_drops_the_connection() -> None:
    async with serving({"/slow": _hang}) as server, HttpClient(server.url, timeout=0.3) as client:
        with anyio.fail_after(5), pytest.raises(RequestTimeout, match="/slow"):
            await client.request("GET", "/slow")
        await server.wait_for(lambda: server.ended == 1)
        assert (await client.request("GET", "/fast")).status == 200
    assert server.connections == 2


async def test_connection_close_responses_are_not_reused() -> None:
    async def closing(conn: Conn, seen: Seen) -> str:
        await conn.respond(200, [("connection", "close")], b"bye")
        return KEEP  # h11 itself closes after `connection: close`

    routes = {
        "/close": closing,
        "/http10": _raw(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", CLOSE),
        "/until-close": _raw(b"HTTP/1.1 200 OK\r\n\r\nall of it", CLOSE),
        # RFC 9112 §6.3: chunked wins over Content-Length, and the connection must close.
        "/te-and-cl": _raw(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 99\r\n\r\n"
            b"2\r\nok\r\n0\r\n\r\n",
            RAW_KEEP,
        ),
        "/gzip-until-close": _raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nzz", CLOSE),
    }
    async with serving(routes) as server, HttpClient(server.url) as client:
        for _ in range(2):
            assert (await client.request("GET", "/close")).body == b"bye"
            assert (await client.request("GET", "/http10")).body == b"ok"
            assert (await client.request("GET", "/until-close")).body == b"all of it"
            assert (await client.request("GET", "/te-and-cl")).body == b"ok"
            assert (await client.request("GET", "/gzip-until-close")).body == b"zz"
        assert server.connections == 10


async def test_cancelled_caller_discards_the_connection() -> None:
    async with serving({"/hang": _hang}) as server, HttpClient(server.url) as client:
        await client.request("GET", "/warm")  # one idle connection in the pool
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.request, "GET", "/hang")
            await server.wait_for(lambda: len(server.requests) == 2)
            tg.cancel_scope.cancel()
        await server.wait_for(lambda: server.ended == 1)
        assert (await client.request("GET", "/after")).status == 200
        assert server.connections == 2


async def test_target_joins_the_base_path_prefix() -> None:
    client = HttpClient("http://kernel.local:8080/prefix/")
    assert client.target("/v0/executions/x?y=1") == "/prefix/v0/executions/x?y=1"
    assert HttpClient("http://h").target("/a?b=c") == "/a?b=c"
    with pytest.raises(ValueError, match="start with '/'"):
        client.target("v0/x")
    async with serving() as server, HttpClient(server.url + "/api") as client:
        got = await client.request("GET", "/v0/executions/x?y=1")
        assert got.json()["target"] == "/api/v0/executions/x?y=1"
        assert server.requests[0].target == client.target("/v0/executions/x?y=1")


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("ftp://kernel:8443", "only http:// and https://"),
        ("localhost:8080", "only http://"),
        ("garbage", "only http://"),
        ("https://", "without credentials"),
        ("http://", "without credentials"),
        ("http://user:pw@host", "without credentials"),
        ("http://host/?q=1", "without credentials"),
        ("http://host:99999", "invalid port"),
        ("http://host:port", "invalid port"),
        ("http://host/a b", "spaces or non-ASCII"),
    ],
)
def test_bad_base_urls_are_refused(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HttpClient(url)


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        HttpClient("http://h", timeout=0)
    with pytest.raises(ValueError, match="max_connections"):
        HttpClient("http://h", max_connections=0)


async def test_aclose_closes_idle_connections_and_refuses_new_requests() -> None:
    async with serving() as server:
        client = HttpClient(server.url)
        await client.request("GET", "/")
        await client.aclose()
        await server.wait_for(lambda: server.ended == 1)
        with pytest.raises(HttpClientError, match="closed"):
            await client.request("GET", "/")
        await client.aclose()  # idempotent
    assert server.connections == 1


async def test_aclose_fails_callers_still_waiting_for_a_connection() -> None:
    async def gated(conn: Conn, seen: Seen) -> str:
        await _barrier(server)
        return await _echo(conn, seen)

    async def first() -> None:
        assert (await client.request("GET", "/gated")).status == 200

    async def second() -> None:
        with pytest.raises(HttpClientError, match="closed"):
            await client.request("GET", "/gated")

    async with serving({"/gated": gated}) as server:
        client = HttpClient(server.url, max_connections=1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await server.wait_for(lambda: server.in_flight == 1)
            tg.start_soon(second)
            await anyio.wait_all_tasks_blocked()
            await client.aclose()
            server.release.set()
        await server.wait_for(lambda: server.ended == 1)  # not pooled after aclose()
    assert server.connections == 1


class _Chunks:
    """A stand-in stream that returns the given chunks one receive() at a time."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self.chunks:
            raise anyio.EndOfStream
        return self.chunks.pop(0)


_PARSED = [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello", 200, b"hello", True),
    (b"HTTP/1.1 200 \r\ncontent-length: 2, 2\r\n\r\nok", 200, b"ok", True),
    (_CHUNKED + b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n", 200, b"abcde", True),
    (_CHUNKED + b"1\r\na\r\n0\r\nt: 1\r\nu: 2\r\n\r\n", 200, b"a", True),
    (b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"", True),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 304\r\ncontent-length: 9\r\n\r\n", 304, b"", True),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\nx", 200, b"x", False),
    (b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 1\r\n\r\nx", 200, b"x", True),
    (
        b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, CLOSE\r\ncontent-length: 0\r\n\r\n",
        200,
        b"",
        False,
    ),
    (b"HTTP/1.1 500 Oops\r\n\r\nuntil the end", 500, b"until the end", False),
]


@pytest.mark.parametrize(("raw", "status", "body", "is_reusable"), _PARSED)
@pytest.mark.parametrize("split", ["whole", "bytewise"])
async def test_responses_parse_whole_and_one_byte_at_a_time(
    raw: bytes, status: int, body: bytes, is_reusable: bool, split: str
) -> None:
    chunks = [raw] if split == "whole" else [raw[i : i + 1] for i in range(len(raw))]
    reader = _Reader(_Chunks(chunks[1:]), chunks[0])  # type: ignore[arg-type]
    response, reusable = await reader.response("GET")
    assert (response.status, response.body, reusable) == (status, body, is_reusable)


async def test_bytes_past_the_response_forbid_reuse() -> None:
    reader = _Reader(_Chunks([]), b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nxy")  # type: ignore[arg-type]
    response, reusable = await reader.response("GET")
    assert (response.body, reusable) == (b"x", False)


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 \xb200 OK\r\n\r\n",
        b"HTTP/2.0 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n: empty name\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno-colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
        _CHUNKED + b"-1\r\n",
        _CHUNKED + b"1_0\r\n",
        _CHUNKED + b"\r\n",
    ],
)
async def test_malformed_responses_raise_connection_lost(raw: bytes) -> None:
    reader = _Reader(_Chunks([]), raw)  # type: ignore[arg-type]
    with pytest.raises(ConnectionLost, match=r"malformed|bad content-length"):
        await reader.response("GET")


# -- https ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> SelfSigned:
    return self_signed(tmp_path_factory.mktemp("tls"))


async def test_https_round_trip_keeps_the_connection_alive(certificate: SelfSigned) -> None:
    """An https:// base URL is served over TLS (host name checked against the
    certificate), with keep-alive pooling as for http."""
    async with (
        serving(tls=certificate.server_context()) as server,
        HttpClient(server.url + "/api", ssl_context=certificate.client_context()) as client,
    ):
        assert server.url.startswith("https://")
        for n in range(5):
            got = await client.request("POST", f"/v0/things/{n}", body=b'{"n": 1}')
            assert got.status == 200
            assert got.json() == {
                "method": "POST",
                "target": f"/api/v0/things/{n}",
                "body": '{"n": 1}',
            }
        big = b"x" * 100_000  # larger than one TLS record, sent without a copy
        assert (await client.request("PUT", "/big", body=big)).json()["body"] == big.decode()
    assert server.connections == 1
    assert dict(server.requests[0].headers)["host"] == f"127.0.0.1:{server.port}"


async def test_https_idle_connection_closed_by_server_is_retried(certificate: SelfSigned) -> None:
    async def closing(conn: Conn, seen: Seen) -> str:
        await conn.respond(200, [], b"then gone")  # keep-alive framing, then closes
        return CLOSE

    async with (
        serving({"/close": closing}, tls=certificate.server_context()) as server,
        HttpClient(server.url, ssl_context=certificate.client_context()) as client,
    ):
        assert (await client.request("GET", "/close")).body == b"then gone"
        await server.wait_for(lambda: server.ended == 1)
        assert (await client.request("GET", "/again")).status == 200
    assert server.connections == 2


async def test_https_with_an_untrusted_certificate_is_a_tls_error(
    certificate: SelfSigned, tmp_path: Path
) -> None:
    """The default context trusts the system's CAs only: a self-signed
    certificate fails the handshake, and no request is sent."""
    other = self_signed(tmp_path)  # trusted by the client, but not the server's
    async with serving(tls=certificate.server_context()) as server:
        for context in (None, other.client_context()):
            async with HttpClient(server.url, ssl_context=context) as client:
                with pytest.raises(TLSError, match="TLS handshake") as caught:
                    await client.request("GET", "/")
                assert isinstance(caught.value, ConnectError)
        assert server.requests == []


async def test_https_to_a_plain_http_server_is_a_tls_error(certificate: SelfSigned) -> None:
    async with serving() as server:
        url = server.url.replace("http://", "https://")
        async with HttpClient(url, ssl_context=certificate.client_context()) as client:
            with anyio.fail_after(5), pytest.raises(TLSError):
                await client.request("GET", "/")


def test_https_defaults_to_port_443() -> None:
    client = HttpClient("https://kernel.example/api")
    assert client._port == 443
    assert HttpClient("http://kernel.example")._port == 80
    assert client.target("/v0/x") == "/api/v0/x"

"""The built-in HTTP/1.1 server: h11 over anyio, one task per connection.

It owns everything between a listening socket and a `Handler`: keep-alive and
pipelining (h11 parses one request at a time, so pipelined requests are answered
in order), Content-Length and chunked request bodies, `Expect: 100-continue`,
HEAD, size limits answered with 413 before a body is buffered, timeouts, the 500
envelope when a handler raises, and graceful shutdown. It runs unchanged on
asyncio and trio.

Theory of operation. Each connection runs inside one cancel scope whose deadline
moves with the phase of the exchange, so timeouts cost a deadline update rather
than a new scope per request:

* waiting for the next request on an idle connection: `keepalive_timeout_s`
  (for a fresh connection: `header_timeout_s`, counted from the accept);
* once the first bytes of a head have arrived: `header_timeout_s`;
* once the body is being read: `body_timeout_s`;
* while the handler runs: no deadline;
* from the moment the response is written: `keepalive_timeout_s` again, so a
  client that does not read its response holds the connection no longer than an
  idle one would.

When the deadline fires mid-request the client gets a 408; an idle connection is
simply closed. Every closing connection first half-closes and drains what the
client still sends for a moment (RFC 9112 §9.6), so that unread request bytes do
not turn the close into a reset that destroys the response in flight.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import socket
import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Final

import anyio
import h11
from anyio.abc import Listener, SocketAttribute, SocketListener, SocketStream, TaskGroup, TaskStatus

from ._http import INTERNAL_ERROR, Handler, Request, Response, encode_response, respond

__all__ = ["HttpServer", "ServerLimits"]

logger = logging.getLogger(__name__)

# A large receive lets a whole pipelined burst arrive in one call; 64 KiB stays
# below the allocator's mmap threshold, which a bigger buffer per recv would cross.
_RECEIVE_BYTES: Final = 65536
# Bodies above this go out in a second send rather than being copied behind the head.
_COALESCE_BYTES: Final = 65536
# How long a closing connection drains what the client is still sending.
_LINGER_S: Final = 2.0
# How long a closing connection may take to write its last answer and drain.
_CLOSING_S: Final = 5.0 + _LINGER_S
# After a failed accept (out of descriptors, say), wait this long before the next.
_ACCEPT_RETRY_S: Final = 0.1

_REASONS: Final = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}
_CLOSE: Final = (b"connection", b"close")
_GONE: Final = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLimits:
    """Size and time limits of the built-in server."""

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 10 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    shutdown_grace_s: float = 10.0


@functools.lru_cache(maxsize=1)
def _http_date(second: int) -> bytes:
    """The `Date` header value, formatted once a second."""
    return formatdate(second, usegmt=True).encode("ascii")


class HttpServer:
    """An HTTP/1.1 server that answers every request with `handler`.

    One instance serves once. `shutdown()` must be called from the thread running
    the event loop (from another thread, use `anyio.from_thread.run_sync`).
    """

    def __init__(self, handler: Handler, *, limits: ServerLimits = ServerLimits()) -> None:
        self._handler = handler
        self._limits = limits
        self._port: int | None = None
        self._is_closing = False
        self._accept_scope: anyio.CancelScope | None = None
        self._connections: set[_Connection] = set()
        self._head_too_large = Response.error(
            413, "validation_error", f"request head exceeds {limits.max_header_bytes} bytes"
        )
        self._body_too_large = Response.error(
            413, "validation_error", f"request body exceeds {limits.max_body_bytes} bytes"
        )
        self._head_timed_out = Response.error(
            408, "validation_error", f"request head not received within {limits.header_timeout_s} s"
        )
        self._body_timed_out = Response.error(
            408, "validation_error", f"request body not received within {limits.body_timeout_s} s"
        )

    @property
    def port(self) -> int | None:
        """The port being served, or None when not serving."""
        return self._port

    @property
    def connection_count(self) -> int:
        """How many client connections are open right now."""
        return len(self._connections)

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind and serve until cancelled or until `shutdown()` completes.

        Args:
            host: the interface to bind.
            port: the port to bind; 0 picks a free one.
            task_status: receives the bound port once the server accepts connections.

        Raises:
            RuntimeError: this server is already serving or has served.
        """
        if self._accept_scope is not None:
            raise RuntimeError("an HttpServer serves once")
        accept_scope = self._accept_scope = anyio.CancelScope()
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        try:
            self._port = listener.extra(SocketAttribute.local_port)
            async with anyio.create_task_group() as connections:
                with accept_scope:
                    if self._is_closing:
                        accept_scope.cancel()
                    task_status.started(self._port)
                    async with anyio.create_task_group() as acceptors:
                        for sub in listener.listeners:
                            acceptors.start_soon(self._accept, sub, connections)
                # shutdown() was called: stop accepting, then give the requests in
                # flight the grace period before cancelling what is left.
                await listener.aclose()
                connections.cancel_scope.deadline = (
                    anyio.current_time() + self._limits.shutdown_grace_s
                )
        finally:
            self._port = None
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    def shutdown(self) -> None:
        """Stop gracefully: stop accepting, close idle connections, let requests finish.

        Requests in flight get `shutdown_grace_s`; their responses carry
        `Connection: close`. `serve()` returns once they are done.
        """
        self._is_closing = True
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        for connection in tuple(self._connections):
            if connection.is_idle:
                connection.close()

    async def _accept(self, listener: Listener[SocketStream], connections: TaskGroup) -> None:
        assert isinstance(listener, SocketListener)
        while True:
            try:
                stream = await listener.accept()
            except (OSError, anyio.BrokenResourceError) as exc:
                # Keep serving the connections already open; try again shortly.
                logger.warning("accept failed: %r", exc.__cause__ or exc)
                await anyio.sleep(_ACCEPT_RETRY_S)
                continue
            connections.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, stream: SocketStream) -> None:
        async with stream:
            # anyio sets TCP_NODELAY on accepted sockets today; responses are
            # written whole, so Nagle would only delay them.
            with contextlib.suppress(OSError):
                stream.extra(SocketAttribute.raw_socket).setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
                )
            address = stream.extra(SocketAttribute.remote_address)
            client = (str(address[0]), int(address[1])) if isinstance(address, tuple) else None
            connection = _Connection(self, stream, client)
            self._connections.add(connection)
            try:
                await connection.run()
            except _GONE:
                pass  # the client went away: nothing left to answer
            except Exception:
                # A bug must cost this connection only, never the server.
                logger.exception("connection from %s failed", client)
            finally:
                self._connections.discard(connection)


class _Connection:
    """One client connection: reads requests with h11, answers them in order."""

    __slots__ = (
        "_client",
        "_h11",
        "_limits",
        "_on_timeout",
        "_scope",
        "_server",
        "_stream",
        "is_idle",
    )

    def __init__(self, server: HttpServer, stream: SocketStream, client: tuple[str, int] | None):
        self._server = server
        self._stream = stream
        self._client = client
        self._limits = limits = server._limits
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self._scope = anyio.CancelScope(deadline=anyio.current_time() + limits.header_timeout_s)
        # What to answer if the deadline fires now (None: just close).
        self._on_timeout: Response | None = None
        self.is_idle = False

    def close(self) -> None:
        self._scope.cancel()

    async def run(self) -> None:
        with self._scope:
            last = await self._exchange()
        if self._scope.cancelled_caught:
            last = self._on_timeout
            if last is None:
                return  # idle too long, or closed by shutdown(): nothing to answer
        with anyio.move_on_after(_CLOSING_S):
            if last is not None and self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await self._send(last, is_head=False)
            await self._linger()

    async def _exchange(self) -> Response | None:
        """Answer requests until the connection must close.

        Returns:
            An error response to send before closing, or None.
        """
        h = self._h11
        scope = self._scope
        limits = self._limits
        server = self._server
        while True:
            try:
                event: object = h.next_event()
                if event is h11.NEED_DATA:
                    event = await self._receive_head()
                if type(event) is not h11.Request:
                    return None  # the client closed between requests
                request = await self._read_request(event)
            except h11.RemoteProtocolError as exc:
                if exc.error_status_hint == 431:  # h11's "head too long"
                    return server._head_too_large
                return Response.error(400, "validation_error", f"malformed request: {exc}")
            if type(request) is Response:
                return request
            assert type(request) is Request
            scope.deadline = math.inf
            response = await respond(server._handler, request)
            scope.deadline = anyio.current_time() + limits.keepalive_timeout_s
            await self._send(response, is_head=request.method == "HEAD")
            if h.our_state is h11.MUST_CLOSE:
                return None
            h.start_next_cycle()

    async def _receive_head(self) -> object:
        if self._server._is_closing:
            return None
        self.is_idle = True
        try:
            data = await self._receive()
        finally:
            self.is_idle = False
        h = self._h11
        h.receive_data(data)
        event = h.next_event()
        if event is h11.NEED_DATA:
            # The head has begun: it must now be complete within header_timeout_s.
            self._on_timeout = self._server._head_timed_out
            self._scope.deadline = anyio.current_time() + self._limits.header_timeout_s
            while event is h11.NEED_DATA:
                h.receive_data(await self._receive())
                event = h.next_event()
        return event

    async def _read_request(self, head: h11.Request) -> Request | Response:
        """Read the body of a request whose head has arrived.

        Returns:
            The request, or a 413 response if it is over the limits.
        """
        limits = self._limits
        headers = []
        head_bytes = len(head.method) + len(head.target) + 12
        declared = 0
        for raw_name, raw_value in head.headers.raw_items():
            name = raw_name.decode("latin-1").lower()
            headers.append((name, raw_value.decode("latin-1")))
            head_bytes += len(raw_name) + len(raw_value) + 4
            if name == "content-length":
                declared = int(raw_value)  # h11 has validated it
        # h11 enforces the size of a head only while it is incomplete; one that
        # arrived whole in a single read is measured here.
        if head_bytes > limits.max_header_bytes:
            return self._server._head_too_large
        if declared > limits.max_body_bytes:
            return self._server._body_too_large  # refused before any of it is read
        body = await self._read_body()
        if body is None:
            return self._server._body_too_large
        self._on_timeout = None
        return Request(
            head.method.decode("ascii").upper(),
            head.target.decode("latin-1"),
            tuple(headers),
            body,
            self._client,
        )

    async def _read_body(self) -> bytes | None:
        """The whole body, or None as soon as it grows past `max_body_bytes`."""
        h = self._h11
        limit = self._limits.max_body_bytes
        parts: list[bytes] = []
        size = 0
        is_waiting = False
        while True:
            event = h.next_event()
            if type(event) is h11.Data:
                size += len(event.data)
                if size > limit:
                    return None
                parts.append(event.data)
            elif type(event) is h11.EndOfMessage:
                return b"".join(parts)
            else:
                assert event is h11.NEED_DATA
                if not is_waiting:
                    is_waiting = True
                    self._on_timeout = self._server._body_timed_out
                    self._scope.deadline = anyio.current_time() + self._limits.body_timeout_s
                    if h.they_are_waiting_for_100_continue:
                        continue_ = h11.InformationalResponse(status_code=100, headers=[])
                        await self._stream.send(h.send(continue_) or b"")
                h.receive_data(await self._receive())

    async def _send(self, response: Response, *, is_head: bool) -> None:
        """Write a whole response; HEAD gets the headers a GET would have."""
        h = self._h11
        status = response.status
        try:
            headers, body = encode_response(response, is_head=is_head)
            # Date is required of an origin server with a clock (RFC 9110 §6.6.1);
            # Server is optional and h11 validates every header, so it is left out.
            headers.append((b"date", _http_date(int(time.time()))))
            if self._server._is_closing:
                headers.append(_CLOSE)
            event = h11.Response(
                status_code=status, headers=headers, reason=_REASONS.get(status, b"")
            )
        except (h11.LocalProtocolError, UnicodeEncodeError):
            # A status or header h11 cannot send: the handler's bug, not the client's.
            logger.exception("handler returned an invalid response (status %r)", status)
            return await self._send(INTERNAL_ERROR, is_head=is_head)
        head = h.send(event) or b""
        if body:
            h.send_with_data_passthrough(h11.Data(data=body))
        h.send(h11.EndOfMessage())
        if len(body) > _COALESCE_BYTES:
            await self._stream.send(head)
            await self._stream.send(body)
        else:
            await self._stream.send(head + body)

    async def _receive(self) -> bytes:
        try:
            return await self._stream.receive(_RECEIVE_BYTES)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return b""  # h11 reads b"" as the client closing

    async def _linger(self) -> None:
        """Half-close, then drain the client's leftovers until it closes (RFC 9112 §9.6)."""
        stream = self._stream
        try:
            await stream.send_eof()
            with anyio.move_on_after(_LINGER_S):
                while True:
                    await stream.receive(_RECEIVE_BYTES)
        except _GONE:
            pass

"""A lean HTTP/1.1 client for the agent's calls to our own kernel API.

This module owns the wire path of every kernel call an agent makes (two per durable
step: submit and complete), so it is built for per-request cost, not generality:

- minimal hand-written HTTP/1.1 framing (RFC 9112): requests are one formatted
  string; responses are parsed for status, headers and the three body framings
  (Content-Length, chunked, read-until-close). h11 costs ~40 us per exchange in pure
  Python, about eight times this code, so it is not used on this path;
- a pool of keep-alive anyio TCP streams with TCP_NODELAY, reused LIFO, at most
  ``max_connections`` open; callers beyond that wait for a free one;
- one retry on a fresh connection when a reused idle connection turns out to have
  been closed by the server before any byte of the response arrived;
- one timeout per request covering the pool wait, connect, write and read;
- ``https://`` base URLs over TLS (``anyio.connect_tcp(..., tls=True)``), with the
  system's trusted CAs by default or the caller's ``ssl_context``.

A connection goes back to the pool only after a complete, well-framed response that
allows keep-alive; on any error, timeout or cancellation it is closed. Redirects are
never followed (use httpx for anything beyond our kernel).
"""

from __future__ import annotations

import contextlib
import json
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from socket import IPPROTO_TCP, TCP_NODELAY
from typing import Any, Final
from urllib.parse import urlsplit

import anyio
from anyio.abc import ByteStream, SocketAttribute

from ._http import Handler, Request

__all__ = [
    "ClientResponse",
    "ConnectError",
    "ConnectionLost",
    "HttpClient",
    "HttpClientError",
    "RequestTimeout",
    "TLSError",
]

_READ_SIZE: Final = 65536
_MAX_HEAD: Final = 64 * 1024  # status line plus headers, and chunk-size lines
_LARGE_BODY: Final = 16 * 1024  # above this, send the body without copying it
# Methods whose empty request carries no Content-Length (RFC 9110 §8.6: a user agent
# SHOULD NOT send one when the method does not anticipate content).
_NO_BODY_METHODS: Final = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE", "CONNECT"})
_FRAMING_HEADERS: Final = frozenset({"host", "content-length", "transfer-encoding"})
_TOKEN: Final = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_BAD_VALUE: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # CTLs except HTAB
_BAD_TARGET: Final = re.compile(r"[^\x21-\x7e]")  # a target is visible ASCII only
_CHUNK_SIZE: Final = re.compile(rb"[0-9A-Fa-f]{1,15}")


@dataclass(frozen=True, slots=True)
class ClientResponse:
    """A complete response: status, headers with lower-cased names, and the body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        """Return the value of header `name` (any case), or None if absent.

        Repeated fields are joined with ", ", as RFC 9110 §5.3 allows.
        """
        name = name.lower()
        values = [v for k, v in self.headers if k == name]
        return None if not values else values[0] if len(values) == 1 else ", ".join(values)

    def json(self) -> Any:
        """Return the body decoded as JSON."""
        return json.loads(self.body)


class HttpClientError(Exception):
    """Base class of every error the client raises for a failed request."""


class ConnectError(HttpClientError):
    """Could not open a connection (refused, unreachable, name resolution...)."""


class TLSError(ConnectError):
    """The TLS handshake failed (an untrusted certificate, a name mismatch, a peer
    that does not speak TLS...). Trying again will not help."""


class RequestTimeout(HttpClientError):
    """The request (pool wait, connect, write and read) exceeded its timeout."""


class ConnectionLost(HttpClientError):
    """The peer closed or reset the connection mid-request, or sent a malformed response."""


class _StaleConnection(Exception):
    """A connection failed before any response byte arrived (maybe closed while idle)."""


class _Reader:
    """Buffered reads of one response from one stream; EndOfStream propagates."""

    __slots__ = ("buf", "stream")

    def __init__(self, stream: ByteStream, first: bytes) -> None:
        self.stream = stream
        self.buf = bytearray(first)

    async def response(self, method: str) -> tuple[ClientResponse, bool]:
        """Read the response; return it and whether the connection may be reused."""
        while True:
            head = (await self.until(b"\r\n\r\n", "response head")).decode("latin-1")
            status, headers, is_keep_alive, length, framing = _parse_head(head)
            if status >= 200:
                break
            if status == 101:
                raise ConnectionLost("unexpected 101 Switching Protocols")
            # 1xx interim responses (100 Continue, 103 Early Hints) precede the real one
        if method == "HEAD" or status in (204, 304):  # RFC 9112 §6.3: never a body
            body = b""
        elif length is not None:
            body = await self.exactly(length)
        elif framing == "chunked":
            body = await self.chunked()
        else:
            with contextlib.suppress(anyio.EndOfStream):
                while True:
                    self.buf += await self.stream.receive(_READ_SIZE)
            body, is_keep_alive = bytes(self.buf), False
            self.buf.clear()
        # Bytes past the end of the response mean the framing is not what we think:
        # never reuse such a connection.
        return ClientResponse(status, headers, body), is_keep_alive and not self.buf

    async def until(self, separator: bytes, what: str) -> bytes:
        buf = self.buf
        while (end := buf.find(separator)) < 0:
            if len(buf) > _MAX_HEAD:
                raise ConnectionLost(f"{what} too long")
            buf += await self.stream.receive(_READ_SIZE)
        out = bytes(buf[:end])
        del buf[: end + len(separator)]
        return out

    async def exactly(self, size: int) -> bytes:
        buf = self.buf
        while len(buf) < size:
            buf += await self.stream.receive(_READ_SIZE)
        out = bytes(buf[:size])
        del buf[:size]
        return out

    async def chunked(self) -> bytes:
        body = bytearray()
        while True:
            line = await self.until(b"\r\n", "chunk line")
            size_field = line.split(b";", 1)[0].strip(b" \t")
            if not _CHUNK_SIZE.fullmatch(size_field):
                raise ConnectionLost(f"malformed chunk size {size_field[:40]!r}")
            if (size := int(size_field, 16)) == 0:
                break
            body += await self.exactly(size + 2)
            if body[-2:] != b"\r\n":
                raise ConnectionLost("chunk not followed by CRLF")
            del body[-2:]
        trailer_bytes = 0  # trailer fields are read and ignored
        while line := await self.until(b"\r\n", "trailer section"):
            if (trailer_bytes := trailer_bytes + len(line)) > _MAX_HEAD:
                raise ConnectionLost("trailer section too long")
        return bytes(body)


def _parse_head(head: str) -> tuple[int, tuple[tuple[str, str], ...], bool, int | None, str]:
    """Parse a response head.

    Returns:
        status, headers, whether the connection may be kept alive once the response is
        read, the Content-Length (or None), and the framing: "length", "chunked" or
        "close" (the body runs until the server closes).
    """
    lines = head.split("\r\n")
    status_line, version, code = lines[0], lines[0][:9], lines[0][9:12]
    is_bad = version not in ("HTTP/1.1 ", "HTTP/1.0 ") or status_line[12:13] not in ("", " ")
    if is_bad or not (code.isdigit() and code.isascii()):
        raise ConnectionLost(f"malformed status line {status_line[:80]!r}")
    status = int(code)
    headers: list[tuple[str, str]] = []
    length: int | None = None
    te: str | None = None
    connection = ""
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise ConnectionLost(f"malformed header line {line[:80]!r}")
        value = value.strip(" \t")
        if _BAD_VALUE.search(value):
            raise ConnectionLost(f"control character in header {name!r}")
        name = name.lower()
        headers.append((name, value))
        if name == "content-length":
            for item in value.split(","):
                item = item.strip(" \t")
                if not (item.isdigit() and item.isascii()) or (length not in (None, int(item))):
                    raise ConnectionLost(f"bad content-length {value[:40]!r}")
                length = int(item)
        elif name == "transfer-encoding":
            te = value.lower() if te is None else f"{te}, {value.lower()}"
        elif name == "connection":
            connection = f"{connection},{value.lower()}"
    tokens = {t.strip(" \t") for t in connection.split(",")}
    is_keep_alive = "close" not in tokens and (version == "HTTP/1.1 " or "keep-alive" in tokens)
    framing = "close" if length is None else "length"
    if te is not None:  # RFC 9112 §6.3: Transfer-Encoding overrides Content-Length...
        framing = "chunked" if te.rsplit(",", 1)[-1].strip(" \t") == "chunked" else "close"
        is_keep_alive = is_keep_alive and length is None  # ...and both at once means: close
        length = None
    return status, tuple(headers), is_keep_alive, length, framing


async def _exchange(
    stream: ByteStream, data: bytes, body: bytes, method: str
) -> tuple[ClientResponse, bool]:
    """Send one request and read its response on `stream`.

    Raises:
        _StaleConnection: the stream failed before any response byte arrived.
        ConnectionLost: it failed after that, or the response was malformed.
    """
    try:
        await stream.send(data)
        if body:
            await stream.send(body)
        first = await stream.receive(_READ_SIZE)
    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError) as exc:
        raise _StaleConnection(repr(exc)) from exc
    try:
        # Fast path: the whole response arrived in one read, framed by Content-Length.
        end = first.find(b"\r\n\r\n")
        if end >= 0 and method != "HEAD":
            status, headers, is_keep_alive, length, _ = _parse_head(first[:end].decode("latin-1"))
            if length == len(first) - end - 4 and status >= 200 and status not in (204, 304):
                return ClientResponse(status, headers, first[end + 4 :]), is_keep_alive
        return await _Reader(stream, first).response(method)
    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError) as exc:
        raise ConnectionLost(f"connection lost while reading the response: {exc!r}") from exc


class HttpClient:
    """A pooled keep-alive HTTP/1.1 client for one base URL (our kernel API).

    Args:
        base_url: ``http://host[:port][/prefix]`` or ``https://...`` (port 443 by
            default).
        timeout: seconds allowed per request: pool wait, connect, write and read.
        max_connections: most connections open at once; callers beyond it wait.
        ssl_context: for https, the context that verifies the server (say, one
            that trusts a private CA); default: `ssl.create_default_context()`,
            the system's trusted CAs with host name checking.
        handler: answer every request in process with this HTTP handler instead
            of opening connections (`rebuno_anyio.testing`). The request and its
            answer are the same `Request` and `Response` a server would pass;
            an `HttpClientError` it raises is the client's, as if from the network.

    Raises:
        ValueError: `base_url` is not an http(s) URL with a host, or a limit is invalid.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 35.0,
        max_connections: int = 64,
        ssl_context: ssl.SSLContext | None = None,
        handler: Handler | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(
                f"HttpClient supports only http:// and https:// URLs, got {base_url!r}"
            )
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"invalid port in base URL {base_url!r}") from exc
        if not parts.hostname or parts.username is not None or parts.query or parts.fragment:
            raise ValueError(
                f"base URL must be http(s)://host[:port][/prefix] without credentials, "
                f"query or fragment, got {base_url!r}"
            )
        if _BAD_TARGET.search(parts.path) or _BAD_TARGET.search(parts.netloc):
            raise ValueError(f"base URL has spaces or non-ASCII characters: {base_url!r}")
        if timeout <= 0 or max_connections < 1:
            raise ValueError("timeout must be > 0 and max_connections >= 1")
        self._host = parts.hostname
        self._is_tls = parts.scheme == "https"
        self._port = (443 if self._is_tls else 80) if port is None else port
        self._ssl_context: ssl.SSLContext | None = None
        if self._is_tls:
            # One context per client: building one loads the CA store.
            self._ssl_context = ssl_context or ssl.create_default_context()
        self._prefix = parts.path.rstrip("/")
        self._netloc = parts.netloc
        self._host_line = f"host: {parts.netloc}\r\n"
        self._timeout_s = timeout
        self._idle: list[ByteStream] = []  # LIFO: the most recently used is warmest
        self._slots = anyio.Semaphore(max_connections)
        self._is_closed = False
        self._handler = handler

    def target(self, path: str) -> str:
        """Return the request-target sent for `path`: the base path prefix plus `path`.

        Callers sign this exact string.

        Raises:
            ValueError: `path` does not start with "/" or has spaces or non-ASCII.
        """
        if not path.startswith("/") or _BAD_TARGET.search(path):
            raise ValueError(f"path must start with '/' and be visible ASCII, got {path!r}")
        return self._prefix + path

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> ClientResponse:
        """Send one request and return the complete response (redirects not followed).

        Args:
            method: an HTTP method token, such as "GET" or "POST".
            path: the path (and query) below the base URL, starting with "/".
            headers: extra header fields; Host and Content-Length are ours to send.
            body: the request content.

        Returns:
            The response, whatever its status.

        Raises:
            ValueError: an invalid method, path or header.
            ConnectError: no connection could be opened.
            RequestTimeout: the request took longer than the client's timeout.
            ConnectionLost: the connection broke, or the response was malformed.
            HttpClientError: the client is closed.
        """
        data = self._encode(method, path, headers, body)  # validates, in process too
        if self._handler is not None:
            return await self._in_process(self._handler, method, path, headers, body)
        if len(body) <= _LARGE_BODY:
            data, body = data + body, b""
        if self._is_closed:
            raise HttpClientError("HttpClient is closed")
        # A bare deadline scope: fail_after's generator wrapper costs ~2 us a call.
        with anyio.CancelScope(deadline=anyio.current_time() + self._timeout_s):
            try:
                self._slots.acquire_nowait()
            except anyio.WouldBlock:
                await self._slots.acquire()
            try:
                return await self._send(data, body, method)
            finally:
                self._slots.release()
        # Only reached when our own deadline cancelled the request.
        raise RequestTimeout(f"{method} {path} took longer than {self._timeout_s:g} s")

    async def _in_process(
        self,
        handler: Handler,
        method: str,
        path: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
    ) -> ClientResponse:
        """`request` answered by the in-process handler: no connection, same timeout."""
        if self._is_closed:
            raise HttpClientError("HttpClient is closed")
        request = Request(
            method=method,
            target=self.target(path),
            headers=(("host", self._netloc), *((k.lower(), v) for k, v in headers)),
            body=body,
        )
        with anyio.move_on_after(self._timeout_s):
            response = await handler(request)
            return ClientResponse(
                response.status, tuple((k.lower(), v) for k, v in response.headers), response.body
            )
        raise RequestTimeout(f"{method} {path} took longer than {self._timeout_s:g} s")

    async def _send(self, data: bytes, body: bytes, method: str) -> ClientResponse:
        if self._is_closed:  # closed while we waited for a connection slot
            raise HttpClientError("HttpClient is closed")
        is_reused = bool(self._idle)
        stream = self._idle.pop() if is_reused else await self._connect()
        while True:
            try:
                response, is_reusable = await _exchange(stream, data, body, method)
            except _StaleConnection as exc:
                await anyio.aclose_forcefully(stream)
                if not is_reused:
                    raise ConnectionLost(f"connection lost before the response: {exc}") from exc
                # The server closed this idle keep-alive connection before reading our
                # request: retry once on a fresh connection (RFC 9112 §9.3.1).
                is_reused = False
                stream = await self._connect()
                continue
            except BaseException:  # errors, timeouts, cancellation: never reuse
                await anyio.aclose_forcefully(stream)
                raise
            if is_reusable and not self._is_closed:
                self._idle.append(stream)
            else:
                await anyio.aclose_forcefully(stream)
            return response

    async def _connect(self) -> ByteStream:
        stream: ByteStream
        try:
            if self._ssl_context is None:
                stream = await anyio.connect_tcp(self._host, self._port)
            else:
                # tls_standard_compatible=False: HTTP frames its own messages, so a
                # peer closing without close_notify is an ordinary end of stream (the
                # anyio documentation's advice for HTTP).
                stream = await anyio.connect_tcp(
                    self._host,
                    self._port,
                    tls=True,
                    ssl_context=self._ssl_context,
                    tls_hostname=self._host,
                    tls_standard_compatible=False,
                )
        except ssl.SSLError as exc:  # the handshake itself (an OSError too: test first)
            raise TLSError(f"TLS handshake with {self._host}:{self._port} failed: {exc}") from exc
        except (anyio.BrokenResourceError, anyio.EndOfStream) as exc:  # closed mid-handshake
            raise TLSError(
                f"{self._host}:{self._port} closed the connection during the TLS handshake"
            ) from exc
        except OSError as exc:
            raise ConnectError(f"could not connect to {self._host}:{self._port}: {exc}") from exc
        # anyio's backends set it already today; a request is one write, so Nagle
        # could only delay it.
        stream.extra(SocketAttribute.raw_socket).setsockopt(IPPROTO_TCP, TCP_NODELAY, 1)
        return stream

    def _encode(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> bytes:
        if not _TOKEN.fullmatch(method):
            raise ValueError(f"invalid HTTP method {method!r}")
        lines = [f"{method} {self.target(path)} HTTP/1.1\r\n", self._host_line]
        if body or method not in _NO_BODY_METHODS:
            lines.append(f"content-length: {len(body)}\r\n")
        for name, value in headers:
            if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                raise ValueError(f"invalid header {name!r}: {value!r}")
            if name.lower() in _FRAMING_HEADERS:
                raise ValueError(f"header {name!r} is set by the client")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        try:
            return "".join(lines).encode("latin-1")
        except UnicodeEncodeError as exc:
            raise ValueError(f"header values must be latin-1: {exc}") from exc

    async def aclose(self) -> None:
        """Close idle connections; later requests raise HttpClientError.

        Requests in flight complete, and their connections are closed afterwards.
        """
        self._is_closed = True
        idle, self._idle = self._idle, []
        for stream in idle:
            await anyio.aclose_forcefully(stream)

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

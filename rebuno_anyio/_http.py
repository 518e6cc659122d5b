"""The request and response every HTTP surface is written against.

One handler type, `Handler`, serves both transports: the built-in h11 server
(`rebuno_anyio._server`) and any ASGI server (`rebuno_asgi`). Both turn what
arrived into the same `Request`, call the handler through `respond`, and write
what `encode_response` gives, so the kernel API and the agent webhook are
implemented once and behave the same under either. No sockets here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, TypeAlias
from urllib.parse import parse_qsl

from rebuno_proto import ErrorCode, Refusal, encode_error

__all__ = [
    "INTERNAL_ERROR",
    "Handler",
    "Headers",
    "Request",
    "Response",
    "encode_response",
    "error_body",
    "respond",
]

logger = logging.getLogger(__name__)

Headers: TypeAlias = tuple[tuple[str, str], ...]

_JSON_TYPE: Final = ("content-type", "application/json; charset=utf-8")
# Statuses that carry neither a body nor a Content-Length (RFC 9110 §8.6, §15.4.5).
_NO_BODY: Final = frozenset({204, 304})
# The transports frame every body themselves; a handler's framing headers are dropped.
_FRAMING: Final = frozenset({"content-length", "transfer-encoding"})


@dataclass(frozen=True, slots=True)
class Request:
    """An HTTP request, read whole.

    `target` is the request-target exactly as received (percent-encoding
    untouched), because request signatures cover the raw path and query
    (PROTOCOL.md, agent request signing). Header names are lower-cased, values
    decoded as latin-1, in arrival order with repeats kept.

    `root_path` is the prefix an app is mounted under (ASGI's `root_path`, say
    Starlette's `Mount("/agent", app=...)`), percent-encoded like `path`; the
    target keeps it. Routing uses `route_path`, the path without it.
    """

    method: str
    target: str
    headers: Headers
    body: bytes
    client: tuple[str, int] | None = None
    root_path: str = ""

    @property
    def path(self) -> str:
        """The target without its query string, still percent-encoded."""
        return self.target.partition("?")[0]

    @property
    def route_path(self) -> str:
        """`path` without the `root_path` prefix, when the path starts with it.

        A server that already stripped the prefix from the path is left alone.
        """
        root = self.root_path.rstrip("/")
        path = self.path
        if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
            return path[len(root) :] or "/"
        return path

    @property
    def query(self) -> str:
        """The raw query string without the `?` (empty if there is none)."""
        return self.target.partition("?")[2]

    def header(self, name: str) -> str | None:
        """The first value of a header.

        Args:
            name: the header name, in any case.

        Returns:
            The value, or None if the header is absent.
        """
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def header_values(self, name: str) -> tuple[str, ...]:
        """Every value of a header, in arrival order.

        Args:
            name: the header name, in any case.
        """
        name = name.lower()
        return tuple(value for key, value in self.headers if key == name)

    def query_params(self) -> dict[str, str]:
        """The query string as a dict, percent-decoded; the last value wins."""
        return dict(parse_qsl(self.query, keep_blank_values=True))


@dataclass(frozen=True, slots=True)
class Response:
    """An HTTP response, body included.

    The transports set `content-length` themselves (see `encode_response`);
    header names may use any case.
    """

    status: int
    body: bytes = b""
    headers: Headers = ()

    @classmethod
    def json(cls, status: int, body: bytes, headers: Headers = ()) -> Response:
        """A response whose body is JSON text, with its content type set.

        Args:
            status: the HTTP status.
            body: UTF-8 JSON text.
            headers: more headers, sent after `content-type`.
        """
        return cls(status, body, (_JSON_TYPE, *headers))

    @classmethod
    def empty(cls, status: int = 204) -> Response:
        """A response without a body (204 No Content by default)."""
        return cls(status)

    @classmethod
    def error(cls, status: int, code: str, message: str, headers: Headers = ()) -> Response:
        """A JSON error envelope response (PROTOCOL.md §4.0).

        Args:
            status: the HTTP status.
            code: an envelope code such as `validation_error`.
            message: the human-readable message.
            headers: more headers.

        Raises:
            ValueError: `code` is not one of the protocol's error codes.
        """
        return cls.json(status, error_body(code, message), headers)


Handler: TypeAlias = Callable[[Request], Awaitable[Response]]


def error_body(code: str, message: str) -> bytes:
    """The JSON error envelope `{"code": ..., "message": ...}` (PROTOCOL.md §4.0).

    Args:
        code: an envelope code such as `validation_error` or `internal_error`.
        message: the human-readable message.

    Raises:
        ValueError: `code` is not one of the protocol's error codes.
    """
    return encode_error(Refusal(ErrorCode(code), message))


INTERNAL_ERROR: Final = Response.error(500, "internal_error", "internal server error")


async def respond(handler: Handler, request: Request) -> Response:
    """Run a handler; if it raises, log the exception and answer 500.

    Args:
        handler: the HTTP surface.
        request: the request to answer.

    Returns:
        The handler's response, or `INTERNAL_ERROR`.
    """
    try:
        return await handler(request)
    except Exception:
        logger.exception("handler failed on %s %s", request.method, request.target)
        return INTERNAL_ERROR


def encode_response(
    response: Response, *, is_head: bool = False
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body a transport writes for a response.

    `content-length` is set from the body and replaces any framing header the
    handler gave, except on 204 and 304, which carry neither. A response to HEAD
    keeps the headers a GET would get and loses the body.

    Args:
        response: the handler's response.
        is_head: whether it answers a HEAD request.

    Returns:
        The headers (names and values encoded latin-1) and the body to send.

    Raises:
        UnicodeEncodeError: a header is not latin-1.
    """
    headers = [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in response.headers
        if name.lower() not in _FRAMING
    ]
    if response.status in _NO_BODY:
        return headers, b""
    headers.append((b"content-length", b"%d" % len(response.body)))
    return headers, b"" if is_head else response.body

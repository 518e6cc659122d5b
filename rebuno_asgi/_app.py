"""A `Handler` served as a bare ASGI 3 application.

It owns the translation between ASGI and `rebuno_anyio._http`: an `http` scope
becomes the same `Request` the built-in server builds (raw target, lower-cased
latin-1 headers, client address, plus the `root_path` a host mounted the app
under), the handler's `Response` goes back as
`http.response.start` and `http.response.body`, and the `lifespan` scope enters
and exits an async context manager. No framework is involved, so it runs under
uvicorn, hypercorn (asyncio and trio workers) or any other ASGI server.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Final, TypeAlias, cast
from urllib.parse import quote

from rebuno_anyio._http import Handler, Request, Response, encode_response, respond

__all__ = ["ASGIApp", "Lifespan", "Message", "Receive", "Scope", "Send", "asgi_app"]

logger = logging.getLogger(__name__)

Scope: TypeAlias = Mapping[str, object]
Message: TypeAlias = Mapping[str, object]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
# The server owns the dict it is handed; ASGI servers type it as dict[str, Any].
Send: TypeAlias = Callable[[dict[str, object]], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]
# Whatever the context manager yields is ignored, so any entered type is accepted.
Lifespan: TypeAlias = Callable[[], AbstractAsyncContextManager[object]]

# Characters a percent-encoded path keeps as they are (RFC 3986 pchar and "/").
_PATH_SAFE: Final = "/:@!$&'()*+,;=-._~"


def asgi_app(
    handler: Handler,
    *,
    max_body_bytes: int = 10 * 1024 * 1024,
    lifespan: Lifespan | None = None,
) -> ASGIApp:
    """Serve `handler` as an ASGI 3 application.

    Args:
        handler: the same handler the built-in server calls.
        max_body_bytes: larger request bodies get a 413 envelope as soon as the
            running total passes this, without being read further.
        lifespan: entered on `lifespan.startup`, exited on `lifespan.shutdown`;
            a failure on entry is reported with `lifespan.startup.failed`, one
            on exit with `lifespan.shutdown.failed`. What it yields is unused.

    Returns:
        The ASGI application.
    """
    too_large = Response.error(
        413, "validation_error", f"request body exceeds {max_body_bytes} bytes"
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await _serve_http(handler, max_body_bytes, too_large, scope, receive, send)
        elif kind == "lifespan":
            await _serve_lifespan(lifespan, receive, send)
        elif kind == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1003})
        else:
            raise ValueError(f"unsupported ASGI scope type {kind!r}")

    return app


async def _serve_http(
    handler: Handler,
    max_body_bytes: int,
    too_large: Response,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    raw_headers = cast("Iterable[tuple[bytes, bytes]]", scope["headers"])
    headers = tuple(
        (name.decode("latin-1").lower(), value.decode("latin-1")) for name, value in raw_headers
    )
    method = str(scope["method"]).upper()
    is_head = method == "HEAD"
    declared = next((value for name, value in headers if name == "content-length"), None)
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        await _send(send, too_large, is_head=is_head)  # refused before any of it is read
        return
    parts: list[bytes | bytearray] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return  # the client is gone: nobody to answer
        chunk = message.get("body", b"")
        assert isinstance(chunk, bytes | bytearray)
        size += len(chunk)
        if size > max_body_bytes:
            await _send(send, too_large, is_head=is_head)
            return
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    request = Request(
        method, _target(scope), headers, b"".join(parts), _client(scope), _root_path(scope)
    )
    await _send(send, await respond(handler, request), is_head=is_head)


async def _send(send: Send, response: Response, *, is_head: bool) -> None:
    """Send a whole response; HEAD gets the headers a GET would have, no body."""
    # ASGI wants lower-case header names.
    headers, body = encode_response(response, is_head=is_head)
    headers = [(name.lower(), value) for name, value in headers]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _target(scope: Scope) -> str:
    """The raw request-target: `raw_path` if the server gave one, and the query."""
    raw_path = scope.get("raw_path")
    if isinstance(raw_path, bytes | bytearray) and raw_path:
        # ASGI's raw_path is the path alone; a server that left the query on it
        # would otherwise send it twice.
        path = bytes(raw_path).partition(b"?")[0].decode("latin-1")
    else:
        path = quote(str(scope["path"]), safe=_PATH_SAFE)
    query = scope.get("query_string", b"")
    if isinstance(query, bytes | bytearray) and query:
        return f"{path}?{bytes(query).decode('latin-1')}"
    return path


def _root_path(scope: Scope) -> str:
    """ASGI's `root_path` (the mount prefix), percent-encoded like the target."""
    root_path = scope.get("root_path")
    if not isinstance(root_path, str) or not root_path:
        return ""
    return quote(root_path, safe=_PATH_SAFE)


def _client(scope: Scope) -> tuple[str, int] | None:
    client = scope.get("client")
    if isinstance(client, list | tuple) and len(client) == 2:
        return (str(client[0]), int(client[1]))
    return None


async def _serve_lifespan(lifespan: Lifespan | None, receive: Receive, send: Send) -> None:
    message = await receive()
    assert message["type"] == "lifespan.startup"
    if lifespan is None:
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})
        return
    is_started = False
    try:
        async with lifespan():
            await send({"type": "lifespan.startup.complete"})
            is_started = True
            await receive()  # lifespan.shutdown
    except Exception as exc:
        logger.exception("lifespan %s failed", "shutdown" if is_started else "startup")
        failed = "lifespan.shutdown.failed" if is_started else "lifespan.startup.failed"
        await send({"type": failed, "message": repr(exc)})
        return
    await send({"type": "lifespan.shutdown.complete"})

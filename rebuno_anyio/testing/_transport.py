"""In-memory HTTP: an httpx transport that hands each request to a `Handler`.

The harness's `Client` (bearer routes) and the kernel's dispatcher (webhook
POSTs) are httpx clients; with this transport their requests become the same
`Request` objects the built-in server would build, answered by the kernel API
or the agent's webhook handler directly. No sockets, no ports, but the real
encoding, signing and verification on both sides.
"""

from __future__ import annotations

import httpx

from .._http import Handler, Request

__all__ = ["HandlerTransport"]


class HandlerTransport(httpx.AsyncBaseTransport):
    """An httpx transport answered by an in-process HTTP handler.

    Args:
        handler: the HTTP surface that answers (a `KernelAPI`, say).
    """

    def __init__(self, handler: Handler) -> None:
        self._handler = handler

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        ours = Request(
            method=request.method,
            target=request.url.raw_path.decode("ascii"),
            headers=tuple(
                (name.decode("latin-1").lower(), value.decode("latin-1"))
                for name, value in request.headers.raw
            ),
            body=body,
        )
        answer = await self._handler(ours)
        return httpx.Response(answer.status, headers=list(answer.headers), content=answer.body)

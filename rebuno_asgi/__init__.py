"""rebuno_asgi: the HTTP surfaces as ASGI applications.

`asgi_app` serves any `rebuno_anyio` handler under an ASGI server (uvicorn,
hypercorn, granian...), building the same `Request` the built-in server builds.
"""

from ._app import ASGIApp, Lifespan, Message, Receive, Scope, Send, asgi_app

__all__ = ["ASGIApp", "Lifespan", "Message", "Receive", "Scope", "Send", "asgi_app"]

"""Webhook URLs the dispatcher can actually POST to.

The wire parser (`rebuno_proto.parse_agent_registration`) checks the shape
loosely; a URL that passes it may still be one httpx refuses when the
dispatcher sends the webhook (`http://h:abc/`, `http://[::1/`, a NUL byte).
Registration and the manifest refuse those up front, with the same test the
dispatcher's client applies (`httpx.URL`).
"""

from __future__ import annotations

import httpx

__all__ = ["webhook_url_problem"]


def webhook_url_problem(url: str) -> str | None:
    """What is wrong with `url` as a webhook URL, or `None` if it is usable."""
    bad = next((c for c in url if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c.isspace()), None)
    if bad is not None:
        return f"must not contain whitespace or control characters, got {bad!r} in {url!r}"
    try:
        parsed = httpx.URL(url)
        scheme, host, port = parsed.scheme, parsed.host, parsed.port
    except (httpx.InvalidURL, ValueError, TypeError) as err:  # IDNA errors are ValueErrors
        return f"is not a valid URL ({err}): {url!r}"
    if scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL, got {url!r}"
    if not host:
        return f"has no host: {url!r}"
    if port is not None and not 0 < port < 65536:
        return f"port must be 1-65535, got {port} in {url!r}"
    return None

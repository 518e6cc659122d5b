"""Signatures and tokens (PROTOCOL.md §2). Every comparison is constant-time.

Three forms:

* webhook, kernel to agent: `Rebuno-Signature: sha256=<hex HMAC of the body>`;
* agent request, v1: `v1=<hex HMAC>` over a canonical request that binds the
  method, the raw target, a timestamp and the dispatch lease, then the body;
* agent request, body form: `sha256=<hex HMAC of the body>`, which the seeds
  describe ("signs every request body the same way"). It carries no timestamp,
  so it can be replayed; a server may refuse it (`allow_body_form=False`).

The HMAC key is the agent secret's UTF-8 bytes. Callers pass `now`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MAX_CLOCK_SKEW_S",
    "RequestCheck",
    "SignedHeaders",
    "bearer_matches",
    "check_agent_request",
    "sign_request",
    "sign_webhook",
    "verify_request",
    "verify_webhook",
]

#: The accepted distance between the request timestamp and `now`, both ways.
MAX_CLOCK_SKEW_S: Final = 300
_V1: Final = "v1="
_SHA256: Final = "sha256="
_INT64_MAX: Final = 2**63 - 1


def _hmac_hex(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _utf8(text: str) -> bytes:
    # "surrogatepass": a header an adapter decoded with surrogateescape must
    # fail the check, not raise out of the core.
    return text.encode("utf-8", "surrogatepass")


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(_utf8(a), _utf8(b))


def sign_webhook(secret: bytes, body: bytes) -> str:
    """The `Rebuno-Signature` header value for a webhook body: `sha256=<hex>`."""
    return _SHA256 + _hmac_hex(secret, body)


def verify_webhook(secret: bytes, body: bytes, header: str | None) -> bool:
    """Whether `header` is the `sha256=` signature of `body` under `secret`.

    A missing header, a missing `sha256=` prefix or any other difference is
    `False`; the comparison is constant-time.
    """
    if header is None or not header.startswith(_SHA256):
        return False
    return _same(header, sign_webhook(secret, body))


def _v1_message(
    method: str,
    target: str,
    timestamp: str,
    dispatch_id: str | None,
    attempt: str | None,
    body: bytes,
) -> bytes:
    head = "\n".join(
        ("rebuno-request-v1", method, target, timestamp, dispatch_id or "", attempt or "")
    )
    return _utf8(head + "\n") + body


def sign_request(
    secret: bytes,
    *,
    method: str,
    target: str,
    timestamp: int,
    body: bytes,
    dispatch_id: str | None = None,
    attempt: int | None = None,
) -> str:
    """The `v1=` signature of an agent request (PROTOCOL.md §2.3).

    Args:
        secret: the agent secret, UTF-8 bytes.
        method: the HTTP method, upper case.
        target: the request target exactly as sent: percent-encoded path with
            any base-URL prefix, then `?query` if there is one.
        timestamp: Unix seconds, also sent as `Rebuno-Timestamp`.
        body: the raw body (empty for GET and heartbeat).
        dispatch_id: the lease's dispatch id on lease-carrying calls.
        attempt: the lease's attempt on lease-carrying calls.

    Returns:
        `v1=` followed by 64 lowercase hex digits.
    """
    message = _v1_message(
        method,
        target,
        str(timestamp),
        dispatch_id,
        None if attempt is None else str(attempt),
        body,
    )
    return _V1 + _hmac_hex(secret, message)


class RequestCheck(enum.Enum):
    """Why an agent request was or was not accepted."""

    OK = "ok"
    MISSING_SIGNATURE = "missing Rebuno-Signature"
    BAD_HEADER = "a Rebuno-* header is repeated or contains a line break"
    BAD_TIMESTAMP = "Rebuno-Timestamp is not a base-10 integer"
    STALE_TIMESTAMP = "Rebuno-Timestamp is more than 300 s away from the kernel clock"
    BODY_FORM_REFUSED = "the body-only sha256= signature is not accepted here; sign with v1="
    MISMATCH = "signature does not match"


@dataclass(frozen=True, slots=True, kw_only=True)
class SignedHeaders:
    """The signing headers of one agent request, each as every value it had.

    A header sent twice appears twice; the check refuses that (PROTOCOL.md §2.3).
    """

    signature: tuple[str, ...] = ()
    timestamp: tuple[str, ...] = ()
    dispatch_id: tuple[str, ...] = ()
    attempt: tuple[str, ...] = ()


def _single(values: tuple[str, ...]) -> str | None:
    """The one value of an optional header; raises `ValueError` if repeated or
    containing CR/LF."""
    if not values:
        return None
    if len(values) > 1 or "\r" in values[0] or "\n" in values[0]:
        raise ValueError
    return values[0]


def _parse_int64(text: str) -> int | None:
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    value = int(text)
    return value if -_INT64_MAX - 1 <= value <= _INT64_MAX else None


def check_agent_request(
    secret: bytes,
    *,
    method: str,
    target: str,
    body: bytes,
    headers: SignedHeaders,
    now: float,
    allow_body_form: bool = True,
    max_skew_s: int = MAX_CLOCK_SKEW_S,
) -> RequestCheck:
    """Verify an agent request signed in the `v1=` form or the seeds' body form.

    Args:
        secret: the secret of the agent named by `Rebuno-Agent-Id`.
        method: the request method.
        target: the raw request target as received (path and `?query`).
        body: the raw body.
        headers: the signing headers as received.
        now: the verifier's Unix time in seconds.
        allow_body_form: accept `sha256=` over the body (no timestamp).
        max_skew_s: the accepted timestamp distance from `now`, both ways.

    Returns:
        `RequestCheck.OK`, or the first reason the request fails.
    """
    try:
        signature = _single(headers.signature)
        timestamp = _single(headers.timestamp)
        dispatch_id = _single(headers.dispatch_id)
        attempt = _single(headers.attempt)
    except ValueError:
        return RequestCheck.BAD_HEADER
    if signature is None:
        return RequestCheck.MISSING_SIGNATURE
    if signature.startswith(_SHA256):
        if not allow_body_form:
            return RequestCheck.BODY_FORM_REFUSED
        return RequestCheck.OK if verify_webhook(secret, body, signature) else RequestCheck.MISMATCH
    if timestamp is None or (ts := _parse_int64(timestamp)) is None:
        return RequestCheck.BAD_TIMESTAMP
    # Whole seconds on both sides, as the Go kernel compares Unix times.
    if abs(int(now // 1) - ts) > max_skew_s:
        return RequestCheck.STALE_TIMESTAMP
    expected = _V1 + _hmac_hex(
        secret, _v1_message(method, target, timestamp, dispatch_id, attempt, body)
    )
    return RequestCheck.OK if _same(signature, expected) else RequestCheck.MISMATCH


def verify_request(
    secret: bytes,
    *,
    method: str,
    target: str,
    timestamp: int | str | None,
    body: bytes,
    signature: str | None,
    now: float,
    dispatch_id: str | None = None,
    attempt: int | str | None = None,
    allow_body_form: bool = True,
    max_skew_s: int = MAX_CLOCK_SKEW_S,
) -> bool:
    """Whether an agent request's signature is valid at `now`.

    The `v1=` form is checked against the method, target, timestamp, lease and
    body, and the timestamp must lie within `max_skew_s` of `now` in either
    direction. The seeds' `sha256=` body form is accepted unless
    `allow_body_form` is false. See `check_agent_request` for the reason a
    request fails.
    """

    def values(value: int | str | None) -> tuple[str, ...]:
        return () if value is None else (str(value),)

    return (
        check_agent_request(
            secret,
            method=method,
            target=target,
            body=body,
            headers=SignedHeaders(
                signature=values(signature),
                timestamp=values(timestamp),
                dispatch_id=values(dispatch_id),
                attempt=values(attempt),
            ),
            now=now,
            allow_body_form=allow_body_form,
            max_skew_s=max_skew_s,
        )
        is RequestCheck.OK
    )


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an `Authorization` header carries exactly `Bearer <token>`.

    Exact and constant-time (PROTOCOL.md §10.16); an empty `token` never matches.
    """
    if not token or header is None or not header.startswith("Bearer "):
        return False
    return _same(header[7:], token)

"""Signatures and tokens (PROTOCOL.md §2): the §2.3 examples byte for byte, and
sign/verify properties for the webhook and the v1 request forms."""

import contextlib
import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebuno_proto import (
    MAX_CLOCK_SKEW_S,
    RequestCheck,
    SignedHeaders,
    bearer_matches,
    check_agent_request,
    sign_request,
    sign_webhook,
    verify_request,
    verify_webhook,
)

SECRET = b"dev-secret"
EXECUTION = "0192f1a0-0000-7000-8000-000000000000"
DISPATCH = "0192f1a0-1111-7000-8000-000000000000"
TS = 1760000000
SUBMIT_BODY = (
    b'{"kind": "tool_call", "target": "search", "args": {"q": "x"}, '
    b'"idempotency": "safe_to_retry", "resources": []}'
)
SUBMIT_SIG = "v1=c1d82f9a776d03e9df8759bd9e06ec2a70cf0661594128a037a85dd7df263c7f"
HEARTBEAT_SIG = "v1=6cd717017fde550631adf3bece9d77f2b7d55fcc5c8d8f0657aa9e582b6154cc"
GET_SIG = "v1=eaba3fad5bf0fa62b0f6d3701002831323916dec39892ebbe7cece06b7bbe317"


# -- the three examples of PROTOCOL.md §2.3 -----------------------------------------


def test_v1_example_submit() -> None:
    sig = sign_request(
        SECRET,
        method="POST",
        target=f"/v0/executions/{EXECUTION}/steps",
        timestamp=TS,
        body=SUBMIT_BODY,
        dispatch_id=DISPATCH,
        attempt=1,
    )
    assert sig == SUBMIT_SIG


def test_v1_example_heartbeat() -> None:
    sig = sign_request(
        SECRET,
        method="POST",
        target=f"/v0/executions/{EXECUTION}/heartbeat",
        timestamp=TS,
        body=b"",
        dispatch_id=DISPATCH,
        attempt=1,
    )
    assert sig == HEARTBEAT_SIG


def test_v1_example_get_without_lease() -> None:
    sig = sign_request(
        SECRET, method="GET", target=f"/v0/executions/{EXECUTION}", timestamp=TS, body=b""
    )
    assert sig == GET_SIG


def test_v1_message_layout() -> None:
    """The signed message is the six header lines, a newline, then the body."""
    message = b"rebuno-request-v1\nGET\n/x?a=1\n5\n\n\n"
    expected = "v1=" + hmac.new(SECRET, message, hashlib.sha256).hexdigest()
    assert sign_request(SECRET, method="GET", target="/x?a=1", timestamp=5, body=b"") == expected


@pytest.mark.parametrize(
    ("target", "body", "dispatch_id", "attempt", "signature"),
    [
        (f"/v0/executions/{EXECUTION}/steps", SUBMIT_BODY, DISPATCH, "1", SUBMIT_SIG),
        (f"/v0/executions/{EXECUTION}/heartbeat", b"", DISPATCH, "1", HEARTBEAT_SIG),
        (f"/v0/executions/{EXECUTION}", b"", None, None, GET_SIG),
    ],
)
def test_v1_examples_verify(
    target: str, body: bytes, dispatch_id: str | None, attempt: str | None, signature: str
) -> None:
    method = "GET" if dispatch_id is None else "POST"
    common = {"method": method, "target": target, "body": body, "now": TS + 10}
    assert verify_request(
        SECRET,
        timestamp=str(TS),
        signature=signature,
        dispatch_id=dispatch_id,
        attempt=attempt,
        **common,  # type: ignore[arg-type]
    )
    assert not verify_request(
        b"other-secret",
        timestamp=TS,
        signature=signature,
        dispatch_id=dispatch_id,
        attempt=attempt,
        **common,  # type: ignore[arg-type]
    )


# -- webhook ---------------------------------------------------------------------


def test_webhook_signature_form() -> None:
    body = b'{"execution_id":"x"}'
    expected = "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()
    assert sign_webhook(SECRET, body) == expected
    assert verify_webhook(SECRET, body, expected)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "sha256=",
        "v1=" + "0" * 64,
        "SHA256=" + hmac.new(SECRET, b"{}", hashlib.sha256).hexdigest(),
        hmac.new(SECRET, b"{}", hashlib.sha256).hexdigest(),
        "sha256=" + hmac.new(SECRET, b"{}", hashlib.sha256).hexdigest().upper(),
        "sha256=" + hmac.new(SECRET, b"{}", hashlib.sha256).hexdigest() + " ",
        "sha256=\ud800",
        "sha256=\u00e9",
    ],
)
def test_webhook_rejects(header: str | None) -> None:
    assert not verify_webhook(SECRET, b"{}", header)


@given(st.binary(max_size=64), st.binary(min_size=1, max_size=32))
def test_webhook_sign_verify(body: bytes, secret: bytes) -> None:
    assert verify_webhook(secret, body, sign_webhook(secret, body))


@given(st.binary(min_size=1, max_size=64), st.data())
def test_webhook_any_flipped_body_byte_fails(body: bytes, data: st.DataObject) -> None:
    header = sign_webhook(SECRET, body)
    i = data.draw(st.integers(0, len(body) - 1))
    bit = data.draw(st.integers(0, 7))
    tampered = body[:i] + bytes([body[i] ^ (1 << bit)]) + body[i + 1 :]
    assert not verify_webhook(SECRET, tampered, header)


@given(st.binary(max_size=32), st.data())
def test_webhook_any_flipped_signature_char_fails(body: bytes, data: st.DataObject) -> None:
    header = sign_webhook(SECRET, body)
    i = data.draw(st.integers(0, len(header) - 1))
    replacement = data.draw(st.sampled_from("0123456789abcdef=sS"))
    tampered = header[:i] + replacement + header[i + 1 :]
    assert verify_webhook(SECRET, body, tampered) == (tampered == header)


# -- v1 request: properties --------------------------------------------------------

_methods = st.sampled_from(["GET", "POST", "PUT"])
_targets = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40
).map(lambda t: "/" + t)
_dispatch_ids = st.one_of(st.none(), st.uuids().map(str))
_timestamps = st.integers(min_value=0, max_value=2**40)


def _flip(data: bytes, i: int, bit: int) -> bytes:
    return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :]


@given(
    _methods,
    _targets,
    _timestamps,
    st.binary(max_size=64),
    _dispatch_ids,
    st.integers(min_value=1, max_value=1000),
    st.integers(min_value=-MAX_CLOCK_SKEW_S, max_value=MAX_CLOCK_SKEW_S),
)
def test_request_sign_verify(
    method: str,
    target: str,
    ts: int,
    body: bytes,
    dispatch_id: str | None,
    attempt: int,
    skew: int,
) -> None:
    lease_attempt = None if dispatch_id is None else attempt
    sig = sign_request(
        SECRET,
        method=method,
        target=target,
        timestamp=ts,
        body=body,
        dispatch_id=dispatch_id,
        attempt=lease_attempt,
    )
    assert sig.startswith("v1=")
    assert len(sig) == 67
    assert verify_request(
        SECRET,
        method=method,
        target=target,
        timestamp=ts,
        body=body,
        signature=sig,
        now=ts + skew,
        dispatch_id=dispatch_id,
        attempt=lease_attempt,
    )


@given(
    st.sampled_from(["body", "method", "target", "timestamp", "dispatch_id", "attempt"]),
    st.binary(min_size=1, max_size=64),
    st.data(),
)
def test_request_any_flipped_byte_fails(field: str, body: bytes, data: st.DataObject) -> None:
    fields: dict[str, object] = {
        "method": "POST",
        "target": f"/v0/executions/{EXECUTION}/steps",
        "timestamp": str(TS),
        "body": body,
        "dispatch_id": DISPATCH,
        "attempt": "3",
    }
    sig = sign_request(
        SECRET,
        method="POST",
        target=str(fields["target"]),
        timestamp=TS,
        body=body,
        dispatch_id=DISPATCH,
        attempt=3,
    )
    original = fields[field]
    raw = original if isinstance(original, bytes) else str(original).encode()
    i = data.draw(st.integers(0, len(raw) - 1), label="index")
    bit = data.draw(st.integers(0, 6), label="bit")  # stay in ASCII for text fields
    flipped = _flip(raw, i, bit)
    fields[field] = flipped if field == "body" else flipped.decode("ascii")
    if field == "timestamp":
        # A flipped timestamp is either no longer an integer or a different one.
        ok_if_unchanged = False
        with contextlib.suppress(ValueError):
            ok_if_unchanged = int(str(fields["timestamp"])) == TS
        assert not ok_if_unchanged
    assert not verify_request(
        SECRET,
        method=str(fields["method"]),
        target=str(fields["target"]),
        timestamp=str(fields["timestamp"]),
        body=fields["body"],  # type: ignore[arg-type]
        signature=sig,
        now=TS,
        dispatch_id=str(fields["dispatch_id"]),
        attempt=str(fields["attempt"]),
    )


@given(_timestamps, st.integers(min_value=MAX_CLOCK_SKEW_S + 1, max_value=10**6), st.booleans())
def test_request_outside_window_fails_both_ways(ts: int, distance: int, ahead: bool) -> None:
    sig = sign_request(SECRET, method="GET", target="/v0/x", timestamp=ts, body=b"")
    now = ts + distance if ahead else ts - distance
    headers = SignedHeaders(signature=(sig,), timestamp=(str(ts),))
    check = check_agent_request(
        SECRET, method="GET", target="/v0/x", body=b"", headers=headers, now=now
    )
    assert check is RequestCheck.STALE_TIMESTAMP


# `now` counts in whole seconds, as the Go kernel compares Unix times.
@pytest.mark.parametrize("offset", [-300, 300, -299.5, 299.999, 0, 300.5, 300.999])
def test_request_window_boundary_passes(offset: float) -> None:
    sig = sign_request(SECRET, method="GET", target="/v0/x", timestamp=TS, body=b"")
    assert verify_request(
        SECRET, method="GET", target="/v0/x", timestamp=TS, body=b"", signature=sig, now=TS + offset
    )


@pytest.mark.parametrize("offset", [-300.001, -300.5, 301, -301])
def test_request_window_just_outside_fails(offset: float) -> None:
    sig = sign_request(SECRET, method="GET", target="/v0/x", timestamp=TS, body=b"")
    assert not verify_request(
        SECRET, method="GET", target="/v0/x", timestamp=TS, body=b"", signature=sig, now=TS + offset
    )


def test_request_custom_window() -> None:
    sig = sign_request(SECRET, method="GET", target="/v0/x", timestamp=TS, body=b"")
    args = {"method": "GET", "target": "/v0/x", "timestamp": TS, "body": b"", "signature": sig}
    assert verify_request(SECRET, now=TS + 10, max_skew_s=10, **args)  # type: ignore[arg-type]
    assert not verify_request(SECRET, now=TS + 11, max_skew_s=10, **args)  # type: ignore[arg-type]


# -- body form -----------------------------------------------------------------------


def test_body_form_accepted_by_default() -> None:
    body = b'{"output": 1}'
    sig = sign_webhook(SECRET, body)
    headers = SignedHeaders(signature=(sig,))
    check = check_agent_request(
        SECRET, method="POST", target="/v0/executions/x/complete", body=body, headers=headers, now=0
    )
    assert check is RequestCheck.OK
    # No timestamp is involved: any clock passes.
    assert verify_request(
        SECRET, method="POST", target="/y", timestamp=None, body=body, signature=sig, now=1e12
    )


def test_body_form_refused_when_disallowed() -> None:
    body = b'{"output": 1}'
    headers = SignedHeaders(signature=(sign_webhook(SECRET, body),))
    check = check_agent_request(
        SECRET, method="POST", target="/y", body=body, headers=headers, now=0, allow_body_form=False
    )
    assert check is RequestCheck.BODY_FORM_REFUSED
    assert not verify_request(
        SECRET,
        method="POST",
        target="/y",
        timestamp=None,
        body=body,
        signature=sign_webhook(SECRET, body),
        now=0,
        allow_body_form=False,
    )


def test_body_form_mismatch() -> None:
    headers = SignedHeaders(signature=(sign_webhook(SECRET, b"{}"),))
    check = check_agent_request(
        SECRET, method="POST", target="/y", body=b"{ }", headers=headers, now=0
    )
    assert check is RequestCheck.MISMATCH


@given(st.binary(min_size=1, max_size=64), st.data())
def test_body_form_flipped_byte_fails(body: bytes, data: st.DataObject) -> None:
    sig = sign_webhook(SECRET, body)
    i = data.draw(st.integers(0, len(body) - 1))
    assert not verify_request(
        SECRET,
        method="POST",
        target="/y",
        timestamp=None,
        body=_flip(body, i, data.draw(st.integers(0, 7))),
        signature=sig,
        now=0,
    )


# -- header checks ----------------------------------------------------------------------


def _good_headers(**override: tuple[str, ...]) -> SignedHeaders:
    sig = sign_request(
        SECRET, method="POST", target="/t", timestamp=TS, body=b"", dispatch_id="d", attempt=2
    )
    values: dict[str, tuple[str, ...]] = {
        "signature": (sig,),
        "timestamp": (str(TS),),
        "dispatch_id": ("d",),
        "attempt": ("2",),
    }
    values.update(override)
    return SignedHeaders(**values)


def _check(headers: SignedHeaders, now: float = TS) -> RequestCheck:
    return check_agent_request(
        SECRET, method="POST", target="/t", body=b"", headers=headers, now=now
    )


def test_good_headers_pass() -> None:
    assert _check(_good_headers()) is RequestCheck.OK


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"signature": ()}, RequestCheck.MISSING_SIGNATURE),
        ({"signature": ("v1=00", "v1=00")}, RequestCheck.BAD_HEADER),
        ({"timestamp": (str(TS), str(TS))}, RequestCheck.BAD_HEADER),
        ({"dispatch_id": ("d", "d")}, RequestCheck.BAD_HEADER),
        ({"attempt": ("2", "2")}, RequestCheck.BAD_HEADER),
        ({"timestamp": (f"{TS}\n",)}, RequestCheck.BAD_HEADER),
        ({"dispatch_id": ("d\r",)}, RequestCheck.BAD_HEADER),
        ({"attempt": ("\n2",)}, RequestCheck.BAD_HEADER),
        ({"timestamp": ()}, RequestCheck.BAD_TIMESTAMP),
        ({"timestamp": ("",)}, RequestCheck.BAD_TIMESTAMP),
        ({"timestamp": ("-",)}, RequestCheck.BAD_TIMESTAMP),
        ({"timestamp": ("1.5",)}, RequestCheck.BAD_TIMESTAMP),
        ({"timestamp": ("0x10",)}, RequestCheck.BAD_TIMESTAMP),
        ({"timestamp": ("\u0661\u0662",)}, RequestCheck.BAD_TIMESTAMP),
        ({"timestamp": (str(2**63),)}, RequestCheck.BAD_TIMESTAMP),
        ({"timestamp": (str(-(2**63) - 1),)}, RequestCheck.BAD_TIMESTAMP),
        ({"timestamp": (str(2**63 - 1),)}, RequestCheck.STALE_TIMESTAMP),
        ({"timestamp": (str(-(2**63)),)}, RequestCheck.STALE_TIMESTAMP),
        ({"timestamp": (str(TS + 1),)}, RequestCheck.MISMATCH),
        ({"attempt": ("3",)}, RequestCheck.MISMATCH),
        ({"attempt": ()}, RequestCheck.MISMATCH),
        ({"dispatch_id": ("e",)}, RequestCheck.MISMATCH),
        ({"dispatch_id": ()}, RequestCheck.MISMATCH),
        ({"signature": ("v1=" + "0" * 64,)}, RequestCheck.MISMATCH),
        ({"signature": ("v2=abc",)}, RequestCheck.MISMATCH),
        ({"signature": ("v1=\udcff",)}, RequestCheck.MISMATCH),
    ],
)
def test_header_checks(override: dict[str, tuple[str, ...]], expected: RequestCheck) -> None:
    assert _check(_good_headers(**override)) is expected


def test_signed_timestamp_with_sign_is_accepted_as_sent() -> None:
    """`+<ts>` parses as the same instant, but the message uses the header text."""
    sig = (
        "v1="
        + hmac.new(
            SECRET, f"rebuno-request-v1\nGET\n/t\n+{TS}\n\n\n".encode(), hashlib.sha256
        ).hexdigest()
    )
    headers = SignedHeaders(signature=(sig,), timestamp=(f"+{TS}",))
    assert (
        check_agent_request(SECRET, method="GET", target="/t", body=b"", headers=headers, now=TS)
        is RequestCheck.OK
    )


def test_request_check_messages_say_what_is_wrong() -> None:
    assert "300" in RequestCheck.STALE_TIMESTAMP.value
    assert "repeated" in RequestCheck.BAD_HEADER.value
    assert "v1=" in RequestCheck.BODY_FORM_REFUSED.value


def test_surrogate_in_target_is_a_mismatch_not_a_crash() -> None:
    """Regression: a header decoded with surrogateescape raised UnicodeEncodeError."""
    sig = sign_request(SECRET, method="GET", target="/t", timestamp=TS, body=b"")
    assert not verify_request(
        SECRET, method="GET", target="/t\udcff", timestamp=TS, body=b"", signature=sig, now=TS
    )


# -- bearer -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "token", "expected"),
    [
        ("Bearer tok", "tok", True),
        ("Bearer tok\u00e9", "tok\u00e9", True),
        ("Bearer tok", "tok2", False),
        ("Bearer tok2", "tok", False),
        ("bearer tok", "tok", False),
        ("BEARER tok", "tok", False),
        ("Bearer TOK", "tok", False),
        ("Bearer  tok", "tok", False),
        ("Bearer tok ", "tok", False),
        ("Token tok", "tok", False),
        ("tok", "tok", False),
        ("Bearer ", "", False),
        ("Bearer", "", False),
        (None, "tok", False),
        ("Bearer \ud800", "tok", False),
    ],
)
def test_bearer_matches_exactly(header: str | None, token: str, expected: bool) -> None:
    assert bearer_matches(header, token) is expected


@given(st.text(min_size=1, max_size=30), st.text(max_size=30))
def test_bearer_property(token: str, other: str) -> None:
    assert bearer_matches("Bearer " + token, token)
    assert bearer_matches("Bearer " + other, token) == (other == token)

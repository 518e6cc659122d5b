"""LLM calls as durable steps: `http_client()` and `RebunoTransport` (PROTOCOL.md §9).

`RebunoTransport` is an httpx transport meant to sit under a provider SDK
(`AsyncOpenAI(http_client=http_client())`) or plain httpx. Inside a handler,
every request whose body is a JSON object becomes an `llm_call` step: the whole
parsed body is the step's arguments (its identity) and its `model` the target.

* `proceed`: the request goes to the provider. The answer -- whatever its
  status -- is recorded as `{"status", "headers": {"content-type"}, "body"}`
  and the caller gets a response rebuilt from that record, exactly as a replay
  would show it. A streamed answer is passed through chunk by chunk while live
  deltas go to the kernel, and is recorded whole once it ends.
* `replay`: the provider is not contacted; the recorded response comes back
  (a recorded event stream comes back as a stream).
* refusals (approval pending, policy denial, rate limit, terminal execution,
  lost lease) come back as synthetic provider errors that carry a
  `rebuno_refusal` marker, which `raise_for_refusal` turns back into the
  control-flow exception.

Outside a handler, and for bodies that are not a JSON object (uploads, forms),
the transport is a plain pass-through.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import anyio
import httpx

from ..errors import (
    REFUSAL_TYPE,
    Blocked,
    LeaseSuperseded,
    PolicyError,
    RateLimited,
    Terminated,
    refusal_message,
)
from ._context import ExecutionContext, current

__all__ = ["RebunoTransport", "http_client"]

# Live deltas: flush when this many characters are pending, or this long after
# the last flush; one delta carries at most this many characters (the kernel
# caps a delta at 7000 bytes and a character is at most 4 UTF-8 bytes).
DELTA_FLUSH_CHARS: Final = 2000
DELTA_FLUSH_INTERVAL_S: Final = 0.05
DELTA_MAX_CHARS: Final = 1750
# A recorded event stream is replayed in chunks of this many bytes.
REPLAY_CHUNK_BYTES: Final = 4096

_JSON: Final = "application/json"
_EVENT_STREAM: Final = "text/event-stream"
# The transport-shaping options of httpx.AsyncClient: a client given a
# transport ignores them (and `proxy` would mount a transport that bypasses
# recording), so `http_client` hands them to the inner transport instead.
_TRANSPORT_OPTIONS: Final = ("verify", "cert", "http1", "http2", "limits", "proxy", "trust_env")


def http_client(**kwargs: Any) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` whose requests are recorded as `llm_call` steps.

    Pass it to a provider SDK (`AsyncOpenAI(http_client=http_client())`) or use
    it directly. Keyword arguments go to `httpx.AsyncClient` (`base_url`,
    `timeout`, `headers`...), with three adjustments so that nothing bypasses
    the recording:

    * `verify`, `cert`, `http1`, `http2`, `limits`, `proxy` configure the
      inner `httpx.AsyncHTTPTransport` (`trust_env` goes to both);
    * `transport=` becomes the inner transport (it is wrapped, not replaced);
    * each transport in `mounts=` is wrapped in a `RebunoTransport` too.

    Proxies from the environment (`HTTPS_PROXY`...) are not applied; pass
    `proxy=` explicitly.
    """
    inner: httpx.AsyncBaseTransport | None = kwargs.pop("transport", None)
    options = {key: kwargs.pop(key) for key in _TRANSPORT_OPTIONS if key in kwargs}
    if "trust_env" in options:
        kwargs["trust_env"] = options["trust_env"]
    if inner is None:
        inner = httpx.AsyncHTTPTransport(**options)
    elif options.keys() - {"trust_env"}:
        names = ", ".join(sorted(options.keys() - {"trust_env"}))
        raise TypeError(f"configure {names} on the transport you pass, not next to transport=")
    mounts: Mapping[str, httpx.AsyncBaseTransport | None] | None = kwargs.pop("mounts", None)
    if mounts is not None:
        kwargs["mounts"] = {
            pattern: None if mounted is None else RebunoTransport(mounted)
            for pattern, mounted in mounts.items()
        }
    return httpx.AsyncClient(transport=RebunoTransport(inner), **kwargs)


class RebunoTransport(httpx.AsyncBaseTransport):
    """An httpx transport that records LLM requests as durable `llm_call` steps.

    Args:
        inner: the transport that talks to the provider (default: a new
            `httpx.AsyncHTTPTransport()`).
    """

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._inner = inner if inner is not None else httpx.AsyncHTTPTransport()

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        ctx = current()
        if ctx is None:
            return await self._inner.handle_async_request(request)
        body = _json_object(await request.aread())
        if body is None:
            return await self._inner.handle_async_request(request)
        try:
            step_id, decision = await ctx.begin_llm(str(body.get("model") or ""), body)
        except (Blocked, PolicyError, RateLimited, Terminated, LeaseSuperseded) as refusal:
            return _refusal_response(request, refusal)
        if decision.get("decision") == "replay":  # a replayed error was raised above
            return _rebuild(request, decision.get("result"))
        return await self._forward(
            ctx, step_id, request, stream_requested=body.get("stream") is True
        )

    async def _forward(
        self, ctx: ExecutionContext, step_id: str, request: httpx.Request, *, stream_requested: bool
    ) -> httpx.Response:
        """Run a `proceed` step: send the request and record what comes back.

        A request that gets no response at all (connection refused, timeout
        before the head) is not recorded: the error propagates and the step,
        `safe_to_retry`, runs again on a later attempt.
        """
        response = await self._inner.handle_async_request(request)
        content_type = response.headers.get("content-type")
        if response.status_code < 400 and (stream_requested or _is_event_stream(content_type)):
            tee = _TeeStream(ctx, step_id, response, content_type or _EVENT_STREAM)
            return httpx.Response(
                response.status_code,
                headers={"content-type": tee.content_type},
                stream=tee,
                request=request,
            )
        try:
            await response.aread()
        except Exception as err:
            await ctx.fail_step_quietly(step_id, err)
            raise
        finally:
            await response.aclose()
        record = {
            "status": response.status_code,
            "headers": {"content-type": content_type or _JSON},
            "body": response.text,
        }
        await ctx.record_llm(step_id, record)
        return _rebuild(request, record)


class _TeeStream(httpx.AsyncByteStream):
    """The provider's streamed body, passed through to the consumer while it is
    accumulated and published as live deltas.

    The step is recorded once: at the end of the body, or when the consumer
    closes the response first (with what arrived until then). An error while
    reading fails the step instead. A cancelled consumer records nothing: the
    step stays open and runs again on a later attempt.
    """

    def __init__(
        self, ctx: ExecutionContext, step_id: str, response: httpx.Response, content_type: str
    ) -> None:
        self._ctx = ctx
        self._step_id = step_id
        self._response = response
        self.content_type = content_type
        self._source: AsyncIterator[bytes] | None = None
        self._decoder = codecs.getincrementaldecoder(response.encoding or "utf-8")("replace")
        self._parts: list[str] = []
        self._pending: list[str] = []
        self._pending_chars = 0
        self._seq = 0
        self._last_flush = 0.0
        self._flush_due = False
        self._finished = False
        self._is_closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._source is None:
            if self._finished:
                raise StopAsyncIteration
            # Decoded bytes: the response handed out carries no content-encoding.
            self._source = self._response.aiter_bytes()
            self._last_flush = anyio.current_time()
        if self._flush_due:
            await self._flush()
        try:
            chunk = await self._source.__anext__()
        except StopAsyncIteration:
            await self._finish()
            raise
        except Exception as err:
            await self._fail(err)
            raise
        self._take(self._decoder.decode(chunk))
        self._flush_due = (
            self._pending_chars >= DELTA_FLUSH_CHARS
            or anyio.current_time() - self._last_flush >= DELTA_FLUSH_INTERVAL_S
        )
        return chunk

    async def aclose(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        try:
            await self._finish()
        finally:
            source, self._source = self._source, None
            try:
                if source is not None and hasattr(source, "aclose"):
                    await source.aclose()
            finally:
                await self._response.aclose()

    def _take(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._pending.append(text)
            self._pending_chars += len(text)

    async def _flush(self) -> None:
        self._flush_due = False
        self._last_flush = anyio.current_time()
        text = "".join(self._pending)
        self._pending.clear()
        self._pending_chars = 0
        for start in range(0, len(text), DELTA_MAX_CHARS):
            seq, self._seq = self._seq, self._seq + 1
            await self._ctx.publish_delta(self._step_id, seq, text[start : start + DELTA_MAX_CHARS])

    async def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if anyio.current_effective_deadline() == -math.inf:
            return  # cancelled mid-stream: a partial body is no result to keep
        self._take(self._decoder.decode(b"", final=True))
        if self._pending:
            await self._flush()
        record = {
            "status": self._response.status_code,
            "headers": {"content-type": self.content_type},
            "body": "".join(self._parts),
        }
        await self._ctx.record_llm(self._step_id, record)

    async def _fail(self, err: Exception) -> None:
        if self._finished:
            return
        self._finished = True
        await self._ctx.fail_step_quietly(self._step_id, err)


class _ReplayStream(httpx.AsyncByteStream):
    """A recorded event stream, handed out again in fixed-size chunks."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._offset = 0

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._offset >= len(self._data):
            raise StopAsyncIteration
        start = self._offset
        self._offset += REPLAY_CHUNK_BYTES
        return self._data[start : self._offset]


def _json_object(content: bytes) -> dict[str, Any] | None:
    """The body as a dict, or None if it is empty, not strict JSON, or not an object."""
    if not content:
        return None
    try:
        parsed = json.loads(content, parse_constant=_reject_constant)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        return None
    return parsed if isinstance(parsed, dict) else None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _charset(content_type: str) -> str:
    """The charset a content type declares, if Python knows it; else UTF-8.

    The recorded body is text decoded with it, so it is encoded back with it.
    """
    for param in content_type.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            try:
                return codecs.lookup(value.strip().strip('"')).name
            except LookupError:
                break
    return "utf-8"


def _is_event_stream(content_type: str | None) -> bool:
    return (content_type or "").partition(";")[0].strip().lower() == _EVENT_STREAM


_REFUSALS: Final[dict[type[Exception], tuple[int, str]]] = {
    Blocked: (403, "blocked"),
    PolicyError: (403, "denied"),
    RateLimited: (429, "rate_limited"),
    Terminated: (403, "execution_terminal"),
    LeaseSuperseded: (409, "lease_superseded"),
}


def _refusal_response(
    request: httpx.Request,
    refusal: Blocked | PolicyError | RateLimited | Terminated | LeaseSuperseded,
) -> httpx.Response:
    """A refusal dressed as a provider error (PROTOCOL.md §9 step 4).

    The marker is in the body, where provider SDKs put it into their exception
    messages, and in the reason phrase, where `httpx.HTTPStatusError` (whose
    message has no body) shows it. The phrase ends with a line break so that
    `raise_for_refusal` reads the reason up to it and not the URL after it.
    `x-should-retry: false` stops the openai and anthropic SDKs from retrying
    a refusal as if it were a provider's 409 or 429.
    """
    status, decision = next(value for cls, value in _REFUSALS.items() if isinstance(refusal, cls))
    reason = refusal.reason if isinstance(refusal, PolicyError | RateLimited) else ""
    message = refusal_message(decision, reason)
    phrase = " ".join(message.split()).encode("ascii", "backslashreplace") + b"\n"
    return httpx.Response(
        status,
        headers={"x-should-retry": "false"},  # provider SDKs would retry a 409 or 429
        json={"error": {"type": REFUSAL_TYPE, "message": message}},
        extensions={"reason_phrase": phrase},
        request=request,
    )


def _rebuild(request: httpx.Request, record: Any) -> httpx.Response:
    """The response a record stands for: status, content-type and body only
    (no length or encoding headers, which would not match the rebuilt body)."""
    if not isinstance(record, dict):
        content = json.dumps(record).encode("utf-8")
        return httpx.Response(
            200, headers={"content-type": _JSON}, content=content, request=request
        )
    status = record.get("status", 200)
    if not isinstance(status, int) or isinstance(status, bool):
        status = 200
    headers = record.get("headers")
    content_type = _JSON
    if isinstance(headers, dict):
        for name, value in headers.items():
            if str(name).lower() == "content-type" and value:
                content_type = str(value)
    body = record.get("body", "")
    text = body if isinstance(body, str) else json.dumps(body)
    data = text.encode(_charset(content_type), "replace")
    if _is_event_stream(content_type):
        return httpx.Response(
            status,
            headers={"content-type": content_type},
            stream=_ReplayStream(data),
            request=request,
        )
    return httpx.Response(
        status, headers={"content-type": content_type}, content=data, request=request
    )

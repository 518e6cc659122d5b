"""The agent's signed calls to the kernel (PROTOCOL.md §2.3, §2.4, §4.2).

On the hot path of every durable step (submit, then complete), so it rides the
lean h11 client (`rebuno_anyio._h11client`) with pooled keep-alive connections
instead of httpx. Every request is signed: `v1=` by default (method, raw target,
timestamp, lease and body), or the seeds' body-only `sha256=` form on request.
Any status >= 300 raises the exception its envelope `code` names.

A request whose connection is refused (the kernel restarting, say) was certainly
not received, so it is sent again with a short exponential backoff for up to
`min(timeout, 30)` seconds in all; a failure that remains -- still refused, a
timeout, a connection lost mid-request -- raises `KernelUnreachable`.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from typing import Any, Final, Literal

import anyio

from rebuno_proto import Lease, sign_request, sign_webhook

from .._h11client import ConnectError, HttpClient, HttpClientError, TLSError
from .._http import Handler
from ..errors import KernelUnreachable, NotFoundError, error_from_body

__all__ = ["KernelClient", "Signing", "encode_json"]

Signing = Literal["v1", "body"]
_JSON_HEADER: Final = ("Content-Type", "application/json")
# Retrying a refused connection: the first pause, the longest, and the most time
# spent on one call in all (never more than the client's timeout).
RETRY_FIRST_S: Final = 0.05
RETRY_MAX_S: Final = 1.0
RETRY_BUDGET_S: Final = 30.0


def encode_json(value: Any, what: str = "value") -> bytes:
    """JSON bytes of `value`, or `TypeError` saying it cannot be recorded.

    NaN and infinities are refused too: they are not JSON and the kernel would
    reject them.
    """
    try:
        return json.dumps(value, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as err:
        raise TypeError(f"{what} must be JSON-serializable: {err}") from None


class KernelClient:
    """Signed agent requests to one kernel.

    Args:
        agent_id: sent as `Rebuno-Agent-Id`.
        secret: the agent secret (the HMAC key is its UTF-8 bytes).
        base_url: the kernel's URL (a path prefix is kept and signed).
        timeout: seconds per request.
        signing: `"v1"` (default) or `"body"` (the seeds' `sha256=` body form).
        ssl_context: for an `https://` kernel, the context that verifies it (a
            private CA, say); default: the system's trusted CAs.
        transport: an in-process HTTP handler that answers every request
            instead of the network (`rebuno_anyio.testing` passes the kernel's).
        clock: Unix seconds for the `v1` signature's timestamp (a test kernel's
            clock, so both sides agree on the time).
    """

    def __init__(
        self,
        *,
        agent_id: str,
        secret: str,
        base_url: str,
        timeout: float = 35.0,
        signing: Signing = "v1",
        ssl_context: ssl.SSLContext | None = None,
        transport: Handler | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if signing not in ("v1", "body"):
            raise ValueError(f"signing must be 'v1' or 'body', got {signing!r}")
        self.agent_id = agent_id
        self._secret = secret.encode("utf-8")
        self._signing = signing
        self._http = HttpClient(
            base_url, timeout=timeout, ssl_context=ssl_context, handler=transport
        )
        self._clock = clock
        self._retry_budget_s = min(timeout, RETRY_BUDGET_S)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _headers(
        self, method: str, path: str, body: bytes, lease: Lease | None
    ) -> list[tuple[str, str]]:
        headers = [_JSON_HEADER, ("Rebuno-Agent-Id", self.agent_id)]
        if lease is not None:
            headers.append(("Rebuno-Dispatch-Id", lease.dispatch_id))
            headers.append(("Rebuno-Dispatch-Attempt", str(lease.attempt)))
        if self._signing == "v1":
            timestamp = int(self._clock())
            headers.append(("Rebuno-Timestamp", str(timestamp)))
            signature = sign_request(
                self._secret,
                method=method,
                target=self._http.target(path),
                timestamp=timestamp,
                body=body,
                dispatch_id=None if lease is None else lease.dispatch_id,
                attempt=None if lease is None else lease.attempt,
            )
        else:
            signature = sign_webhook(self._secret, body)
        headers.append(("Rebuno-Signature", signature))
        return headers

    async def _call(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        lease: Lease | None = None,
        *,
        retry: bool = True,
    ) -> bytes:
        """Send a signed request; return the body of a 2xx answer.

        Raises:
            KernelUnreachable: no answer (see the module docstring); with
                `retry=False` a refused connection is not retried.
            RebunoError: the exception the error envelope's `code` names.
        """
        deadline: float | None = None  # set at the first refusal: the hot path skips it
        pause = RETRY_FIRST_S
        while True:
            headers = self._headers(method, path, body, lease)  # a fresh timestamp each time
            try:
                response = await self._http.request(method, path, headers=headers, body=body)
                break
            except TLSError as err:
                raise KernelUnreachable(f"{method} {path}: {err}") from err
            except ConnectError as err:
                # Refused: the kernel never saw the request, so sending it again is safe.
                now = anyio.current_time()
                if deadline is None:
                    deadline = now + self._retry_budget_s
                remaining = deadline - now
                if not retry or remaining <= 0:
                    raise KernelUnreachable(f"{method} {path}: {err}") from err
                await anyio.sleep(min(pause, remaining))
                pause = min(pause * 2, RETRY_MAX_S)
            except HttpClientError as err:
                raise KernelUnreachable(f"{method} {path}: {err}") from err
        if response.status >= 300:
            try:
                parsed = json.loads(response.body) if response.body else None
            except ValueError:
                parsed = None
            raise error_from_body(response.status, parsed, response.body.decode("utf-8", "replace"))
        return response.body

    # -- reads ---------------------------------------------------------------------

    async def get_execution(self, execution_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(await self._call("GET", f"/v0/executions/{execution_id}"))
        return data

    async def previous_state(self, execution_id: str) -> Any:
        body = await self._call("GET", f"/v0/executions/{execution_id}/previous")
        return json.loads(body)["state"]

    async def get_step(self, execution_id: str, step_id: str) -> dict[str, Any] | None:
        try:
            body = await self._call("GET", f"/v0/executions/{execution_id}/steps/{step_id}")
        except NotFoundError:
            return None
        data: dict[str, Any] = json.loads(body)
        return data

    async def set_metadata(
        self,
        *,
        description: str | None,
        input_schema: dict[str, Any] | None,
        output_schema: dict[str, Any] | None,
    ) -> None:
        body = encode_json(
            {
                "description": description,
                "input_schema": input_schema,
                "output_schema": output_schema,
            },
            "agent metadata",
        )
        await self._call("PUT", f"/v0/agents/{self.agent_id}/metadata", body)

    # -- lease-carrying mutations ------------------------------------------------------

    async def submit_step(
        self,
        execution_id: str,
        lease: Lease,
        *,
        kind: str,
        target: str,
        args: Any,
        idempotency: str,
    ) -> dict[str, Any]:
        """Ask the kernel to decide a step; returns the decision object."""
        body = (
            b'{"kind": '
            + json.dumps(kind).encode()
            + b', "target": '
            + json.dumps(target).encode()
            + b', "args": '
            + encode_json(args, "step arguments")
            + b', "idempotency": '
            + json.dumps(idempotency).encode()
            + b', "resources": []}'
        )
        decision: dict[str, Any] = json.loads(
            await self._call("POST", f"/v0/executions/{execution_id}/steps", body, lease)
        )
        return decision

    async def complete_step(
        self, execution_id: str, step_id: str, lease: Lease, *, result: Any
    ) -> None:
        await self.complete_step_json(
            execution_id, step_id, lease, result=encode_json(result, "step result")
        )

    async def complete_step_json(
        self, execution_id: str, step_id: str, lease: Lease, *, result: bytes
    ) -> None:
        """Record a step's result, given as JSON bytes already."""
        body = b'{"result": ' + result + b"}"
        await self._call(
            "POST", f"/v0/executions/{execution_id}/steps/{step_id}/complete", body, lease
        )

    async def fail_step(self, execution_id: str, step_id: str, lease: Lease, *, error: Any) -> None:
        body = encode_json({"error": error}, "step error")
        await self._call("POST", f"/v0/executions/{execution_id}/steps/{step_id}/fail", body, lease)

    async def stream_delta(
        self, execution_id: str, step_id: str, lease: Lease, *, seq: int, data: str
    ) -> None:
        body = encode_json({"seq": seq, "data": data})
        # Best effort: a live delta is not worth holding the stream up for a retry.
        await self._call(
            "POST",
            f"/v0/executions/{execution_id}/steps/{step_id}/stream",
            body,
            lease,
            retry=False,
        )

    async def heartbeat(self, execution_id: str, lease: Lease) -> None:
        await self._call("POST", f"/v0/executions/{execution_id}/heartbeat", b"", lease)

    async def complete_execution(
        self, execution_id: str, lease: Lease, *, output: bytes, state: bytes | None = None
    ) -> None:
        """Complete with `output` (and session `state`), both already JSON bytes
        (the agent checks they serialize before it decides to complete)."""
        body = b'{"output": ' + output + (b"" if state is None else b', "state": ' + state) + b"}"
        await self._call("POST", f"/v0/executions/{execution_id}/complete", body, lease)

    async def fail_execution(self, execution_id: str, lease: Lease, *, reason: str) -> None:
        body = encode_json({"error": reason})
        await self._call("POST", f"/v0/executions/{execution_id}/fail", body, lease)

"""`Client`: the caller's side of the kernel (create, inspect, cancel, wait;
approvals; agent registration and policies), with Bearer auth.

Built on httpx. Errors are raised by the envelope's `code` (PROTOCOL.md §4.0);
connection failures and timeouts become `NetworkError`.
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import httpx

from .errors import NetworkError, RebunoError, error_from_body
from .types import Agent, Approval, Event, Execution, ExecutionPage, Step

__all__ = ["Client"]

_List = list  # `Client.list` shadows the builtin inside the class body


class Client:
    """An HTTP client for the kernel's client and admin routes.

    Args:
        base_url: the kernel's URL; defaults to `REBUNO_URL`.
        api_key: the bearer token; defaults to `REBUNO_API_KEY` (none in dev mode).
        timeout: seconds per request.
        transport: an httpx transport (tests pass an ASGI transport).

    Raises:
        ValueError: no URL was given and `REBUNO_URL` is unset.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 35.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        url = base_url or os.environ.get("REBUNO_URL", "")
        if not url:
            raise ValueError("Client needs the kernel URL: pass base_url= or set REBUNO_URL")
        self.base_url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("REBUNO_API_KEY", "")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._timeout = timeout
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    close = aclose

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except (httpx.TransportError, httpx.TimeoutException) as err:
            raise NetworkError(
                f"{method} {self.base_url}{path}: {str(err) or type(err).__name__}"
            ) from err
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = None
            raise error_from_body(response.status_code, body, response.text)
        return response

    # -- executions -------------------------------------------------------------

    async def create(
        self,
        agent_id: str,
        input: Any = None,
        *,
        session: str = "",
        idempotency_key: str = "",
    ) -> Execution:
        """Start an execution of `agent_id` with `input` (any JSON value).

        With `session`, it continues the agent's last completed execution in that
        session; with `idempotency_key`, a repeat returns the first execution.
        """
        body: dict[str, Any] = {"agent_id": agent_id}
        if input is not None:
            body["input"] = input
        if session:
            body["session"] = session
        if idempotency_key:
            body["idempotency_key"] = idempotency_key
        response = await self._request("POST", "/v0/executions", json=body)
        return Execution.model_validate(response.json())

    async def get(self, execution_id: str) -> Execution:
        response = await self._request("GET", f"/v0/executions/{execution_id}")
        return Execution.model_validate(response.json())

    async def list(
        self, *, agent_id: str = "", status: str = "", limit: int = 50, cursor: str = ""
    ) -> ExecutionPage:
        """A page of executions, newest first; pass `next_cursor` for the next."""
        params: dict[str, Any] = {"limit": limit}
        for key, value in (("agent_id", agent_id), ("status", status), ("cursor", cursor)):
            if value:
                params[key] = value
        response = await self._request("GET", "/v0/executions", params=params)
        return ExecutionPage.model_validate(response.json())

    async def events(
        self, execution_id: str, *, after_seq: int = 0, limit: int = 100, wait: float = 0
    ) -> _List[Event]:
        """Events after `after_seq`. With `wait` (seconds, at most 30), the
        kernel holds the request until the first new event or the wait ends."""
        params: dict[str, Any] = {"limit": limit}
        if after_seq:
            params["after_seq"] = after_seq
        extra: dict[str, Any] = {}
        if wait:
            params["wait"] = int(min(max(wait, 1), 30))
            # The kernel holds the request up to `wait` s: allow for it on top.
            extra["timeout"] = self._timeout + params["wait"]
        response = await self._request(
            "GET", f"/v0/executions/{execution_id}/events", params=params, **extra
        )
        return [Event.model_validate(e) for e in response.json() or []]

    async def cancel(self, execution_id: str) -> None:
        """Cancel; raises `Terminated` if the execution already ended."""
        await self._request("POST", f"/v0/executions/{execution_id}/cancel")

    async def wait(
        self,
        execution_id: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - a bound for scripts; fail_after works too
    ) -> Execution:
        """Wait until the execution is completed, failed or cancelled.

        Follows the event log with long polls (no busy loop), then returns the
        final execution.

        Raises:
            TimeoutError: `timeout` seconds passed first.
        """
        after = 0
        with anyio.fail_after(timeout):
            while True:
                execution = await self.get(execution_id)
                if execution.is_terminal:
                    return execution
                events = await self.events(execution_id, after_seq=after, limit=1000, wait=25)
                if events:
                    after = events[-1].event_seq

    async def list_steps(self, execution_id: str, *, status: str = "") -> _List[Step]:
        params = {"status": status} if status else {}
        response = await self._request("GET", f"/v0/executions/{execution_id}/steps", params=params)
        return [Step.model_validate(s) for s in response.json() or []]

    async def get_step(self, execution_id: str, step_id: str) -> Step:
        response = await self._request("GET", f"/v0/executions/{execution_id}/steps/{step_id}")
        return Step.model_validate(response.json())

    # -- approvals ----------------------------------------------------------------

    async def list_approvals(
        self, *, status: str = "pending", limit: int | None = None
    ) -> _List[Approval]:
        """Approvals with `status` (`pending`, `granted`, `denied`, `expired` or
        `all`), oldest first; `limit` (kernel default 100, at most 1000)."""
        params: dict[str, Any] = {"status": status}
        if limit is not None:
            params["limit"] = limit
        response = await self._request("GET", "/v0/approvals", params=params)
        return [Approval.model_validate(a) for a in response.json() or []]

    async def get_approval(self, approval_id: str) -> Approval:
        response = await self._request("GET", f"/v0/approvals/{approval_id}")
        return Approval.model_validate(response.json())

    async def _decide(self, verb: str, approval_id: str, decided_by: str, rationale: str) -> None:
        body: dict[str, str] = {"rationale": rationale}
        if decided_by:
            body["decided_by"] = decided_by
        await self._request("POST", f"/v0/approvals/{approval_id}/{verb}", json=body)

    async def grant_approval(
        self, approval_id: str, *, decided_by: str = "", rationale: str = ""
    ) -> None:
        await self._decide("grant", approval_id, decided_by, rationale)

    async def deny_approval(
        self, approval_id: str, *, decided_by: str = "", rationale: str = ""
    ) -> None:
        await self._decide("deny", approval_id, decided_by, rationale)

    # -- agents and policies (admin) ------------------------------------------------

    async def register_agent(self, agent_id: str, *, webhook_url: str, secret: str) -> Agent:
        body = {"id": agent_id, "webhook_url": webhook_url, "secret": secret}
        response = await self._request("POST", "/v0/agents", json=body)
        return Agent.model_validate(response.json())

    async def list_agents(self) -> _List[Agent]:
        response = await self._request("GET", "/v0/agents")
        return [Agent.model_validate(a) for a in response.json() or []]

    async def get_agent(self, agent_id: str) -> Agent:
        response = await self._request("GET", f"/v0/agents/{agent_id}")
        return Agent.model_validate(response.json())

    async def delete_agent(self, agent_id: str) -> None:
        await self._request("DELETE", f"/v0/agents/{agent_id}")

    async def load_policy(self, agent_id: str, bundle: str) -> None:
        """Replace the agent's policy bundle (YAML text); invalid bundles raise
        `ValidationError` naming the rule and field."""
        await self._request("POST", f"/v0/policies/{agent_id}", json={"bundle": bundle})

    async def show_policy(self, agent_id: str) -> str | None:
        response = await self._request("GET", f"/v0/policies/{agent_id}")
        bundle = response.json().get("bundle")
        if bundle is not None and not isinstance(bundle, str):
            raise RebunoError("kernel returned a policy bundle that is not text")
        return bundle

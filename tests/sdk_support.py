"""Helpers for the SDK tests (tests/test_sdk_*.py).

- `served`: an `Agent` serving in the test's own event loop against the
  in-process kernel, registered so that its metadata can land at start.
- `KernelSpy`: records every call the agent makes to the kernel, by method
  name, and lets a test wait for one (no sleeping).
- `Sink`: a webhook URL that catches the kernel's deliveries, so a test can
  hand them to the agent itself: twice, late, or out of order.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx
from kernels import InProcessKernel

from rebuno_anyio import Agent, Client
from rebuno_anyio._http import Request, Response
from rebuno_anyio._server import HttpServer
from rebuno_anyio.types import Event, Step
from rebuno_proto import sign_webhook

AGENT_ID = "sdk-agent"
SECRET = "sdk-secret"
# Where an agent is registered before it listens: nothing answers there.
PARKED = "http://127.0.0.1:9/webhook"
KERNEL_METHODS = (
    "get_execution",
    "previous_state",
    "set_metadata",
    "submit_step",
    "complete_step",
    "fail_step",
    "heartbeat",
    "complete_execution",
    "fail_execution",
)


@dataclass
class Served:
    agent: Agent
    webhook_url: str


@asynccontextmanager
async def served(
    k: InProcessKernel,
    process: Callable[..., Any],
    *,
    agent: Agent | None = None,
    policy: str | None = None,
    deliver: bool = True,
) -> AsyncIterator[Served]:
    """Serve `process` and register the agent with the kernel.

    The agent is registered (at `PARKED`) before it starts, so the metadata it
    publishes at start has a record to land on; then its webhook URL is set,
    unless `deliver` is false (the test routes deliveries itself). Leaving the
    block stops the agent like a crash: handlers are cancelled mid-flight.
    """
    agent = agent or Agent(AGENT_ID, secret=SECRET, base_url=k.url)
    await k.register(agent.agent_id, PARKED, SECRET, policy=policy)
    async with anyio.create_task_group() as tg:
        port = await tg.start(partial(agent.serve, process, host="127.0.0.1", port=0))
        url = f"http://127.0.0.1:{port}{agent.webhook_path}"
        if deliver:
            await set_webhook(k, agent.agent_id, url)
        yield Served(agent, url)
        tg.cancel_scope.cancel()


async def set_webhook(k: InProcessKernel, agent_id: str, url: str) -> None:
    """Point the agent's registration at `url`, keeping its metadata and policy."""
    assert await k.running.kernel.update_agent(agent_id, webhook_url=url) is not None


class KernelSpy:
    """Wraps an agent's kernel client: records `(method, outcome)` per call."""

    def __init__(self, agent: Agent) -> None:
        self.calls: list[tuple[str, str]] = []
        self._changed = anyio.Event()
        kernel = agent._kernel
        for name in KERNEL_METHODS:
            setattr(kernel, name, self._wrap(name, getattr(kernel, name)))

    def _wrap(self, name: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def spied(*args: Any, **kwargs: Any) -> Any:
            outcome = "ok"
            try:
                return await call(*args, **kwargs)
            except BaseException as err:
                outcome = type(err).__name__
                raise
            finally:
                self.calls.append((name, outcome))
                self._changed.set()
                self._changed = anyio.Event()

        return spied

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def count(self, name: str, outcome: str | None = None) -> int:
        return sum(1 for n, o in self.calls if n == name and outcome in (None, o))

    async def wait_for(self, name: str, count: int = 1, outcome: str | None = None) -> None:
        """Wait until `name` has returned (or raised `outcome`) `count` times."""
        while self.count(name, outcome) < count:
            await self._changed.wait()


@dataclass(frozen=True)
class Delivery:
    body: bytes
    signature: str

    @property
    def payload(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.body)
        return data


class Sink:
    """A webhook URL that records the kernel's deliveries and answers 200."""

    def __init__(self) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[Delivery](100)
        self.url = ""

    async def _handle(self, request: Request) -> Response:
        self._send.send_nowait(Delivery(request.body, request.header("rebuno-signature") or ""))
        return Response(200)

    async def next(self) -> Delivery:
        return await self._receive.receive()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Sink]:
        async with anyio.create_task_group() as tg:
            port = await tg.start(HttpServer(self._handle).serve)
            self.url = f"http://127.0.0.1:{port}/webhook"
            yield self
            tg.cancel_scope.cancel()
        self._send.close()
        self._receive.close()


def signed(body: bytes, secret: str = SECRET) -> dict[str, str]:
    return {"Rebuno-Signature": sign_webhook(secret.encode(), body)}


def webhook_body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


async def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST a webhook to an agent (as the kernel would, or not)."""
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(url, content=body, headers=headers or {})


async def steps(client: Client, execution_id: str) -> list[Step]:
    found: list[Step] = await client.list_steps(execution_id)
    return found


async def events(client: Client, execution_id: str) -> list[Event]:
    found: list[Event] = await client.events(execution_id, limit=1000)
    return found


def attempts(log: list[Event], kind: str = "dispatch.acked") -> list[int]:
    """The `attempt` of each dispatch event of `kind`, in order."""
    return [int(e.payload["attempt"]) for e in log if e.type == kind]

"""The agent in real processes and real servers.

- Kill and restart: an agent process (tests/agents/sdk_replay_agent.py, on
  asyncio or on trio) is SIGKILLed mid-run; a new one on the same webhook URL
  gets the re-delivery once the lease lapses, replays the recorded steps
  without running their bodies again, and completes.
- `agent.app` under uvicorn (asyncio) and under hypercorn's trio worker, each
  in its own thread with its own event loop: a full execution through each,
  and the lifespan closes the agent's kernel client.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.to_thread
import hypercorn
import hypercorn.trio
import hypercorn.typing
import pytest
import uvicorn
from kernels import inprocess_kernel
from procs import AgentProc, Kernel, free_port, reap
from sdk_support import AGENT_ID, SECRET

from rebuno_anyio import Agent, Client, execution, step, tool

SCRIPT = Path(__file__).resolve().parent / "agents" / "sdk_replay_agent.py"


# -- kill and restart ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_killed_agent_restarts_and_replays(tmp_path: Path, backend: str) -> None:
    port = free_port()  # the webhook URL stays the same across the restart
    counter = tmp_path / "bodies.txt"
    kernel = Kernel(tmp_path / "kernel.db", lease_timeout=2)
    try:
        kernel.register(AGENT_ID, f"http://127.0.0.1:{port}/webhook", SECRET)
        env = {
            "REBUNO_URL": kernel.url,
            "REBUNO_AGENT_SECRET": SECRET,
            "SDK_AGENT_BACKEND": backend,
        }
        first = AgentProc(SCRIPT, str(port), str(counter), env={**env, "SDK_AGENT_HANG": "1"})
        try:
            status, created = kernel.call(
                "POST", "/v0/executions", {"agent_id": AGENT_ID, "input": {"x": 4}}
            )
            assert status == 201, created
            first.wait_for(r"HANGING 1")
        finally:
            reap(first)  # SIGKILL: no cleanup, nothing reported
        assert counter.read_text().split() == ["first", "second", "token"]

        second = AgentProc(SCRIPT, str(port), str(counter), env=env)
        try:
            assert second.port == port
            final = kernel.wait_terminal(created["id"], timeout=30)
        finally:
            reap(second)
        _, recorded = kernel.call("GET", f"/v0/executions/{created['id']}/steps")
        acked = [
            e["payload"]["attempt"]
            for e in kernel.events(created["id"])
            if e["type"] == "dispatch.acked"
        ]
    finally:
        reap(kernel)

    assert final["status"] == "completed", final.get("failure_reason")
    # Only `third` ran on the second attempt: the rest replayed.
    assert counter.read_text().split() == ["first", "second", "token", "third"]
    token = next(s["result"] for s in recorded if s["target"] == "token")
    assert final["output"] == {"a": 5, "b": 50, "c": 49, "token": token, "attempt": acked[-1]}
    assert acked[0] == 1
    assert acked[-1] >= 2
    assert sorted((s["kind"], s["target"], s["status"]) for s in recorded) == [
        ("local", "token", "succeeded"),
        ("tool_call", "first", "succeeded"),
        ("tool_call", "second", "succeeded"),
        ("tool_call", "third", "succeeded"),
    ]


# -- agent.app under ASGI servers ------------------------------------------------------------------


@tool
async def double(n: int) -> int:
    return n * 2


async def app_process(n: int) -> dict[str, Any]:
    doubled = await double(n)
    plus = await step("plus_one", lambda x: x + 1, {"x": doubled})
    return {"result": plus, "execution": execution().id}


def make_agent(url: str) -> Agent:
    """Built outside any event loop, as a module-level agent would be."""
    agent = Agent(AGENT_ID, secret=SECRET, base_url=url)
    agent.bind(app_process)
    return agent


@contextmanager
def listening_socket() -> Iterator[socket.socket]:
    """A bound, listening socket to hand to the server: requests sent before the
    server accepts wait in its backlog, so nobody has to wait for readiness."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


async def full_execution(client: Client) -> tuple[str, Any]:
    created = await client.create(AGENT_ID, {"n": 20})
    final = await client.wait(created.id, timeout=15)
    assert final.status == "completed", final.failure_reason
    assert final.output == {"result": 41, "execution": created.id}
    return final.status, final.output


@pytest.mark.anyio
async def test_agent_app_under_uvicorn() -> None:
    with anyio.fail_after(30):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = await anyio.to_thread.run_sync(make_agent, k.url)
            config = uvicorn.Config(
                agent.app, lifespan="on", log_level="warning", loop="asyncio", http="h11", ws="none"
            )
            server = uvicorn.Server(config)
            with listening_socket() as sock:
                await k.register(
                    AGENT_ID, f"http://127.0.0.1:{sock.getsockname()[1]}/webhook", SECRET
                )
                thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
                thread.start()
                try:
                    await full_execution(client)
                    assert not agent._kernel._http._is_closed
                finally:
                    server.should_exit = True
                    await anyio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()
    assert agent._kernel._http._is_closed  # the lifespan closed the kernel client


@pytest.mark.anyio
async def test_agent_app_under_hypercorn_trio_worker() -> None:
    stop = threading.Event()

    async def shutdown_trigger() -> None:
        await anyio.to_thread.run_sync(stop.wait)

    with anyio.fail_after(30):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = await anyio.to_thread.run_sync(make_agent, k.url)
            with listening_socket() as sock:
                await k.register(
                    AGENT_ID, f"http://127.0.0.1:{sock.getsockname()[1]}/webhook", SECRET
                )
                config = hypercorn.Config()
                config.loglevel = "WARNING"
                config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns and closes it now
                app = cast("hypercorn.typing.ASGIFramework", agent.app)
                main = functools.partial(
                    hypercorn.trio.serve, app, config, shutdown_trigger=shutdown_trigger
                )
                thread = threading.Thread(
                    target=anyio.run, args=(main,), kwargs={"backend": "trio"}
                )
                thread.start()
                try:
                    await full_execution(client)
                    assert not agent._kernel._http._is_closed
                finally:
                    stop.set()
                    await anyio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()
    assert agent._kernel._http._is_closed

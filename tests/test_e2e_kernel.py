"""End to end: the kernel and agents over real HTTP.

First with the kernel in its own process (`rebuno dev`) and agents as their own
processes: a whole execution, a failing one, and a re-delivery after an agent
is SIGKILLed mid-run (the lease lapses, a new agent process gets the same
dispatch as attempt 2, recorded steps replay). Then the built-in server and the
dispatcher in process, on asyncio and on trio (the kernel runs on the test's
backend), with agents of this SDK served in the same event loop.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from kernels import inprocess_kernel
from procs import AgentProc, Kernel, reap, running

from rebuno_anyio import Agent, Client, step, tool

SCRIPT = Path(__file__).resolve().parent / "agents" / "counter_agent.py"
SECRET = "e2e-secret"
LEASE_S = 2


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    """One `rebuno dev` for the module; each test uses its own agent id."""
    proc = Kernel(tmp_path_factory.mktemp("e2e") / "rebuno.db", lease_timeout=LEASE_S)
    try:
        yield proc
    finally:
        assert reap(proc, graceful=True) == 0, "\n".join(proc.lines[-20:])


def start_agent(
    kernel: Kernel, agent_id: str, counter: Path, backend: str = "asyncio"
) -> AgentProc:
    # Registered first (its URL is not known yet), so that the agent's metadata,
    # published as it starts, is accepted; a re-registration keeps it.
    kernel.register(agent_id, "http://127.0.0.1:9/not-yet", SECRET)
    agent = AgentProc(SCRIPT, agent_id, kernel.url, SECRET, str(counter), backend)
    kernel.register(agent_id, agent.webhook_url, SECRET)
    return agent


def create(kernel: Kernel, agent_id: str, input: Any) -> str:
    status, body = kernel.call("POST", "/v0/executions", {"agent_id": agent_id, "input": input})
    assert status == 201, body
    return str(body["id"])


def lines(counter: Path) -> list[str]:
    return counter.read_text("utf-8").splitlines() if counter.exists() else []


def step_events(n: int) -> list[str]:
    return ["step.proposed", "step.allowed", "step.executing", "step.succeeded"] * n


def test_whole_execution(kernel: Kernel, tmp_path: Path) -> None:
    counter = tmp_path / "count"
    with running(start_agent(kernel, "e2e-whole", counter)):
        execution_id = create(kernel, "e2e-whole", {"tag": "whole", "n": 3})
        done = kernel.wait_terminal(execution_id)
    assert done["status"] == "completed", done
    output = done["output"]
    assert output["tag"] == "whole"
    assert output["total"] == 0 + 1 + 4
    assert output["done"] == "whole:5"
    assert lines(counter) == ["whole work 0", "whole work 1", "whole work 2", "whole finish"]
    events = kernel.events(execution_id)
    assert [e["type"] for e in events] == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
        "dispatch.acked",
        *step_events(5),
        "execution.completed",
    ]
    assert [e["event_seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["payload"]["output"] == output
    status, steps = kernel.call("GET", f"/v0/executions/{execution_id}/steps")
    assert status == 200
    assert sorted((s["kind"], s["target"]) for s in steps) == [
        ("local", "token"),
        ("tool_call", "finish"),
        ("tool_call", "work"),
        ("tool_call", "work"),
        ("tool_call", "work"),
    ]
    assert all(s["status"] == "succeeded" for s in steps)
    token = next(s for s in steps if s["target"] == "token")
    assert token["result"] == output["token"]
    assert token["args"] == {}
    works = sorted((s for s in steps if s["target"] == "work"), key=lambda s: s["args"]["i"])
    assert [s["result"] for s in works] == [{"i": i, "square": i * i} for i in range(3)]
    assert [s["args"] for s in works] == [{"tag": "whole", "i": i} for i in range(3)]
    # The agent described itself (PUT .../metadata) and the re-registration kept it.
    status, agent = kernel.call("GET", "/v0/agents/e2e-whole")
    assert status == 200
    assert agent["webhook_url"].endswith("/webhook")
    assert set(agent["input_schema"]["properties"]) == {"tag", "n", "gate", "fail"}
    assert agent["input_schema"]["required"] == ["tag"]


def test_failing_tool_fails_the_execution(kernel: Kernel, tmp_path: Path) -> None:
    counter = tmp_path / "count"
    with running(start_agent(kernel, "e2e-fail", counter, backend="trio")):
        execution_id = create(kernel, "e2e-fail", {"tag": "bad", "n": 1, "fail": True})
        done = kernel.wait_terminal(execution_id)
    assert done["status"] == "failed"
    assert done["failure_reason"].startswith("tool_error: explode")
    assert "bad went wrong" in done["failure_reason"]
    assert lines(counter) == ["bad work 0", "bad explode"]
    types = [e["type"] for e in kernel.events(execution_id)]
    assert types[-3:] == ["step.executing", "step.failed", "execution.failed"]


def test_redelivery_after_the_agent_is_killed(kernel: Kernel, tmp_path: Path) -> None:
    counter, gate = tmp_path / "count", tmp_path / "gate"
    with running(start_agent(kernel, "e2e-redo", counter)) as first:
        execution_id = create(kernel, "e2e-redo", {"tag": "redo", "n": 3, "gate": str(gate)})
        first.wait_for("at gate redo")
        assert lines(counter) == ["redo work 0", "redo work 1", "redo work 2"]
        before = kernel.events(execution_id)
        steps_before = kernel.call("GET", f"/v0/executions/{execution_id}/steps")[1]
        # The replacement listens elsewhere; the kernel learns its URL while the
        # first agent still holds (and renews) the lease.
        with running(start_agent(kernel, "e2e-redo", counter, backend="trio")) as second:
            first.kill()  # SIGKILL: no goodbye, the lease just stops being renewed
            gate.touch()
            done = kernel.wait_terminal(execution_id, timeout=30)
            second.wait_for("at gate redo")
    assert done["status"] == "completed", done
    # Recorded steps replayed: every work body ran once, across both processes.
    assert lines(counter) == ["redo work 0", "redo work 1", "redo work 2", "redo finish"]
    assert done["output"]["pid"] == second.popen.pid
    token = next(s for s in steps_before if s["target"] == "token")
    assert done["output"]["token"] == token["result"]
    events = kernel.events(execution_id)
    assert events[: len(before)] == before
    dispatches = [
        (e["type"], e["payload"]["attempt"], e["payload"]["dispatch_id"])
        for e in events
        if e["type"].startswith("dispatch.")
    ]
    dispatch_id = dispatches[0][2]
    assert dispatches == [
        ("dispatch.queued", 0, dispatch_id),
        ("dispatch.acked", 1, dispatch_id),
        ("dispatch.queued", 1, dispatch_id),  # the lease lapsed: same dispatch, re-queued
        ("dispatch.acked", 2, dispatch_id),
    ]
    # After the lapse nothing ran twice: the replay added only the gate's tail.
    tail = [e["type"] for e in events[len(before) :] if not e["type"].startswith("dispatch.")]
    assert tail == [*step_events(1), "execution.completed"]


def test_agent_url_change_and_unreachable_agent_backoff(kernel: Kernel, tmp_path: Path) -> None:
    """An agent that is not there: deliveries fail with backoff, then a
    registered agent gets the next attempt of the same dispatch."""
    counter = tmp_path / "count"
    kernel.register("e2e-late", "http://127.0.0.1:9/webhook", SECRET)  # nothing listens there
    execution_id = create(kernel, "e2e-late", {"tag": "late", "n": 1})
    after = 0
    while True:  # follow the log until the first failed delivery
        status, events = kernel.call(
            "GET", f"/v0/executions/{execution_id}/events?after_seq={after}&wait=10"
        )
        assert status == 200
        assert events, "no event within 10 s"
        after = events[-1]["event_seq"]
        if any(e["type"] == "dispatch.failed" for e in events):
            break
    with running(start_agent(kernel, "e2e-late", counter)):
        done = kernel.wait_terminal(execution_id, timeout=30)
    assert done["status"] == "completed", done
    attempts = [
        (e["type"], e["payload"]["attempt"])
        for e in kernel.events(execution_id)
        if e["type"] in ("dispatch.failed", "dispatch.acked")
    ]
    assert attempts[0] == ("dispatch.failed", 1)
    assert attempts[-1][0] == "dispatch.acked"
    assert attempts[-1][1] >= 2
    assert all(kind == "dispatch.failed" for kind, _ in attempts[:-1])
    assert lines(counter) == ["late work 0", "late finish"]


def test_a_stored_url_httpx_refuses_does_not_stop_the_kernel(tmp_path: Path) -> None:
    """A webhook URL stored before registration checked it (here written into
    the database between two runs) fails each delivery; the kernel keeps
    serving, across a restart too, and exits cleanly."""
    db = tmp_path / "legacy.db"
    with running(Kernel(db)) as first:
        first.register("legacy", "http://127.0.0.1:9/webhook", SECRET)
        status, body = first.call(
            "POST",
            "/v0/agents",
            {"id": "legacy", "webhook_url": "http://h:abc/", "secret": SECRET},
        )
        assert status == 400, body
        assert "webhook_url" in body["message"], body
        assert reap(first, graceful=True) == 0
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE agents SET webhook_url = 'http://h:abc/' WHERE id = 'legacy'")
    conn.close()
    for _ in range(2):  # and again after a restart
        with running(Kernel(db, extra=["--max-attempts", "2", "--backoff-base", "0"])) as proc:
            execution_id = create(proc, "legacy", {"n": 1})
            done = proc.wait_terminal(execution_id, timeout=30)
            assert done["failure_reason"] == "dispatch_exhausted", done
            assert proc.call("GET", "/v0/health") == (200, {"status": "ok"})
            assert reap(proc, graceful=True) == 0, "\n".join(proc.lines[-20:])
            assert not any("Traceback" in line for line in proc.lines), proc.lines


# -- in process, on asyncio and on trio ------------------------------------------------------

INPROC_SECRET = "inproc-secret"
ran: list[str] = []


@tool
async def double(x: int) -> int:
    ran.append(f"double {x}")
    return 2 * x


async def inproc_process(xs: list[int]) -> dict[str, Any]:
    doubled = [await double(x) for x in xs]
    nonce = await step("nonce", lambda: os.urandom(4).hex())
    return {"doubled": doubled, "nonce": nonce}


@pytest.mark.anyio
async def test_inprocess_kernel_and_agent(anyio_backend: str) -> None:
    ran.clear()
    async with inprocess_kernel() as kernel:
        agent = Agent("inproc", secret=INPROC_SECRET, base_url=kernel.url)
        async with anyio.create_task_group() as tg:
            port = await tg.start(
                functools.partial(agent.serve, inproc_process, host="127.0.0.1", port=0)
            )
            await kernel.register("inproc", f"http://127.0.0.1:{port}/webhook", INPROC_SECRET)
            async with Client(kernel.url) as client:
                ids = [(await client.create("inproc", {"xs": [i, i + 1]})).id for i in range(3)]
                with anyio.fail_after(20):
                    done = [await client.wait(i) for i in ids]
                for i, execution in enumerate(done):
                    assert execution.status == "completed", execution
                    assert execution.output["doubled"] == [2 * i, 2 * i + 2]
                    steps = await client.list_steps(execution.id)
                    assert len(steps) == 3
                    nonce = next(s for s in steps if s.kind == "local")
                    assert nonce.result == execution.output["nonce"]
                events = await client.events(ids[0], limit=1000)
                assert events[-1].type == "execution.completed"
                agent_record = await client.get_agent("inproc")
                assert agent_record.id == "inproc"
            tg.cancel_scope.cancel()
    assert sorted(ran) == sorted(f"double {x}" for i in range(3) for x in (i, i + 1))


@pytest.mark.anyio
async def test_inprocess_redelivery_after_the_agent_goes_away(anyio_backend: str) -> None:
    """The first agent stops mid-run (its server and handler cancelled, no more
    heartbeats); the lease lapses and the second agent finishes the execution
    replaying what the first recorded."""
    bodies: list[str] = []
    reached = anyio.Event()

    @tool("count_it")
    async def count_it(i: int) -> int:
        bodies.append(f"count {i}")
        return i

    def make_process(blocking: bool) -> Any:
        async def process(n: int) -> int:
            total = sum([await count_it(i) for i in range(n)])
            if blocking:
                reached.set()
                await anyio.sleep_forever()
            return total

        return process

    async with (
        inprocess_kernel(lease_timeout_s=1.0, poll_interval_s=0.2) as kernel,
        Client(kernel.url) as client,
        anyio.create_task_group() as outer,
    ):
        first = Agent("redo", secret=INPROC_SECRET, base_url=kernel.url)
        scope = anyio.CancelScope()

        async def serve_first(*, task_status: Any) -> None:
            with scope:
                await first.serve(
                    make_process(True), host="127.0.0.1", port=0, task_status=task_status
                )

        port = await outer.start(serve_first)
        await kernel.register("redo", f"http://127.0.0.1:{port}/webhook", INPROC_SECRET)
        created = await client.create("redo", {"n": 3})
        with anyio.fail_after(20):
            await reached.wait()
            assert bodies == ["count 0", "count 1", "count 2"]
            second = Agent("redo", secret=INPROC_SECRET, base_url=kernel.url)
            port2 = await outer.start(
                functools.partial(second.serve, make_process(False), host="127.0.0.1", port=0)
            )
            await kernel.register("redo", f"http://127.0.0.1:{port2}/webhook", INPROC_SECRET)
            scope.cancel()  # the first agent is gone
            done = await client.wait(created.id)
        assert done.status == "completed"
        assert done.output == 3
        assert bodies == ["count 0", "count 1", "count 2"]
        acked = [
            e.payload["attempt"]
            for e in await client.events(created.id, limit=1000)
            if e.type == "dispatch.acked"
        ]
        assert acked == [1, 2]
        outer.cancel_scope.cancel()


@pytest.mark.anyio
async def test_inprocess_kernel_on_sqlite_file(anyio_backend: str, tmp_path: Path) -> None:
    """The SQLite store's worker threads under the test's backend."""
    async with inprocess_kernel(db=str(tmp_path / "k.db")) as kernel:
        await kernel.register("sq", "http://127.0.0.1:9/webhook", "s")
        async with Client(kernel.url) as client:
            ids = []
            async with anyio.create_task_group() as tg:

                async def make(i: int) -> None:
                    ids.append((await client.create("sq", {"i": i})).id)

                for i in range(20):
                    tg.start_soon(make, i)
            page = await client.list(agent_id="sq", limit=200)
            assert sorted(e.id for e in page.executions) == sorted(ids)
            await client.cancel(ids[0])
            assert (await client.get(ids[0])).status == "cancelled"
    # Reopened: everything is still there.
    async with (
        inprocess_kernel(db=str(tmp_path / "k.db")) as kernel,
        Client(kernel.url) as client,
    ):
        page = await client.list(agent_id="sq", limit=200)
        assert len(page.executions) == 20
        assert (await client.get(ids[0])).status == "cancelled"
        events = await client.events(ids[0], limit=1000)
        assert json.loads(events[-1].model_dump_json())["type"] == "execution.cancelled"

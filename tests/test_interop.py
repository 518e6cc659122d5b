"""Interoperability with the published `rebuno` SDK (0.29.2, from PyPI).

An agent written with the published SDK (`tests/agents/published_agent.py`,
served by its own `Agent.run` on uvicorn) runs unchanged against `rebuno dev`:
executions complete with the right output; SIGKILLed mid-run, a new process
replays the recorded steps without running their bodies again; approvals,
denials and sessions work. The published `rebuno.Client` drives our kernel
(on asyncio and on trio) and raises the exceptions our error envelopes name.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import rebuno
from kernels import inprocess_kernel
from procs import PYTHON, Kernel, Proc, free_port, reap, running

from rebuno_anyio import Agent, Client, step, tool

SCRIPT = Path(__file__).resolve().parent / "agents" / "published_agent.py"
SECRET = "interop-secret"
LEASE_S = 2

POLICY = """\
default_action: allow
rules:
  - id: hold-shouting
    priority: 1
    when:
      target: shout
      arguments: {text: {equals: hold}}
    then:
      decision: require_approval
      approval_config: {approvers: [carol], message: "let it shout?"}
  - id: quiet-please
    priority: 2
    when:
      target: shout
      arguments: {text: {equals: quiet}}
    then: {decision: deny, reason: library rules}
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    proc = Kernel(tmp_path_factory.mktemp("interop") / "rebuno.db", lease_timeout=LEASE_S)
    try:
        yield proc
    finally:
        assert reap(proc, graceful=True) == 0, "\n".join(proc.lines[-20:])


def published_agent(kernel: Kernel, agent_id: str, counter: Path) -> Proc:
    """Start the published SDK's agent on a free port; register its webhook."""
    port = free_port()
    # Registered before it starts, as with a manifest: the agent publishes its
    # metadata at startup.
    kernel.register(agent_id, f"http://127.0.0.1:{port}/webhook", SECRET)
    proc = Proc([PYTHON, str(SCRIPT), agent_id, kernel.url, SECRET, str(counter), str(port)])
    try:
        proc.wait_for(rf"Uvicorn running on http://127\.0\.0\.1:{port}")
    except BaseException:
        reap(proc)
        raise
    return proc


def create(kernel: Kernel, agent_id: str, input: Any, **fields: Any) -> str:
    body = {"agent_id": agent_id, "input": input, **fields}
    status, created = kernel.call("POST", "/v0/executions", body)
    assert status == 201, created
    return str(created["id"])


def runs(counter: Path) -> Counter[str]:
    return Counter(counter.read_text("utf-8").splitlines() if counter.exists() else [])


def test_published_agent_completes_executions(kernel: Kernel, tmp_path: Path) -> None:
    counter = tmp_path / "count"
    with running(published_agent(kernel, "pub-run", counter)):
        ids = {
            tag: create(kernel, "pub-run", {"tag": tag, "n": n}) for tag, n in (("a", 2), ("b", 3))
        }
        done = {tag: kernel.wait_terminal(execution_id) for tag, execution_id in ids.items()}
    for tag, n in (("a", 2), ("b", 3)):
        execution = done[tag]
        assert execution["status"] == "completed", execution
        output = execution["output"]
        assert output["tag"] == tag
        assert output["cubes"] == [i**3 for i in range(n)]
        assert output["loud"] == tag.upper()
        status, steps = kernel.call("GET", f"/v0/executions/{ids[tag]}/steps")
        assert status == 200
        assert sorted((s["kind"], s["target"], s["status"]) for s in steps) == sorted(
            [("tool_call", "lookup", "succeeded")] * n
            + [("local", "pick", "succeeded"), ("tool_call", "shout", "succeeded")]
        )
        pick = next(s for s in steps if s["target"] == "pick")
        assert pick["result"] == output["pick"]
        assert pick["args"] == {}
        types = [e["type"] for e in kernel.events(ids[tag])]
        assert types[:4] == [
            "execution.created",
            "execution.started",
            "dispatch.queued",
            "dispatch.acked",
        ]
        assert types[-1] == "execution.completed"
        assert types.count("step.succeeded") == n + 2
    assert runs(tmp_path / "count") == Counter(
        ["a lookup 0", "a lookup 1", "a shout", "b lookup 0", "b lookup 1", "b lookup 2", "b shout"]
    )
    # The published agent described itself to the kernel (PUT .../metadata).
    status, agent = kernel.call("GET", "/v0/agents/pub-run")
    assert status == 200
    assert agent["description"] == "interop agent"
    assert set(agent["input_schema"]["properties"]) == {"tag", "n", "gate", "tally"}


def test_published_agent_killed_mid_run_replays_recorded_steps(
    kernel: Kernel, tmp_path: Path
) -> None:
    counter, gate = tmp_path / "count", tmp_path / "gate"
    with running(published_agent(kernel, "pub-kill", counter)) as first:
        execution_id = create(kernel, "pub-kill", {"tag": "k", "n": 3, "gate": str(gate)})
        first.wait_for("at gate k")
        assert runs(counter) == Counter(["k lookup 0", "k lookup 1", "k lookup 2"])
        _, steps_before = kernel.call("GET", f"/v0/executions/{execution_id}/steps")
        # A new process of the same agent takes over the webhook, then the first dies.
        with running(published_agent(kernel, "pub-kill", counter)) as second:
            first.kill()
            gate.touch()
            done = kernel.wait_terminal(execution_id, timeout=30)
            second.wait_for("at gate k")  # the second process ran the handler from the top
    assert done["status"] == "completed", done
    assert runs(counter) == Counter(["k lookup 0", "k lookup 1", "k lookup 2", "k shout"])
    pick = next(s for s in steps_before if s["target"] == "pick")
    assert done["output"]["pick"] == pick["result"]
    assert done["output"]["cubes"] == [0, 1, 8]
    acked = [
        (e["payload"]["dispatch_id"], e["payload"]["attempt"])
        for e in kernel.events(execution_id)
        if e["type"] == "dispatch.acked"
    ]
    assert [attempt for _, attempt in acked] == [1, 2]
    assert acked[0][0] == acked[1][0]  # the same dispatch, delivered again


def test_published_agent_under_policy_approval_and_denial(kernel: Kernel, tmp_path: Path) -> None:
    counter = tmp_path / "count"
    with running(published_agent(kernel, "pub-policy", counter)):
        status, _ = kernel.call("POST", "/v0/policies/pub-policy", {"bundle": POLICY})
        assert status == 204
        held = create(kernel, "pub-policy", {"tag": "hold", "n": 1})
        quiet = create(kernel, "pub-policy", {"tag": "quiet", "n": 1})
        denied = kernel.wait_terminal(quiet)
        after = 0
        while True:  # follow the held execution until it blocks
            _, events = kernel.call(
                "GET", f"/v0/executions/{held}/events?after_seq={after}&wait=10"
            )
            assert events, "no progress within 10 s"
            after = events[-1]["event_seq"]
            if events[-1]["type"] == "execution.blocked":
                break

        async def decide() -> list[Any]:
            async with rebuno.Client(kernel.url) as client:
                pending = await client.list_approvals()
                mine = [a for a in pending if a.execution_id == held]
                assert len(mine) == 1
                approval = await client.get_approval(mine[0].id)
                assert approval.status == "pending"
                assert approval.message == "let it shout?"
                with pytest.raises(rebuno.ForbiddenError):
                    await client.grant_approval(approval.id, decided_by="mallory")
                await client.grant_approval(approval.id, decided_by="carol", rationale="fine")
                with pytest.raises(rebuno.ConflictError):
                    await client.deny_approval(approval.id, decided_by="carol")
                return [await client.get_approval(approval.id)]

        (granted,) = anyio.run(decide)
        assert granted.status == "granted"
        assert granted.decided_by == "carol"
        done = kernel.wait_terminal(held)
    assert done["status"] == "completed", done
    assert done["output"]["loud"] == "HOLD"
    # A @tool denial comes back to the handler as text, and the run completes.
    assert denied["status"] == "completed", denied
    assert denied["output"]["loud"].startswith("shout not allowed. reason: ")
    assert "library rules" in denied["output"]["loud"]
    # The held run resumed from the top: its lookup replayed, shout ran once.
    counts = runs(counter)
    assert counts["hold lookup 0"] == 1
    assert counts["hold shout"] == 1
    assert counts["quiet shout"] == 0
    types = [e["type"] for e in kernel.events(held)]
    for expected in ("step.awaiting_approval", "approval.requested", "execution.blocked"):
        assert expected in types
    assert types.index("approval.granted") < types.index("execution.resumed")


def test_published_agent_session_state(kernel: Kernel, tmp_path: Path) -> None:
    counter = tmp_path / "count"
    with running(published_agent(kernel, "pub-session", counter)):
        ids = [
            create(kernel, "pub-session", {"tag": f"s{i}", "n": 0, "tally": True}, session="chat")
            for i in range(3)
        ]
        done = [kernel.wait_terminal(execution_id) for execution_id in ids]
    assert [d["status"] for d in done] == ["completed"] * 3
    assert [d["output"]["runs"] for d in done] == [1, 2, 3]
    assert done[1]["parent_execution_id"] == ids[0]
    assert done[2]["parent_execution_id"] == ids[1]
    status, previous = kernel.call("GET", f"/v0/executions/{ids[2]}/previous")
    assert status == 200
    assert previous == {"state": {"runs": 2}}


# -- the published Client against our kernel, in process -------------------------------------

CLIENT_SECRET = "client-secret"


@tool
async def fetch(key: str) -> str:
    return f"value-of-{key}"


async def client_process(keys: list[str]) -> dict[str, Any]:
    values = [await fetch(k) for k in keys]
    salt = await step("salt", lambda: "pepper")
    return {"values": values, "salt": salt}


@pytest.mark.anyio
async def test_published_client_drives_our_kernel(anyio_backend: str) -> None:
    async with inprocess_kernel(bearer_token="tok") as kernel:
        agent = Agent("ours", secret=CLIENT_SECRET, base_url=kernel.url)
        async with anyio.create_task_group() as tg:
            port = await tg.start(
                functools.partial(agent.serve, client_process, host="127.0.0.1", port=0)
            )
            await kernel.register("ours", f"http://127.0.0.1:{port}/webhook", CLIENT_SECRET)
            async with rebuno.Client(kernel.url, api_key="tok") as client:
                created = await client.create("ours", {"keys": ["a", "b"]}, idempotency_key="i1")
                assert created.agent_id == "ours"
                assert created.status == "running"
                again = await client.create("ours", {"keys": ["a", "b"]}, idempotency_key="i1")
                assert again.id == created.id
                async with Client(kernel.url, "tok") as ours:  # has the long poll
                    await ours.wait(created.id, timeout=20)
                execution = await client.get(created.id)
                assert execution.status == "completed"
                assert execution.output == {
                    "values": ["value-of-a", "value-of-b"],
                    "salt": "pepper",
                }
                events = await client.events(created.id, limit=1000)
                assert [e.event_seq for e in events] == list(range(1, len(events) + 1))
                assert events[-1].type == "execution.completed"
                assert len(await client.events(created.id, after_seq=len(events) - 2)) == 2
                steps = await client.list_steps(created.id)
                assert sorted(s.target for s in steps) == ["fetch", "fetch", "salt"]
                terminal = await client.list_steps(created.id, status="terminal")
                assert len(terminal) == 3
                one = await client.get_step(created.id, steps[0].step_id)
                assert one.step_id == steps[0].step_id
                assert one.status == "succeeded"
                with pytest.raises(rebuno.NotFoundError):
                    await client.get_step(created.id, "0" * 64)
                with pytest.raises(rebuno.NotFoundError):
                    await client.get("0192f1a0-0000-7000-8000-00000000dead")
                with pytest.raises(rebuno.NotFoundError):
                    await client.create("nobody")
                with pytest.raises(rebuno.ValidationError):
                    await client.get("not-a-uuid")
                with pytest.raises(rebuno.ConflictError):
                    await client.create("ours", {"keys": []}, idempotency_key="i1")
                with pytest.raises(rebuno.Terminated):
                    await client.cancel(created.id)  # completed: terminal
                # Cancel a run that never finishes (its agent is not listening).
                await kernel.register("gone", "http://127.0.0.1:9/webhook", CLIENT_SECRET)
                doomed = await client.create("gone", {"x": 1})
                await client.cancel(doomed.id)
                cancelled = await client.get(doomed.id)
                assert cancelled.status == "cancelled"
                assert cancelled.failure_reason == "client_cancelled"
                with pytest.raises(rebuno.Terminated):
                    await client.cancel(doomed.id)
                assert await client.list_approvals() == []
            async with rebuno.Client(kernel.url, api_key="wrong") as client:
                with pytest.raises(rebuno.UnauthorizedError):
                    await client.get(created.id)
            async with rebuno.Client(kernel.url) as client:  # no token at all
                with pytest.raises(rebuno.UnauthorizedError):
                    await client.create("ours", {"keys": []})
            tg.cancel_scope.cancel()

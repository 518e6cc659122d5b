"""Sessions (SEED 004, PROTOCOL.md §8): `Result(output, state)` and
`previous()` across executions of one session, with the real kernel in process.

The head of a session is its agent's last *completed* execution: `previous()`
returns its `state`, or its output when it returned a plain value (or a
`Result` without state). Failed executions never become the head.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from kernels import inprocess_kernel
from sdk_support import AGENT_ID, served

from rebuno_anyio import Client, Result, previous
from rebuno_anyio.types import Execution

pytestmark = pytest.mark.anyio


async def process(say: str, mode: str = "result") -> Any:
    prior = await previous()
    kept = prior.get("history", []) if isinstance(prior, dict) else []
    history = [*kept, say]
    if mode == "fail":
        raise RuntimeError(f"failed while saying {say}")
    if mode == "plain":
        return {"plain": say, "saw": prior}
    if mode == "no-state":
        return Result(output={"said": say, "saw": prior})
    return Result(output={"said": say, "saw": prior}, state={"history": history})


async def test_state_flows_from_the_last_completed_execution() -> None:
    turns = [
        ("a", "result"),
        ("b", "result"),
        ("c", "plain"),
        ("d", "fail"),
        ("e", "no-state"),
        ("f", "result"),
    ]
    done: list[Execution] = []
    with anyio.fail_after(20):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, process),
        ):
            for say, mode in turns:
                created = await client.create(
                    AGENT_ID, {"say": say, "mode": mode}, session="chat-1"
                )
                done.append(await client.wait(created.id))
            other = await client.wait(
                (await client.create(AGENT_ID, {"say": "x"}, session="chat-2")).id
            )
            lonely = await client.wait((await client.create(AGENT_ID, {"say": "y"})).id)

    a, b, c, d, e, f = done
    # The first execution of a session has no previous state; callers see only output.
    assert (a.status, a.output, a.parent_execution_id) == (
        "completed",
        {"said": "a", "saw": None},
        None,
    )
    # The next one gets the state the previous one kept.
    assert b.output == {"said": "b", "saw": {"history": ["a"]}}
    assert b.parent_execution_id == a.id
    assert c.output == {"plain": "c", "saw": {"history": ["a", "b"]}}
    assert c.parent_execution_id == b.id
    # A plain return value is the next previous state...
    assert (d.status, d.failure_reason) == (
        "failed",
        "agent_error: RuntimeError: failed while saying d",
    )
    # ...and a failed execution never becomes the head: e continues c, not d.
    assert e.output == {"said": "e", "saw": {"plain": "c", "saw": {"history": ["a", "b"]}}}
    assert e.parent_execution_id == c.id
    # A Result without state passes its output on, like a plain value.
    assert f.output == {"said": "f", "saw": e.output}
    assert f.parent_execution_id == e.id
    assert {x.session for x in done} == {"chat-1"}
    # Other sessions, and no session at all, start from nothing.
    assert other.output == {"said": "x", "saw": None}
    assert lonely.output == {"said": "y", "saw": None}


async def test_a_session_runs_one_execution_at_a_time() -> None:
    """The second execution of a session waits (pending) while the first runs,
    then continues it: it sees the state the first one kept."""
    gate = anyio.Event()

    async def slow_first(say: str) -> Result:
        prior = await previous()
        if say == "first":
            await gate.wait()
        return Result(output={"said": say, "saw": prior}, state={"last": say})

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, slow_first),
        ):
            first = await client.create(AGENT_ID, {"say": "first"}, session="s")
            second = await client.create(AGENT_ID, {"say": "second"}, session="s")
            waiting = await client.get(second.id)
            gate.set()
            done_first = await client.wait(first.id)
            done_second = await client.wait(second.id)

    assert waiting.status == "pending"
    assert done_first.output == {"said": "first", "saw": None}
    assert done_second.output == {"said": "second", "saw": {"last": "first"}}
    assert done_second.parent_execution_id == first.id

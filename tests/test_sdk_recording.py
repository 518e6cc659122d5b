"""The recording primitives: `@tool`, `wrap_tool`, `step` and `execution()`
(SEED 000: step identity, replay, the decisions), against the real kernel in
process, on asyncio and on trio.

Replay is tested the way it happens in production: the agent dies mid-run
(its serving scope is cancelled), the lease lapses, the kernel re-delivers to a
new agent, and the handler runs again from the top.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from kernels import inprocess_kernel
from sdk_support import AGENT_ID, events, served, steps

from rebuno_anyio import Client, ExecutionContext, ToolError, execution, previous, step, tool
from rebuno_anyio import wrap_tool as make_wrapped_tool

pytestmark = pytest.mark.anyio


# -- the tools under test: module level, as users write them ---------------------------------

bodies: dict[str, int] = {}


def ran(name: str) -> int:
    bodies[name] = bodies.get(name, 0) + 1
    return bodies[name]


@pytest.fixture(autouse=True)
def fresh_bodies() -> None:
    bodies.clear()


@tool
async def add(a: int, b: int = 1) -> int:
    ran("add")
    return a + b


@tool("lookup")
def find(key: str) -> str:
    """Sync: runs in a worker thread."""
    ran("lookup")
    return key.upper()


@tool("charge", idempotency="at_most_once")
async def charge(amount: int) -> dict[str, int]:
    ran("charge")
    return {"charged": amount}


@tool()
async def ping() -> str:
    ran("ping")
    return "pong"


@tool
async def explode(why: str) -> None:
    ran("explode")
    raise ValueError(why)


@tool
async def counted(tag: str) -> int:
    """Returns how many times its body has run, so every call is distinguishable."""
    return ran("counted")


async def search(args: dict[str, Any]) -> list[str]:
    ran("search")
    return [f"hit for {args['q']}", f"limit {args['limit']}"]


search_tool = make_wrapped_tool(
    "web_search",
    search,
    description="Search the web.",
    args_schema={
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
    },
    transform_args=lambda kwargs: {"q": kwargs["query"], "limit": kwargs.get("limit") or 3},
    to_result=lambda hits: {"hits": hits},
)


async def run(process: Callable[..., Any], input: Any = None, *, lease: float = 120.0) -> Any:
    """One execution of `process`: returns (final execution, steps, events)."""
    with anyio.fail_after(15):
        async with inprocess_kernel(lease_timeout_s=lease) as k, Client(k.url) as client:
            async with served(k, process):
                created = await client.create(AGENT_ID, input)
                final = await client.wait(created.id)
            return final, await steps(client, created.id), await events(client, created.id)


# -- what each primitive records --------------------------------------------------------------


async def test_each_primitive_records_its_step() -> None:
    contexts: list[ExecutionContext] = []

    async def process(input: Any) -> dict[str, Any]:
        contexts.append(execution())
        return {
            "add": await add(2),
            "lookup": await find("k"),
            "charge": await charge(5),
            "ping": await ping(),
            "search": await search_tool(query="anyio"),
            "local": await step("pick", lambda: 7),
            "scaled": await step("scale", lambda x, y: x * y, {"x": 3, "y": 4}),
        }

    final, recorded, _ = await run(process, {"hello": "world"})
    assert final.status == "completed", final.failure_reason
    assert final.output == {
        "add": 3,
        "lookup": "K",
        "charge": {"charged": 5},
        "ping": "pong",
        "search": {"hits": ["hit for anyio", "limit 3"]},
        "local": 7,
        "scaled": 12,
    }
    seen = [(s.kind, s.target, s.args, s.idempotency, s.status, s.result) for s in recorded]
    assert sorted(seen, key=lambda row: row[1]) == [
        ("tool_call", "add", {"a": 2, "b": 1}, "safe_to_retry", "succeeded", 3),  # default bound
        ("tool_call", "charge", {"amount": 5}, "at_most_once", "succeeded", {"charged": 5}),
        ("tool_call", "lookup", {"key": "k"}, "safe_to_retry", "succeeded", "K"),
        ("local", "pick", {}, "safe_to_retry", "succeeded", 7),  # args default to {}
        ("tool_call", "ping", {}, "safe_to_retry", "succeeded", "pong"),
        ("local", "scale", {"x": 3, "y": 4}, "safe_to_retry", "succeeded", 12),
        (
            "tool_call",
            "web_search",
            {"q": "anyio", "limit": 3},  # transform_args: what is recorded and invoked
            "safe_to_retry",
            "succeeded",
            {"hits": ["hit for anyio", "limit 3"]},  # to_result: what is recorded
        ),
    ]
    assert {s.occurrence for s in recorded} == {0}
    ctx = contexts[0]
    assert (ctx.id, ctx.agent_id, ctx.input) == (final.id, AGENT_ID, {"hello": "world"})
    assert ctx.dispatch_attempt == 1
    assert ctx.suspension is None


def test_tool_metadata() -> None:
    assert add.__name__ == "add"
    assert find.__doc__ == "Sync: runs in a worker thread."
    assert charge.__idempotency__ == "at_most_once"  # type: ignore[attr-defined]
    assert find.__rebuno_tool_id__ == "lookup"  # type: ignore[attr-defined]
    assert search_tool.__name__ == "web_search"
    assert search_tool.__doc__ == "Search the web."
    assert str(search_tool.__signature__) == "(*, query, limit=None)"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="idempotency"):
        tool("x", idempotency="maybe")  # type: ignore[call-overload]


async def test_identical_calls_in_sequence_are_distinct_steps() -> None:
    async def process(input: Any) -> list[int]:
        return [await counted("same"), await counted("same"), await counted("other")]

    final, recorded, _ = await run(process)
    assert final.output == [1, 2, 3]
    by_tag = sorted((s.args["tag"], s.occurrence) for s in recorded)
    assert by_tag == [("other", 0), ("same", 0), ("same", 1)]
    assert len({s.step_id for s in recorded}) == 3


# -- no execution: a clear error ------------------------------------------------------------


async def test_outside_an_execution_everything_raises_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="outside an execution"):
        await add(1)
    with pytest.raises(RuntimeError, match="outside an execution"):
        await find("k")
    with pytest.raises(RuntimeError, match="outside an execution"):
        await search_tool(query="q")
    with pytest.raises(RuntimeError, match=r"step\('pick'\) called outside an execution"):
        await step("pick", lambda: 1)
    with pytest.raises(RuntimeError, match=r"execution\(\) called outside an execution"):
        execution()
    with pytest.raises(RuntimeError, match="outside an execution"):
        await previous()
    assert bodies == {}


async def test_after_the_handler_the_context_is_gone() -> None:
    leaked: list[Callable[[], ExecutionContext]] = []

    async def process(input: Any) -> str:
        leaked.append(execution)
        return execution().id

    final, _, _ = await run(process)
    assert final.output == final.id
    with pytest.raises(RuntimeError, match="outside an execution"):
        leaked[0]()


# -- bad arguments, failing bodies ---------------------------------------------------------------


async def test_non_json_arguments_raise_type_error_before_anything_is_sent() -> None:
    caught: list[str] = []

    async def process(input: Any) -> str:
        for attempt in (
            lambda: step("clock", lambda when: when, {"when": object()}),
            lambda: add(object()),  # type: ignore[arg-type]
            lambda: step("nan", lambda x: x, {"x": float("nan")}),
        ):
            try:
                await attempt()
            except TypeError as err:
                caught.append(str(err))
        return "done"

    final, recorded, log = await run(process)
    assert final.status == "completed", final.failure_reason
    assert len(caught) == 3
    assert all(message.startswith("step arguments must be JSON-serializable") for message in caught)
    assert recorded == []
    assert not [e for e in log if e.type.startswith("step.")]
    assert bodies == {}


async def test_failing_body_raises_tool_error_and_records_the_step_failed() -> None:
    caught: list[ToolError] = []

    async def process(input: Any) -> str:
        try:
            await explode("disk full")
        except ToolError as err:
            caught.append(err)
        try:
            await step("divide", lambda: 1 / 0)
        except ToolError as err:
            caught.append(err)
        return "survived"

    final, recorded, _ = await run(process)
    assert (final.status, final.output) == ("completed", "survived")
    assert [(e.tool_id, e.message, str(e)) for e in caught] == [
        ("explode", "disk full", "explode: disk full"),
        ("divide", "division by zero", "divide: division by zero"),
    ]
    by_target = {s.target: s for s in recorded}
    assert by_target["explode"].status == "failed"
    assert by_target["explode"].error == {"message": "disk full"}
    assert by_target["divide"].status == "failed"
    assert by_target["divide"].error == {"message": "division by zero"}
    assert [e.step_id for e in caught] == [
        by_target["explode"].step_id,
        by_target["divide"].step_id,
    ]


@tool
async def unrecordable() -> object:
    ran("unrecordable")
    return {1, 2}  # a set is not JSON


async def test_a_result_that_cannot_be_recorded_fails_the_step() -> None:
    caught: list[ToolError] = []

    async def process(input: Any) -> str:
        try:
            await unrecordable()
        except ToolError as err:
            caught.append(err)
        return "went on"

    final, recorded, _ = await run(process)
    assert (final.status, final.output) == ("completed", "went on")
    assert len(caught) == 1
    assert "must be JSON-serializable" in caught[0].message
    (only,) = [s for s in recorded if s.target == "unrecordable"]
    assert only.status == "failed"  # not left executing
    assert "must be JSON-serializable" in only.error["message"]
    assert bodies["unrecordable"] == 1


# -- replay after a crash ------------------------------------------------------------------------


async def test_redelivery_replays_results_failures_and_parallel_occurrences() -> None:
    """Three identical calls in one task group are three steps (occurrences
    0, 1, 2). After a crash, the re-delivered handler gets each recorded result
    and the recorded failure back without running any body again."""
    runs: list[dict[str, Any]] = []
    crashed = anyio.Event()

    async def process(input: Any) -> dict[str, Any]:
        results: list[int] = [0, 0, 0]

        async def call(i: int) -> None:
            results[i] = await counted("same")

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(call, i)
        try:
            await explode("first time only")
            failure = "none"
        except ToolError as err:
            failure = err.message
        lucky = await step("lucky", lambda: ran("lucky") * 100)
        seen = {
            "results": sorted(results),
            "failure": failure,
            "lucky": lucky,
            "attempt": execution().dispatch_attempt,
        }
        runs.append(seen)
        if len(runs) == 1:
            crashed.set()
            await anyio.sleep_forever()  # the agent dies here
        return seen

    with anyio.fail_after(20):
        async with (
            inprocess_kernel(lease_timeout_s=1.0, poll_interval_s=0.1) as k,
            Client(k.url) as client,
        ):
            async with served(k, process):
                created = await client.create(AGENT_ID)
                await crashed.wait()
            assert bodies == {"counted": 3, "explode": 1, "lucky": 1}
            async with served(k, process):
                final = await client.wait(created.id)
            recorded = await steps(client, created.id)

    assert final.status == "completed", final.failure_reason
    assert bodies == {"counted": 3, "explode": 1, "lucky": 1}  # nothing ran twice
    assert [run["attempt"] for run in runs] == [1, 2]
    assert runs[0]["results"] == [1, 2, 3]
    assert {k: v for k, v in runs[1].items() if k != "attempt"} == {
        k: v for k, v in runs[0].items() if k != "attempt"
    }
    assert runs[1]["failure"] == "first time only"
    same = sorted((s.occurrence, s.result) for s in recorded if s.target == "counted")
    assert [occurrence for occurrence, _ in same] == [0, 1, 2]
    assert sorted(result for _, result in same) == [1, 2, 3]
    assert len(recorded) == 5  # re-delivery recorded nothing new


async def test_orphaned_steps_rerun_when_safe_and_are_refused_when_at_most_once() -> None:
    """The agent dies while two bodies run. On re-delivery the safe_to_retry
    body runs again; the at_most_once one is not: its outcome is unknown, so
    the call raises ToolError and the step is failed `indeterminate`."""
    fetching, sending = anyio.Event(), anyio.Event()

    @tool("fetch_page")
    async def fetch_page(url: str) -> str:
        if ran("fetch_page") == 1:
            fetching.set()
            await anyio.sleep_forever()
        return f"page {url}"

    @tool("send_money", idempotency="at_most_once")
    async def send_money(to: str) -> str:
        ran("send_money")
        sending.set()
        await anyio.sleep_forever()
        return "sent"  # pragma: no cover

    async def process(input: Any) -> dict[str, Any]:
        if execution().dispatch_attempt == 1:
            async with anyio.create_task_group() as tg:
                tg.start_soon(fetch_page, "a")
                tg.start_soon(send_money, "bob")
        page = await fetch_page("a")
        try:
            sent = await send_money("bob")
        except ToolError as err:
            sent = f"refused: {err.message}"
        # Asking again is a new occurrence: the kernel denies it outright.
        again = await send_money("bob")
        return {"page": page, "sent": sent, "again": again}

    with anyio.fail_after(20):
        async with (
            inprocess_kernel(lease_timeout_s=1.0, poll_interval_s=0.1) as k,
            Client(k.url) as client,
        ):
            async with served(k, process):
                created = await client.create(AGENT_ID)
                await fetching.wait()
                await sending.wait()
            async with served(k, process):
                final = await client.wait(created.id)
            recorded_all = await steps(client, created.id)
    recorded = {s.target: s for s in recorded_all if s.occurrence == 0}

    assert final.status == "completed", final.failure_reason
    assert bodies == {"fetch_page": 2, "send_money": 1}
    assert final.output["page"] == "page a"
    assert final.output["sent"].startswith("refused: outcome unknown")
    assert recorded["fetch_page"].status == "succeeded"
    assert final.output["again"] == (
        "send_money not allowed. reason: [policy_denied] "
        "prior attempt outcome unknown; retry refused (HTTP 403)"
    )
    money = sorted(
        (s.occurrence, s.status, s.error["reason"])
        for s in recorded_all
        if s.target == "send_money"
    )
    assert money == [
        (0, "failed", "indeterminate"),
        (1, "denied", "prior attempt outcome unknown; retry refused"),
    ]


# -- tools on another event loop ----------------------------------------------------------------


@tool
async def times_ten(n: int) -> int:
    ran("times_ten")
    return n * 10


def on_a_loop_of_its_own(n: int) -> dict[str, Any]:
    """What frameworks do with a sync tool: in its worker thread, run async
    tools on a fresh asyncio loop. The context variable follows; the kernel
    calls must still go out on the handler's loop."""
    import asyncio

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {
            "tool": await times_ten(n),
            "step": await step("next", lambda: n + 1),
            "previous": await previous(),
        }
        try:
            await explode("far away")
        except ToolError as err:
            out["error"] = err.message
        return out

    return asyncio.run(main())


@tool
def bridge(n: int) -> dict[str, Any]:
    return on_a_loop_of_its_own(n)


async def test_tools_called_from_another_event_loop_record_through_the_owner_loop() -> None:
    """Submit, complete, fail and `previous()` made on a foreign loop (asyncio
    in a worker thread, under an asyncio or a trio handler) run on the loop the
    handler runs on, whose connections and locks they need."""

    async def process(n: int) -> list[Any]:
        return [await times_ten(0), await bridge(n), await times_ten(2)]

    final, recorded, _ = await run(process, {"n": 1})
    assert final.status == "completed", final.failure_reason
    assert final.output == [
        0,
        {"tool": 10, "step": 2, "previous": None, "error": "far away"},
        20,
    ]
    assert sorted((s.target, s.status) for s in recorded) == [
        ("bridge", "succeeded"),
        ("explode", "failed"),
        ("next", "succeeded"),
        ("times_ten", "succeeded"),
        ("times_ten", "succeeded"),
        ("times_ten", "succeeded"),
    ]
    assert bodies == {"times_ten": 3, "explode": 1}


# -- ergonomics, and code ported from the published SDK -------------------------------------------


async def test_execution_must_be_called() -> None:
    with pytest.raises(AttributeError, match=r"execution must be called: use execution\(\)\.id"):
        execution.id  # type: ignore[attr-defined]  # noqa: B018
    assert callable(execution)
    seen: list[tuple[str, str]] = []

    async def process(input: Any) -> str:
        ctx = execution()
        seen.append((ctx.id, ctx.status))
        return ctx.id

    final, _, _ = await run(process)
    assert seen == [(final.id, "running")]  # the status fetched at dispatch


@tool("stock", resources=["inventory"])
async def stock(item: str) -> int:
    ran("stock")
    return 3


async def test_resources_are_accepted_and_ignored() -> None:
    """`resources=` (the published SDK's) changes nothing: no snapshots or
    checkpoints, the steps are recorded as without it."""
    restock = make_wrapped_tool("restock", lambda args: args["n"], resources=["inventory"])

    async def process(input: Any) -> list[int]:
        return [
            await stock("apple"),
            await restock(n=4),
            await step("count", lambda: 5, resources=["inventory"]),
        ]

    final, recorded, _ = await run(process)
    assert final.output == [3, 4, 5]
    assert sorted((s.kind, s.target, s.args) for s in recorded) == [
        ("local", "count", {}),
        ("tool_call", "restock", {"n": 4}),
        ("tool_call", "stock", {"item": "apple"}),
    ]

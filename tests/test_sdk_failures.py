"""How a handler's outcome ends the execution (SEED 004 failure table,
PROTOCOL.md §5.3), with real kernel decisions from a policy bundle: a return
completes; `Blocked` / `Terminated` (raised, or swallowed and re-raised by the
agent) and `LeaseSuperseded` unwind and leave the kernel's state standing;
denials, rate limits, tool errors and anything else fail it with a reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from kernels import InProcessKernel, inprocess_kernel
from procs import free_port
from sdk_support import AGENT_ID, PARKED, SECRET, KernelSpy, served, steps

from rebuno_anyio import (
    Agent,
    Blocked,
    Client,
    KernelUnreachable,
    LeaseSuperseded,
    NetworkError,
    PolicyError,
    RateLimited,
    Terminated,
    execution,
    step,
    tool,
)
from rebuno_anyio._h11client import ConnectError
from rebuno_anyio._http import Request, Response
from rebuno_anyio._server import HttpServer
from rebuno_anyio.agent import KernelClient
from rebuno_anyio.errors import classify
from rebuno_anyio.kernel import KernelConfig, serve_kernel
from rebuno_anyio.policy import policy_hook
from rebuno_proto import DispatchSettings, Lease

pytestmark = pytest.mark.anyio

POLICY = """
default_action: allow
rules:
  - id: hold-launch
    priority: 1
    when: {target: launch}
    then:
      decision: require_approval
      approval_config: {message: "Launch?"}
  - id: no-secrets
    priority: 2
    when: {target: read_secrets}
    then: {decision: deny, reason: "secrets are off limits"}
  - id: token-reason
    priority: 3
    when: {target: self_destruct}
    then: {decision: deny, reason: not_today}
  - id: one-search
    priority: 4
    when: {target: search}
    then:
      decision: allow
      rate_limit: {max_calls: 1, window: 1m, per_what: execution}
"""

bodies: list[str] = []


@pytest.fixture(autouse=True)
def fresh_bodies() -> None:
    bodies.clear()


@tool
async def launch(target: str) -> str:
    bodies.append("launch")
    return f"launched at {target}"


@tool
async def read_secrets() -> str:
    bodies.append("read_secrets")
    return "hunter2"


@tool
async def search(q: str) -> str:
    bodies.append("search")
    return f"results for {q}"


@tool
async def explode() -> None:
    bodies.append("explode")
    raise OSError("boom")


# -- ending with a reason (or a value) -------------------------------------------------------


async def returns(input: Any) -> Any:
    return {"ok": True}


async def denied_step(input: Any) -> Any:
    return await step("read_secrets", lambda: "hunter2")


async def denied_step_token_reason(input: Any) -> Any:
    return await step("self_destruct", lambda: "boom")


async def denied_tool_returns_refusal(input: Any) -> Any:
    return await read_secrets()


async def raises_policy_error(input: Any) -> Any:
    raise PolicyError("my own rule says no", "custom")


async def rate_limited(input: Any) -> Any:
    await search("first")
    await search("second")  # over the limit: @tool does not catch RateLimited


async def raises_rate_limited(input: Any) -> Any:
    raise RateLimited("rate_limiter_unavailable")


async def tool_error(input: Any) -> Any:
    await explode()


async def other_error(input: Any) -> Any:
    raise RuntimeError("kaput")


async def key_error(input: Any) -> Any:
    return {}["missing"]


async def wrapped_denial(input: Any) -> Any:
    # What a provider SDK raises around a refused LLM call (PROTOCOL.md §9).
    raise RuntimeError("Error code: 403 - rebuno_refusal: denied reason=model not allowed")


async def wrapped_rate_limit(input: Any) -> Any:
    raise RuntimeError("Error code: 429 - rebuno_refusal: rate_limited")


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text for you")


async def unprintable(input: Any) -> Any:
    # Classifying it fails (str() raises): the execution is failed all the same.
    raise Unprintable()


# anyio task groups wrap a child's exception in an ExceptionGroup, even alone.


async def tool_error_in_task_group(input: Any) -> Any:
    async with anyio.create_task_group() as tg:
        tg.start_soon(explode)


async def denied_step_in_nested_task_groups(input: Any) -> Any:
    async def inner() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(denied_step, input)

    async with anyio.create_task_group() as tg:
        tg.start_soon(inner)


async def wrapped_denial_in_task_group(input: Any) -> Any:
    async with anyio.create_task_group() as tg:
        tg.start_soon(wrapped_denial, input)


@tool
async def flaky() -> None:
    bodies.append("flaky")
    raise NetworkError("the weather service is down")


async def network_error_in_tool_body(input: Any) -> Any:
    await flaky()  # a body's own NetworkError is the body's failure


async def raises_network_error(input: Any) -> Any:
    raise NetworkError("my own client failed")


REFUSAL = "read_secrets not allowed. reason: [policy_denied] secrets are off limits (HTTP 403)"


@pytest.mark.parametrize(
    ("process", "status", "reason", "output"),
    [
        (returns, "completed", "", {"ok": True}),
        (denied_step, "failed", "policy_denied: secrets are off limits", None),
        (denied_step_token_reason, "failed", "not_today", None),
        (denied_tool_returns_refusal, "completed", "", REFUSAL),
        (raises_policy_error, "failed", "policy_denied: my own rule says no", None),
        (rate_limited, "failed", "rate_limit_exceeded", None),
        (raises_rate_limited, "failed", "rate_limiter_unavailable", None),
        (tool_error, "failed", "tool_error: explode: boom", None),
        (other_error, "failed", "agent_error: RuntimeError: kaput", None),
        (key_error, "failed", "agent_error: KeyError: 'missing'", None),
        (wrapped_denial, "failed", "policy_denied: model not allowed", None),
        (wrapped_rate_limit, "failed", "rate_limit_exceeded", None),
        (unprintable, "failed", "agent_error: Unprintable: <unprintable exception>", None),
        (tool_error_in_task_group, "failed", "tool_error: explode: boom", None),
        (
            denied_step_in_nested_task_groups,
            "failed",
            "policy_denied: secrets are off limits",
            None,
        ),
        (wrapped_denial_in_task_group, "failed", "policy_denied: model not allowed", None),
        (
            network_error_in_tool_body,
            "failed",
            "tool_error: flaky: the weather service is down",
            None,
        ),
        (raises_network_error, "failed", "agent_error: NetworkError: my own client failed", None),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
async def test_outcome_maps_onto_the_execution(
    process: Callable[..., Any], status: str, reason: str, output: Any
) -> None:
    with anyio.fail_after(15):
        async with (
            inprocess_kernel(policy_hook=policy_hook(dev_mode=True)) as k,
            Client(k.url) as client,
            served(k, process, policy=POLICY),
        ):
            created = await client.create(AGENT_ID, {})
            final = await client.wait(created.id)
            recorded = await steps(client, created.id)

    assert (final.status, final.failure_reason, final.output) == (status, reason, output)
    assert bodies == {
        "rate_limited": ["search"],
        "tool_error": ["explode"],
        "tool_error_in_task_group": ["explode"],
        "network_error_in_tool_body": ["flaky"],
    }.get(process.__name__, [])
    if process is rate_limited:
        # The refused call was not recorded: only the first search is a step.
        assert [(s.target, s.status) for s in recorded] == [("search", "succeeded")]
    if process in (denied_step, denied_tool_returns_refusal):
        assert [(s.target, s.status, s.rule_id) for s in recorded] == [
            ("read_secrets", "denied", "no-secrets")
        ]


# -- unwinding: the kernel's state stands ------------------------------------------------------


async def wait_for_status(client: Client, execution_id: str, status: str) -> None:
    """Follow the event log (long polls) until the execution has `status`."""
    after = 0
    while (await client.get(execution_id)).status != status:
        found = await client.events(execution_id, after_seq=after, wait=5)
        if found:
            after = found[-1].event_seq


@pytest.mark.parametrize("swallow", [False, True], ids=["raised", "swallowed"])
async def test_blocked_unwinds_and_the_approved_run_completes(swallow: bool) -> None:
    """`launch` needs an approval: the dispatch unwinds with the execution
    `blocked` (even when the handler swallows `Blocked`: the context remembers
    it). Once granted, the next dispatch runs the tool and completes."""
    suspensions: list[Any] = []

    async def process(target: str) -> str:
        try:
            return await launch(target)
        except Blocked:
            suspensions.append(execution().suspension)
            if not swallow:
                raise
            return "pretending all is well"

    with anyio.fail_after(15):
        async with inprocess_kernel(policy_hook=policy_hook(dev_mode=True)) as k:
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with (
                Client(k.url) as client,
                served(k, process, agent=agent, policy=POLICY),
            ):
                created = await client.create(AGENT_ID, {"target": "moon"})
                await wait_for_status(client, created.id, "blocked")
                await agent.join()
                assert spy.count("complete_execution") + spy.count("fail_execution") == 0
                assert (await client.get(created.id)).status == "blocked"
                assert bodies == []
                [approval] = await client.list_approvals()
                assert (approval.execution_id, approval.message) == (created.id, "Launch?")
                await client.grant_approval(approval.id, decided_by="ops")
                final = await client.wait(created.id)

    assert len(suspensions) == 1
    assert isinstance(suspensions[0], Blocked)
    assert (final.status, final.output) == ("completed", "launched at moon")
    assert bodies == ["launch"]
    assert spy.names().count("complete_execution") == 1


@pytest.mark.parametrize("swallow", [False, True], ids=["raised", "swallowed"])
async def test_cancelled_execution_unwinds_at_the_next_step(swallow: bool) -> None:
    """The execution is cancelled while the handler waits; its next tool call
    gets `execution_terminal`: `Terminated` unwinds the dispatch (also when
    swallowed) and the agent neither completes nor fails anything."""
    reached, go = anyio.Event(), anyio.Event()
    suspensions: list[Any] = []
    finished = anyio.Event()

    async def process(target: str) -> str:
        try:
            reached.set()
            await go.wait()
            return await launch(target)
        except Terminated:
            suspensions.append(execution().suspension)
            if not swallow:
                raise
            return "pretending all is well"
        finally:
            finished.set()

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
        ):
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent):
                created = await client.create(AGENT_ID, {"target": "moon"})
                await reached.wait()
                await client.cancel(created.id)
                go.set()
                await finished.wait()
                await agent.join()
            final = await client.get(created.id)

    assert (final.status, final.failure_reason) == ("cancelled", "client_cancelled")
    assert final.output is None
    assert bodies == []
    assert isinstance(suspensions[0], Terminated)
    assert ("submit_step", "ok") in spy.calls  # answered execution_terminal
    assert spy.count("complete_execution") + spy.count("fail_execution") == 0


async def test_lease_superseded_raised_by_the_handler_unwinds() -> None:
    finished = anyio.Event()

    async def process(input: Any) -> str:
        try:
            raise LeaseSuperseded()
        finally:
            finished.set()

    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent):
                created = await client.create(AGENT_ID, {})
                await finished.wait()
                await agent.join()
                current = await client.get(created.id)

    assert current.status == "running"  # nothing reported: the kernel will re-deliver
    assert spy.count("complete_execution") + spy.count("fail_execution") == 0


async def test_wrapped_blocked_refusal_unwinds() -> None:
    """A provider error carrying a `blocked` refusal marker is unwound, not failed."""
    finished = anyio.Event()

    async def process(input: Any) -> str:
        try:
            raise RuntimeError("Error code: 403 - rebuno_refusal: blocked")
        finally:
            finished.set()

    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent):
                created = await client.create(AGENT_ID, {})
                await finished.wait()
                await agent.join()
                current = await client.get(created.id)

    assert current.status == "running"
    assert spy.count("complete_execution") + spy.count("fail_execution") == 0


# -- exception groups and errors that are hard to read ------------------------------------------


def test_classify_unwraps_single_member_groups_only() -> None:
    denied = PolicyError("no", "rule")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [denied])])
    assert classify(nested)[:2] == classify(denied)[:2]
    two = ExceptionGroup("both", [denied, RuntimeError("x")])
    outcome, detail, error_class = classify(two)
    assert (outcome.name, error_class) == ("OTHER_ERROR", "ExceptionGroup")
    assert detail == "both (2 sub-exceptions)"


async def test_an_unread_streamed_error_response_fails_the_execution() -> None:
    """`raise_for_status()` on a streamed response that was never read: the
    refusal check cannot read its body (httpx raises `ResponseNotRead`), which
    must not keep the execution from being failed."""

    async def body() -> AsyncIterator[bytes]:
        yield b"boom"

    async def process(input: Any) -> Any:
        transport = httpx.MockTransport(lambda request: httpx.Response(500, content=body()))
        async with (
            httpx.AsyncClient(transport=transport) as http,
            http.stream("GET", "http://provider.test/") as response,
        ):
            response.raise_for_status()

    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client, served(k, process):
            final = await client.wait((await client.create(AGENT_ID, {})).id)

    assert final.status == "failed"
    assert final.failure_reason.startswith(
        "agent_error: HTTPStatusError: Server error '500 Internal Server Error'"
    )


# -- one bad handler never takes the agent down -----------------------------------------------


class Stop(BaseException):
    """Not an `Exception`: what a misbehaving library might raise."""


async def test_a_base_exception_fails_only_its_own_execution(anyio_backend: str) -> None:
    """A handler raising a `BaseException` that is not the agent's own
    cancellation -- a custom one, one in a task group, or (asyncio) the
    `CancelledError` of awaiting a task someone else cancelled -- fails its
    execution; a handler running alongside it, and later ones, are untouched."""
    kinds = {
        "base": "agent_error: Stop: not an Exception",
        "base_in_group": "agent_error: Stop: not an Exception",
    }
    if anyio_backend == "asyncio":
        kinds["stray_cancel"] = "agent_error: CancelledError: "
    slow_started, release_slow = anyio.Event(), anyio.Event()

    async def raise_stop() -> None:
        raise Stop("not an Exception")

    async def process(kind: str) -> str:
        if kind == "slow":
            slow_started.set()
            await release_slow.wait()
        elif kind == "base":
            await raise_stop()
        elif kind == "base_in_group":
            async with anyio.create_task_group() as tg:
                tg.start_soon(raise_stop)
        elif kind == "stray_cancel":
            import asyncio

            task = asyncio.ensure_future(asyncio.sleep(60))
            await asyncio.sleep(0)
            task.cancel()
            await task  # raises CancelledError here, though nobody cancelled us
        return kind

    with anyio.fail_after(20):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, process) as running,
        ):
            slow = await client.create(AGENT_ID, {"kind": "slow"})
            await slow_started.wait()
            failed = {}
            for kind in kinds:
                created = await client.create(AGENT_ID, {"kind": kind})
                failed[kind] = await client.wait(created.id)
            release_slow.set()
            slow_final = await client.wait(slow.id)
            later = await client.wait((await client.create(AGENT_ID, {"kind": "later"})).id)
            assert running.agent._tg is not None  # still serving

    assert {kind: (f.status, f.failure_reason) for kind, f in failed.items()} == {
        kind: ("failed", reason) for kind, reason in kinds.items()
    }
    assert (slow_final.status, slow_final.output) == ("completed", "slow")
    assert (later.status, later.output) == ("completed", "later")


async def test_keyboard_interrupt_and_system_exit_always_propagate() -> None:
    agent = Agent(AGENT_ID, secret=SECRET, base_url="http://127.0.0.1:9")
    for exc in (
        KeyboardInterrupt(),
        SystemExit(1),
        BaseExceptionGroup("g", [Stop(), KeyboardInterrupt()]),
    ):
        assert agent._must_propagate(exc)
    assert not agent._must_propagate(Stop())


# -- the kernel out of reach ------------------------------------------------------------------


async def test_kernel_client_retries_a_refused_connection_until_the_kernel_listens() -> None:
    """Refused means the request never arrived: it is sent again, with backoff,
    and succeeds once something listens on the port."""
    port = free_port()
    client = KernelClient(
        agent_id=AGENT_ID, secret=SECRET, base_url=f"http://127.0.0.1:{port}", timeout=10
    )
    refused = anyio.Event()
    seen: list[str] = []
    original = client._http.request

    async def observed(*args: Any, **kwargs: Any) -> Any:
        try:
            return await original(*args, **kwargs)
        except ConnectError:
            refused.set()
            raise

    client._http.request = observed  # type: ignore[method-assign]

    async def answer(request: Request) -> Response:
        seen.append(request.target)
        return Response.json(200, b'{"id": "x", "status": "running"}')

    result: list[dict[str, Any]] = []
    fetched = anyio.Event()

    async def fetch() -> None:
        result.append(await client.get_execution("x"))
        fetched.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch)
            await refused.wait()  # refused at least once: nothing listens yet
            await tg.start(HttpServer(answer).serve, "127.0.0.1", port)
            await fetched.wait()
            tg.cancel_scope.cancel()
        await client.aclose()

    assert result == [{"id": "x", "status": "running"}]
    assert seen == ["/v0/executions/x"]


async def test_kernel_client_gives_up_with_kernel_unreachable() -> None:
    """Refused past the budget (min(timeout, 30) s), or timed out (never
    retried: the kernel may have the request), raises `KernelUnreachable`, a
    `NetworkError`. A live delta is best effort and not retried at all."""
    attempts: list[str] = []

    def counted(client: KernelClient) -> KernelClient:
        original = client._http.request

        async def request(*args: Any, **kwargs: Any) -> Any:
            attempts.append(args[1])
            return await original(*args, **kwargs)

        client._http.request = request  # type: ignore[method-assign]
        return client

    port = free_port()
    refused = counted(
        KernelClient(
            agent_id=AGENT_ID, secret=SECRET, base_url=f"http://127.0.0.1:{port}", timeout=0.3
        )
    )
    with anyio.fail_after(10):
        started = anyio.current_time()
        with pytest.raises(KernelUnreachable, match="could not connect") as caught:
            await refused.get_execution("x")
        assert anyio.current_time() - started >= 0.3
        assert isinstance(caught.value, NetworkError)
        assert len(attempts) >= 3  # 0.05 s, then 0.1 s, then the rest of the budget
        attempts.clear()
        with pytest.raises(KernelUnreachable):
            await refused.stream_delta(
                "x", "s", Lease(dispatch_id="d", attempt=1), seq=0, data="hi"
            )
        assert len(attempts) == 1
        await refused.aclose()

    attempts.clear()
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as silent:
        # Accepts (the backlog does) and never answers.
        base_url = f"http://127.0.0.1:{silent.extra(anyio.abc.SocketAttribute.local_port)}"
        hung = counted(
            KernelClient(agent_id=AGENT_ID, secret=SECRET, base_url=base_url, timeout=0.3)
        )
        with anyio.fail_after(10), pytest.raises(KernelUnreachable, match="longer than"):
            await hung.get_execution("x")
        assert len(attempts) == 1
        await hung.aclose()


@asynccontextmanager
async def kernel_at(port: int, db: Path, lease_timeout_s: float) -> AsyncIterator[InProcessKernel]:
    """An in-process kernel on a fixed port and a database file, so that it can
    be stopped and started again where the agent expects it."""
    settings = DispatchSettings(
        lease_timeout_s=lease_timeout_s, max_attempts=5, backoff_base_s=0.05, backoff_max_s=0.5
    )
    config = KernelConfig(db=str(db), port=port, settings=settings, poll_interval_s=0.1)
    async with anyio.create_task_group() as tg:
        running = await tg.start(serve_kernel, config)
        try:
            yield InProcessKernel(url=f"http://127.0.0.1:{port}", running=running)
        finally:
            running.server.shutdown()
            tg.cancel_scope.cancel()


def watch_refusals(agent: Agent) -> anyio.Event:
    """An event set once the agent's kernel client is refused a connection."""
    refused = anyio.Event()
    original = agent._kernel._http.request

    async def request(*args: Any, **kwargs: Any) -> Any:
        try:
            return await original(*args, **kwargs)
        except ConnectError:
            refused.set()
            raise

    agent._kernel._http.request = request  # type: ignore[method-assign]
    return refused


@tool
async def record(n: int) -> int:
    bodies.append(f"record {n}")
    return n


async def test_a_kernel_restart_mid_handler_is_ridden_out(tmp_path: Path) -> None:
    """The kernel stops while a handler runs and comes back on the same port:
    the handler's next call is refused, retried, and goes through. Whether the
    restarted kernel kept the lease (the handler just carries on) or retired it
    (the kernel re-delivers, and the recorded step replays), the execution
    completes and no recorded body runs twice."""
    port, db = free_port(), tmp_path / "kernel.db"
    reached, go = anyio.Event(), anyio.Event()

    async def process(n: int) -> list[int]:
        first = await record(n)
        reached.set()
        await go.wait()
        return [first, await record(n + 1)]

    agent = Agent(AGENT_ID, secret=SECRET, base_url=f"http://127.0.0.1:{port}")
    refused = watch_refusals(agent)
    spy = KernelSpy(agent)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:  # the agent outlives the first kernel
            async with kernel_at(port, db, lease_timeout_s=60) as k, Client(k.url) as client:
                await k.register(AGENT_ID, PARKED, SECRET)
                agent_port = await tg.start(partial(agent.serve, process, host="127.0.0.1", port=0))
                await k.register(AGENT_ID, f"http://127.0.0.1:{agent_port}/webhook", SECRET)
                created = await client.create(AGENT_ID, {"n": 1})
                await reached.wait()
            go.set()  # the kernel is gone: the next step is refused...
            await refused.wait()
            async with kernel_at(port, db, lease_timeout_s=60) as k, Client(k.url) as client:
                final = await client.wait(created.id)  # ...until it is back
            tg.cancel_scope.cancel()

    assert (final.status, final.output) == ("completed", [1, 2]), final.failure_reason
    assert bodies == ["record 1", "record 2"]
    assert spy.count("fail_execution") == 0


@pytest.mark.parametrize("swallow", [False, True], ids=["raised", "swallowed"])
async def test_a_kernel_gone_for_good_unwinds_without_reporting(
    tmp_path: Path, swallow: bool
) -> None:
    """Refused past the retry budget, the handler's step raises
    `KernelUnreachable`: like a lost lease, the dispatch unwinds (even if the
    handler swallows it) and reports nothing, so the execution is not failed.
    The kernel, back later, delivers it again and it completes."""
    port, db = free_port(), tmp_path / "kernel.db"
    reached, go = anyio.Event(), anyio.Event()
    seen: list[BaseException] = []

    async def process(n: int) -> Any:
        first = await record(n)
        reached.set()
        await go.wait()
        try:
            return [first, await record(n + 1)]
        except KernelUnreachable as err:
            seen.append(err)
            if swallow:
                return "pretending all is well"
            raise

    agent = Agent(AGENT_ID, secret=SECRET, base_url=f"http://127.0.0.1:{port}", kernel_timeout=0.5)
    spy = KernelSpy(agent)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            async with kernel_at(port, db, lease_timeout_s=1) as k, Client(k.url) as client:
                await k.register(AGENT_ID, PARKED, SECRET)
                agent_port = await tg.start(partial(agent.serve, process, host="127.0.0.1", port=0))
                await k.register(AGENT_ID, f"http://127.0.0.1:{agent_port}/webhook", SECRET)
                created = await client.create(AGENT_ID, {"n": 1})
                await reached.wait()
            go.set()
            await agent.join()  # unwound once the 0.5 s budget is spent
            assert [type(err) for err in seen] == [KernelUnreachable]
            assert spy.count("complete_execution") + spy.count("fail_execution") == 0
            async with kernel_at(port, db, lease_timeout_s=1) as k, Client(k.url) as client:
                final = await client.wait(created.id)
            tg.cancel_scope.cancel()

    assert (final.status, final.output) == ("completed", [1, 2]), final.failure_reason
    assert bodies == ["record 1", "record 2"]
    assert spy.count("fail_execution") == 0

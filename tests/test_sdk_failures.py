"""How a handler's outcome ends the execution (SEED 004 failure table,
PROTOCOL.md §5.3), with real kernel decisions from a policy bundle: a return
completes; `Blocked` / `Terminated` (raised, or swallowed and re-raised by the
agent) and `LeaseSuperseded` unwind and leave the kernel's state standing;
denials, rate limits, tool errors and anything else fail it with a reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from kernels import inprocess_kernel
from sdk_support import AGENT_ID, SECRET, KernelSpy, served, steps

from rebuno_anyio import (
    Agent,
    Blocked,
    Client,
    LeaseSuperseded,
    PolicyError,
    RateLimited,
    Terminated,
    execution,
    step,
    tool,
)
from rebuno_anyio.policy import policy_hook

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
    assert bodies == {"rate_limited": ["search"], "tool_error": ["explode"]}.get(
        process.__name__, []
    )
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

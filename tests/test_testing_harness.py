"""`rebuno_anyio.testing`: a user's real agent under the offline harness, with
each fault it offers -- a crash, a duplicate or late webhook, a lapsed lease,
a denial, an approval granted, denied or left to expire -- on asyncio and trio.

Nothing here sleeps: tests wait on the harness (which follows the kernel's
event log) or on events the handlers set, and time moves by `advance`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx
import pytest
import trio.testing
from harness_examples import shop
from harness_examples.shop import ORDER, ledger

from rebuno_anyio import (
    Agent,
    LeaseSuperseded,
    PolicyError,
    execution,
    http_client,
    step,
    tool,
)
from rebuno_anyio.store import MemoryStore
from rebuno_anyio.testing import (
    DENY_RULE,
    HOLD_RULE,
    AgentHarness,
    HarnessError,
    HarnessTimeout,
)
from rebuno_proto import Approval as ApprovalRecord
from rebuno_proto import ApprovalStatus

pytestmark = pytest.mark.anyio
DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"

ALL_EFFECTS = ["reserve mug", "charge 7", "email buyer@example.com"]
OUTPUT = {"hold": "held-mug", "charge": "ch_7", "courier": "fast-co", "mail": "sent"}


@pytest.fixture(autouse=True)
def fresh_ledger() -> Iterator[None]:
    ledger.clear()
    yield
    ledger.clear()


# -- the plain run ---------------------------------------------------------------------------


@pytest.mark.parametrize("signing", ["v1", "body"])
async def test_runs_the_real_handler_over_the_wire(signing: Literal["v1", "body"]) -> None:
    agent = Agent("shop", secret="shop-secret", base_url="http://unused:1", signing=signing)
    async with AgentHarness(agent, shop.process) as h:
        run = await h.run(ORDER)
        assert run.status == "completed", run.failure_reason
        assert run.output == OUTPUT
        assert ledger == ALL_EFFECTS
        steps = await h.steps(run.id)
        assert [(s.kind, s.target, s.status) for s in steps] == [
            ("tool_call", "reserve", "succeeded"),
            ("tool_call", "charge", "succeeded"),
            ("local", "pick_courier", "succeeded"),
            ("tool_call", "send_email", "succeeded"),
        ]
        assert [d.attempt for d in h.deliveries(run.id)] == [1]
        assert [r.outcome for r in h.runs(run.id)] == ["returned"]
        types = [e.type for e in await h.events(run.id)]
        assert types[0] == "execution.created"
        assert types[-1] == "execution.completed"
        # The agent published its input schema over the signed metadata route.
        described = await h.client.get_agent("shop")
        assert set(described.input_schema["properties"]) == {"order", "sku", "cents"}


async def test_an_agent_id_and_a_sync_handler_will_do() -> None:
    def double(x: int) -> int:
        return x * 2

    async with AgentHarness("calc", double) as h:
        run = await h.run({"x": 21})
        assert (run.status, run.output) == ("completed", 42)
        assert [r.outcome for r in h.runs()] == ["returned"]


class _Doubler:
    """A handler that is no coroutine function but returns an awaitable."""

    def __init__(self, parked: anyio.Event, gate: anyio.Event) -> None:
        self.parked, self.gate = parked, gate

    async def __call__(self, x: int) -> int:
        self.parked.set()
        await self.gate.wait()
        if x < 0:
            raise ValueError(f"no {x}")
        return x * 2


async def _gated_double(parked: anyio.Event, gate: anyio.Event, x: int) -> int:
    return await _Doubler(parked, gate)(x)


@pytest.mark.parametrize("kind", ["callable object", "partial"])
async def test_a_handler_returning_an_awaitable_runs_until_it_is_awaited(
    kind: str, anyio_backend: Any
) -> None:
    parked, gate = anyio.Event(), anyio.Event()
    handler: Any = (
        _Doubler(parked, gate)
        if kind == "callable object"
        else functools.partial(_gated_double, parked, gate)
    )
    # An object with `async def __call__` is awaited on the event loop, as an
    # async def function is (on trio too, which refuses a coroutine returned
    # from a worker thread).
    async with AgentHarness("calc", handler) as h:
        started = await h.start({"x": 21})
        with anyio.fail_after(5):
            await parked.wait()
        assert [r.outcome for r in h.runs()] == ["running"]  # not over at the call
        gate.set()
        run = await h.wait(started.id)
        assert (run.status, run.output) == ("completed", 42)
        assert [r.outcome for r in h.runs()] == ["returned"]
        failed = await h.run({"x": -1})
        assert (failed.status, failed.failure_reason) == (
            "failed",
            "agent_error: ValueError: no -1",
        )
        (broken,) = h.runs(failed.id)
        assert broken.outcome == "ValueError"
        assert isinstance(broken.error, ValueError)


async def test_signatures_hold_however_far_the_clock_moves() -> None:
    # The agent signs with the kernel's clock: an hour on (far past the 300 s
    # skew window of real time) its requests still verify.
    async with AgentHarness(shop.agent, shop.process) as h:
        await h.advance(3600)
        run = await h.run(ORDER)
        assert run.status == "completed", run.failure_reason


async def test_a_failing_handler_fails_the_execution_with_its_traceback() -> None:
    async def broken(x: int) -> int:
        raise ValueError(f"no {x}")

    async with AgentHarness("broken", broken) as h:
        run = await h.run({"x": 3})
        assert (run.status, run.failure_reason) == ("failed", "agent_error: ValueError: no 3")
        (only,) = h.runs(run.id)
        assert only.outcome == "ValueError"
        assert isinstance(only.error, ValueError)
        assert only.error.__traceback__ is not None


# -- crash and redelivery ------------------------------------------------------------------


async def test_crash_after_two_steps_replays_them_on_redelivery() -> None:
    async with AgentHarness(shop.agent, shop.process, crash_after_steps=2) as h:
        run = await h.run(ORDER)
        assert run.status == "completed", run.failure_reason
        assert run.output == OUTPUT
        # Two bodies ran before the crash; the redelivery replayed them.
        assert ledger == ALL_EFFECTS
        assert [(r.attempt, r.instance, r.outcome) for r in h.runs(run.id)] == [
            (1, 0, "crashed"),
            (2, 1, "returned"),
        ]
        assert [(d.attempt, d.instance) for d in h.deliveries(run.id)] == [(1, 0), (2, 1)]
        steps = await h.steps(run.id)
        assert len(steps) == 4
        assert all(s.status == "succeeded" for s in steps)


async def test_crash_on_demand_hits_only_the_next_delivery() -> None:
    async with AgentHarness(shop.agent, shop.process) as h:
        first = await h.run(ORDER)
        h.crash_next_delivery(after_steps=1)
        second = await h.run({**ORDER, "order": 8})
        third = await h.run({**ORDER, "order": 9})
        assert [x.status for x in (first, second, third)] == ["completed"] * 3
        assert [r.outcome for r in h.runs(second.id)] == ["crashed", "returned"]
        assert [r.outcome for r in h.runs(third.id)] == ["returned"]
        assert ledger.count("reserve mug") == 3  # once per execution, crash or not
        assert [e for e in ledger if e.startswith("charge")] == ["charge 7", "charge 8", "charge 9"]


async def test_a_crash_takes_down_every_execution_on_the_instance() -> None:
    parked, gate = anyio.Event(), anyio.Event()
    effects: list[str] = []

    @tool("mark")
    async def mark(text: str) -> str:
        effects.append(text)
        return text

    async def process(name: str) -> str:
        await mark(f"{name} 1")
        if name == "b" and execution().dispatch_attempt == 1:
            parked.set()
            await gate.wait()  # never set: only the crash ends this run
        await mark(f"{name} 2")
        return name

    async with AgentHarness("pair", process) as h:
        b = await h.start({"name": "b"})
        with anyio.fail_after(5):
            await parked.wait()
        h.crash_next_delivery(after_steps=1)
        a = await h.run({"name": "a"})
        b_done = await h.wait(b.id)
        assert (a.status, b_done.status) == ("completed", "completed")
        assert sorted(effects) == ["a 1", "a 2", "b 1", "b 2"]  # each body once
        for execution_id in (a.id, b.id):
            assert [(r.instance, r.outcome) for r in h.runs(execution_id)] == [
                (0, "crashed"),
                (1, "returned"),
            ]


def test_crash_needs_a_step() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        AgentHarness(shop.agent, shop.process, crash_after_steps=0)


# -- duplicate webhooks ------------------------------------------------------------------------


async def test_duplicate_webhook_runs_the_handler_once() -> None:
    async with AgentHarness(shop.agent, shop.process) as h:
        h.duplicate_next_webhook()
        run = await h.run(ORDER)
        assert run.status == "completed"
        deliveries = h.deliveries(run.id)
        assert [(d.attempt, d.status, d.is_duplicate) for d in deliveries] == [
            (1, 200, False),
            (1, 200, True),
        ]
        assert len(h.runs(run.id)) == 1
        assert ledger == ALL_EFFECTS


async def test_late_duplicate_of_a_finished_execution_changes_nothing() -> None:
    async with AgentHarness(shop.agent, shop.process) as h:
        run = await h.run(ORDER)
        assert await h.resend_last_webhook(run.id) == 200
        await h.wait_for_run(run.id)
        assert len(h.deliveries(run.id)) == 2
        assert len(h.runs(run.id)) == 1  # the agent saw it was completed
        assert ledger == ALL_EFFECTS
        with pytest.raises(HarnessError, match="no webhook"):
            await h.resend_last_webhook("0192f1a0-0000-7000-8000-000000000000")


# -- lease expiry ---------------------------------------------------------------------------


async def test_lease_expiry_redelivers_and_the_stalled_handler_is_refused() -> None:
    stalled, let_old_go, let_new_finish = anyio.Event(), anyio.Event(), anyio.Event()
    effects: list[str] = []

    @tool("note")
    async def note(text: str) -> str:
        effects.append(text)
        return text

    async def process(n: int) -> str:
        await note(f"first {n}")
        if execution().dispatch_attempt == 1:
            stalled.set()
            await let_old_go.wait()  # stalled past its lease
        else:
            await let_new_finish.wait()
        return await note(f"second {n}")

    async with AgentHarness("noter", process) as h:
        started = await h.start({"n": 1})
        with anyio.fail_after(5):
            await stalled.wait()
        await h.expire_lease(started.id)
        let_old_go.set()
        old = await h.wait_for_run(started.id, attempt=1)
        assert old.outcome == "LeaseSuperseded"
        assert isinstance(old.error, LeaseSuperseded)
        let_new_finish.set()
        run = await h.wait(started.id)
        assert (run.status, run.output) == ("completed", "second 1")
        assert effects == ["first 1", "second 1"]  # the refused call never ran its body
        assert [(d.attempt, d.instance) for d in h.deliveries(run.id)] == [(1, 0), (2, 1)]
        assert [(r.attempt, r.outcome) for r in h.runs(run.id)] == [
            (1, "LeaseSuperseded"),
            (2, "returned"),
        ]


def _gated_marker(
    effects: list[str], parked: dict[str, anyio.Event], gates: dict[str, anyio.Event]
) -> Any:
    """A handler that records a step, then (on its first delivery, for the
    names in `gates`) says so in `parked` and waits for its gate."""

    @tool("mark")
    async def mark(text: str) -> str:
        effects.append(text)
        return text

    async def process(name: str) -> str:
        await mark(f"{name} 1")
        if name in gates and execution().dispatch_attempt == 1:
            parked[name].set()
            await gates[name].wait()
        return await mark(f"{name} 2")

    return process


async def test_expiring_one_lease_leaves_the_other_handlers_their_own() -> None:
    effects: list[str] = []
    parked = {"a": anyio.Event(), "b": anyio.Event()}
    gates = {"a": anyio.Event(), "b": anyio.Event()}
    async with AgentHarness("pair", _gated_marker(effects, parked, gates)) as h:
        a = await h.start({"name": "a"})
        b = await h.start({"name": "b"})
        with anyio.fail_after(5):
            await parked["a"].wait()
            await parked["b"].wait()
        await h.expire_lease(a.id)
        gates["a"].set()
        assert (await h.wait_for_run(a.id, attempt=1)).outcome == "LeaseSuperseded"
        gates["b"].set()
        a_done, b_done = await h.wait(a.id), await h.wait(b.id)
        assert (a_done.status, b_done.status) == ("completed", "completed")
        # b ran once, on the instance that was cut off, under its first lease.
        assert [(d.attempt, d.instance) for d in h.deliveries(b.id)] == [(1, 0)]
        assert [(r.attempt, r.instance, r.outcome) for r in h.runs(b.id)] == [(1, 0, "returned")]
        assert [(r.attempt, r.instance, r.outcome) for r in h.runs(a.id)] == [
            (1, 0, "LeaseSuperseded"),
            (2, 1, "returned"),
        ]
        assert sorted(effects) == ["a 1", "a 2", "b 1", "b 2"]


async def test_time_moving_past_the_lease_timeout_keeps_a_live_handlers_lease() -> None:
    effects: list[str] = []
    parked, gates = {"a": anyio.Event()}, {"a": anyio.Event()}
    async with AgentHarness("slow", _gated_marker(effects, parked, gates), lease_timeout_s=30) as h:
        started = await h.start({"name": "a"})
        with anyio.fail_after(5):
            await parked["a"].wait()
        await h.advance(30)
        await h.advance(3600)  # its heartbeats would have renewed it all along
        assert (await h.execution(started.id)).status == "running"
        gates["a"].set()
        run = await h.wait(started.id)
        assert run.status == "completed"
        assert [d.attempt for d in h.deliveries(run.id)] == [1]
        assert [(r.attempt, r.outcome) for r in h.runs(run.id)] == [(1, "returned")]


async def test_a_crash_lapses_only_the_crashed_instances_leases() -> None:
    effects: list[str] = []
    parked = {"b": anyio.Event(), "c": anyio.Event()}
    gates = {"b": anyio.Event(), "c": anyio.Event()}
    async with AgentHarness("trio_of_runs", _gated_marker(effects, parked, gates)) as h:
        b = await h.start({"name": "b"})
        c = await h.start({"name": "c"})
        with anyio.fail_after(5):
            await parked["b"].wait()
            await parked["c"].wait()
        await h.expire_lease(c.id)  # instance 1 comes up; b stays on instance 0
        assert (await h.wait(c.id)).status == "completed"
        h.crash_next_delivery(after_steps=1)
        a = await h.run({"name": "a"})  # instance 1 crashes; instance 2 comes up
        assert a.status == "completed"
        assert [(r.instance, r.outcome) for r in h.runs(a.id)] == [(1, "crashed"), (2, "returned")]
        gates["b"].set()
        assert (await h.wait(b.id)).status == "completed"
        assert [(r.attempt, r.instance, r.outcome) for r in h.runs(b.id)] == [(1, 0, "returned")]
        gates["c"].set()


@pytest.mark.parametrize("fault", ["crash", "expire_lease"])
async def test_a_delivery_to_the_fresh_instance_keeps_its_lease(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A delivery can reach the fresh instance after it came up and before the
    # harness moves the clock to lapse the old lease: that move renews it. The
    # test widens that window on purpose, through the harness's own fleet,
    # delivering a new execution there and waiting until its handler runs.
    effects: list[str] = []
    parked = {"a": anyio.Event(), "e": anyio.Event()}
    gates = {"a": anyio.Event(), "e": anyio.Event()}
    async with AgentHarness("fresh", _gated_marker(effects, parked, gates)) as h:
        fleet = h._fleet
        start_instance = fleet.start_instance
        late: list[str] = []

        async def start_then_deliver(tg: Any) -> Any:
            instance = await start_instance(tg)
            if not late:
                late.append((await h.start({"name": "e"})).id)
                with anyio.fail_after(5):
                    await parked["e"].wait()
            return instance

        monkeypatch.setattr(fleet, "start_instance", start_then_deliver)
        if fault == "crash":
            h.crash_next_delivery(after_steps=1)
            a = await h.start({"name": "a"})  # its first step crashes instance 0
        else:
            a = await h.start({"name": "a"})
            with anyio.fail_after(5):
                await parked["a"].wait()
            await h.expire_lease(a.id)
            gates["a"].set()
        assert (await h.wait(a.id)).status == "completed"
        (e_id,) = late
        gates["e"].set()
        assert (await h.wait(e_id)).status == "completed"
        assert [(d.attempt, d.instance) for d in h.deliveries(e_id)] == [(1, 1)]
        assert [(r.attempt, r.instance, r.outcome) for r in h.runs(e_id)] == [(1, 1, "returned")]


async def test_expiring_a_lease_that_is_not_held_is_an_error() -> None:
    async with AgentHarness(shop.agent, shop.process) as h:
        run = await h.run(ORDER)
        with pytest.raises(HarnessError, match="holds no lease"):
            await h.expire_lease(run.id)


# -- policy: denial -----------------------------------------------------------------------------


async def test_denied_step_raises_the_policy_error_in_the_handler() -> None:
    async with AgentHarness(shop.agent, shop.audit, deny="read_*") as h:  # one glob
        run = await h.run({"order": 7})
        assert (run.status, run.failure_reason) == (
            "failed",
            "policy_denied: denied by the test",
        )
        assert ledger == ["audit refused"]
        (only,) = h.runs(run.id)
        assert isinstance(only.error, PolicyError)
        (denied,) = await h.steps(run.id)
        assert (denied.status, denied.rule_id) == ("denied", DENY_RULE)


async def test_a_denied_tool_returns_its_refusal_until_the_rule_goes() -> None:
    async with AgentHarness(shop.agent, shop.process, deny={"send_*": "no mail in tests"}) as h:
        run = await h.run(ORDER)
        assert run.status == "completed"
        assert run.output["mail"].startswith("send_email not allowed. reason: ")
        assert "no mail in tests" in run.output["mail"]
        assert "email buyer@example.com" not in ledger
        del h.deny["send_*"]  # the rules may change while the harness runs
        again = await h.run({**ORDER, "order": 8})
        assert again.output["mail"] == "sent"
        assert ledger.count("email buyer@example.com") == 1


async def test_the_agents_own_bundle_decides_what_the_test_does_not() -> None:
    bundle = """
default_action: allow
rules:
  - id: no-couriers
    priority: 1
    when: {target: pick_courier}
    then: {decision: deny, reason: couriers_on_strike}
"""
    async with AgentHarness(shop.agent, shop.process, policy=bundle, deny={"reserve_*"}) as h:
        run = await h.run(ORDER)
        assert (run.status, run.failure_reason) == ("failed", "couriers_on_strike")
        assert ledger == ["reserve mug", "charge 7"]
        steps = await h.steps(run.id)
        assert (steps[-1].target, steps[-1].rule_id) == ("pick_courier", "no-couriers")


def test_a_bundle_that_does_not_load_fails_at_once() -> None:
    with pytest.raises(ValueError, match="default_action"):
        AgentHarness(shop.agent, shop.process, policy="default_action: maybe\n")


# -- policy: approvals ----------------------------------------------------------------------------


async def test_granted_approval_runs_the_held_step_once() -> None:
    async with AgentHarness(shop.agent, shop.process, require_approval={"charge"}) as h:
        started = await h.start(ORDER)
        approval = await h.wait_for_approval(started.id)
        assert approval.rule_id == HOLD_RULE
        assert (await h.execution(started.id)).status == "blocked"
        assert (await h.wait_for_run(started.id, attempt=1)).outcome == "Blocked"
        assert ledger == ["reserve mug"]  # held: not charged yet
        await h.grant_approval(approval.id)
        run = await h.wait(started.id)
        assert run.status == "completed", run.failure_reason
        assert ledger == ALL_EFFECTS  # charged once, reserved once
        assert [a.id for a in await h.approvals(started.id, status="granted")] == [approval.id]


async def test_denied_approval_refuses_the_held_step() -> None:
    async with AgentHarness(shop.agent, shop.audit, require_approval={"read_audit_log"}) as h:
        started = await h.start({"order": 7})
        approval = await h.wait_for_approval(started.id)
        await h.deny_approval(approval.id)
        run = await h.wait(started.id)
        assert (run.status, run.failure_reason) == ("failed", "approval_denied")
        assert ledger == ["audit refused"]
        assert await h.approvals(started.id) == []


async def test_an_approval_behind_a_thousand_others_is_found() -> None:
    async with AgentHarness(
        shop.agent, shop.audit, require_approval={"read_audit_log"}, timeout_s=5
    ) as h:
        # A busy kernel: a thousand older approvals of other executions.
        assert isinstance(h.kernel.store, MemoryStore)
        table = h.kernel.store.records.approvals
        for n in range(1000):
            approval_id = str(uuid.UUID(int=n + 1))
            table[approval_id] = ApprovalRecord(
                id=approval_id,
                execution_id=str(uuid.UUID(int=10_000 + n)),
                step_id=f"{n:064x}",
                status=ApprovalStatus.PENDING,
                created_at=h.clock() - 1,
                timeout_at=h.clock() + 86_400,
            )
        started = await h.start({"order": 7})
        approval = await h.wait_for_approval(started.id)
        assert approval.execution_id == started.id
        assert [a.id for a in await h.approvals(started.id)] == [approval.id]
        assert len(await h.approvals()) == 1001
        assert len(await h.approvals(status="all")) == 1001
        assert await h.approvals(started.id, status="granted") == []
        with pytest.raises(ValueError, match="status"):
            await h.approvals(status="decided")


async def test_an_approval_left_waiting_expires_when_time_moves() -> None:
    async with AgentHarness(
        shop.agent, shop.audit, require_approval={"read_audit_log"}, approval_timeout_s=60
    ) as h:
        started = await h.start({"order": 7})
        approval = await h.wait_for_approval(started.id)
        await h.advance(59)
        assert (await h.execution(started.id)).status == "blocked"
        await h.advance(1)
        # Expired by the time advance returns, not whenever a timer next looks.
        assert [a.id for a in await h.approvals(started.id, status="expired")] == [approval.id]
        run = await h.wait(started.id)
        assert (run.status, run.failure_reason) == ("failed", "approval_timeout")


# -- timeouts, errors, cleanup ------------------------------------------------------------------


async def test_a_wait_that_runs_out_says_where_the_execution_stands() -> None:
    parked, never = anyio.Event(), anyio.Event()

    async def stuck(x: int) -> int:
        await step("before", lambda: 1)
        parked.set()
        await never.wait()
        return x

    async with AgentHarness("stuck", stuck, timeout_s=0.05) as h:
        started = await h.start({"x": 1})
        with anyio.fail_after(5):
            await parked.wait()
        with pytest.raises(HarnessTimeout) as caught:
            await h.wait(started.id)
        message = str(caught.value)
        assert f"execution {started.id} did not reach status " in message
        assert "within 0.05 s: it is running" in message
        assert "step.succeeded" in message
        assert "outcome='running'" in message
        # A bad status is refused before any waiting.
        with pytest.raises(ValueError, match="until"):
            await h.wait(started.id, until="finished")


async def test_a_kernel_failure_surfaces_instead_of_hanging() -> None:
    class Exploding(dict[str, str]):
        def items(self) -> Any:
            raise RuntimeError("policy exploded")

    async def run_it() -> None:
        async with AgentHarness(shop.agent, shop.process) as h:
            h.policy.deny = Exploding()
            await h.run(ORDER)

    with pytest.raises(HarnessError, match="policy exploded") as caught:
        await run_it()
    assert "kernel API raised on POST /v0/executions/" in str(caught.value)


async def test_a_kernel_error_is_only_its_own_harnesses() -> None:
    async def exploding_claim(execution_id: str) -> Any:
        raise RuntimeError("claim exploded")

    async def run_loud() -> None:
        async with AgentHarness("loud", shop.process) as loud:
            # Logged by loud's dispatcher, not raised at an API call.
            loud.kernel.claim = exploding_claim  # type: ignore[method-assign]
            started = await loud.start(ORDER)
            await loud.wait(started.id)

    async with AgentHarness(shop.agent, shop.process) as quiet:
        with pytest.raises(HarnessError, match="claim exploded") as caught:
            await run_loud()  # open while quiet is
        assert "dispatcher: claiming the dispatch of execution" in str(caught.value)
        run = await quiet.run(ORDER)  # quiet heard nothing of it
        assert run.status == "completed"
        assert quiet.runs(run.id)[0].outcome == "returned"


async def test_leaving_waits_for_a_handler_blocked_in_a_worker_thread() -> None:
    release = threading.Event()
    blocked, leaving = anyio.Event(), anyio.Event()
    exited: list[bool] = []
    released_while_leaving: list[bool] = []

    def slow(x: int) -> int:
        anyio.from_thread.run_sync(blocked.set)
        release.wait(30)  # a synchronous call: nothing can cancel it
        return x

    async def release_once_all_wait() -> None:
        await leaving.wait()
        await anyio.wait_all_tasks_blocked()  # the harness is waiting for the thread
        released_while_leaving.append(not exited)
        release.set()

    h = AgentHarness("slow", slow, timeout_s=0.05)

    async def time_out_inside() -> None:
        async with h:
            started = await h.start({"x": 1})
            with anyio.fail_after(5):
                await blocked.wait()
            try:
                await h.wait(started.id)  # runs out: the thread is still blocked
            finally:
                leaving.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_once_all_wait)
        with pytest.raises(HarnessTimeout, match=r"within 0\.05 s"):
            await time_out_inside()
        exited.append(True)
    assert released_while_leaving == [True]  # leaving the block waited for the thread
    assert [r.outcome for r in h.runs()] == ["returned"]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_no_task_outlives_the_harness() -> None:
    never = anyio.Event()

    async def forever(x: int) -> int:
        await never.wait()
        return x

    before = asyncio.all_tasks()
    async with AgentHarness("forever", forever) as h:
        await h.start({"x": 1})
        await h.start({"x": 2})
        assert len(asyncio.all_tasks()) > len(before)
    assert asyncio.all_tasks() == before


@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0.01)})]
)
async def test_trio_virtual_time_runs_the_harness_and_its_timeouts() -> None:
    never = anyio.Event()

    async def stuck(x: int) -> int:
        await step("before", lambda: x)  # a worker thread: the reason for the threshold
        await never.wait()
        return x

    # Virtual time: a generous timeout costs nothing, and covers a slow thread.
    async with AgentHarness(shop.agent, shop.process, crash_after_steps=2, timeout_s=86400) as h:
        run = await h.run(ORDER)
        assert run.status == "completed"
        assert ledger == ALL_EFFECTS
    async with AgentHarness("stuck", stuck, timeout_s=600) as h:
        started = anyio.current_time()
        with pytest.raises(HarnessTimeout, match="within 600 s"):
            await h.run({"x": 1})
        assert anyio.current_time() - started >= 600  # ten minutes, in virtual time


async def test_a_harness_runs_once() -> None:
    h = AgentHarness(shop.agent, shop.process)
    async with h:
        pass
    with pytest.raises(RuntimeError, match="runs once"):
        async with h:
            pass


# -- what docs/testing.md promises beyond its example ------------------------------------------


async def test_advance_sends_a_delivery_that_waits_out_its_backoff() -> None:
    async with AgentHarness(shop.agent, shop.process, timeout_s=0.5) as h:
        # Point the registration at a path the agent does not serve: 404.
        await h.kernel.update_agent("shop", webhook_url="http://agent.harness.invalid/nope")
        started = await h.start(ORDER)
        await _until_logged(h, started.id, "dispatch.failed")
        assert [d.status for d in h.deliveries(started.id)] == [404]
        await h.kernel.update_agent("shop", webhook_url="http://agent.harness.invalid/webhook")
        await anyio.wait_all_tasks_blocked()  # the dispatcher sleeps until the retry is due
        await h.advance(0.5)  # the first backoff is 1 s: not yet
        await anyio.wait_all_tasks_blocked()
        assert len(h.deliveries(started.id)) == 1
        await h.advance(0.5)
        run = await h.wait(started.id)
        assert run.status == "completed"
        assert [(d.attempt, d.status) for d in h.deliveries(run.id)] == [(1, 404), (2, 200)]


async def _until_logged(h: AgentHarness, execution_id: str, kind: str) -> None:
    """Wait (on the kernel's long poll) until the execution logs an event of `kind`."""
    after = 0
    with anyio.fail_after(5):
        while True:
            page = await h.client.events(execution_id, after_seq=after, limit=1000, wait=30)
            if any(e.type == kind for e in page):
                return
            after = page[-1].event_seq if page else after


async def test_llm_calls_replay_after_a_crash() -> None:
    asked: list[str] = []

    def provider(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["messages"][0]["content"]
        asked.append(prompt)
        return httpx.Response(200, json={"choices": [{"message": {"content": prompt.upper()}}]})

    @tool("remember")
    async def remember(text: str) -> str:
        return text

    async def process(question: str) -> str:
        async with http_client(
            base_url="https://llm.example/v1", transport=httpx.MockTransport(provider)
        ) as llm:
            reply = await llm.post(
                "/chat/completions",
                json={"model": "m1", "messages": [{"role": "user", "content": question}]},
            )
        answer: str = reply.json()["choices"][0]["message"]["content"]
        return await remember(answer)

    async with AgentHarness("asker", process, crash_after_steps=1) as h:
        run = await h.run({"question": "hello"})
        assert (run.status, run.output) == ("completed", "HELLO")
        assert asked == ["hello"]  # the redelivery got the recorded answer
        assert [r.outcome for r in h.runs(run.id)] == ["crashed", "returned"]
        assert [s.kind for s in await h.steps(run.id)] == ["llm_call", "tool_call"]


# -- docs/testing.md: its example runs ----------------------------------------------------------


def doc_files() -> list[tuple[str, str]]:
    """The python blocks of "Testing your own agent offline", each with the file
    it belongs to (its first line names it: `# billing.py`, maybe with a note in
    parentheses). Blocks of one file run in one namespace, in order."""
    text = DOC.read_text("utf-8")
    section = text.split("\n## Testing your own agent offline\n", 1)[1].split("\n## ", 1)[0]
    files = []
    for block in re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M):
        named = re.fullmatch(r"# (\w+)\.py(?: \(.*\))?", block.splitlines()[0])
        assert named, f"a python block must start with '# <file>.py': {block.splitlines()[0]!r}"
        files.append((named.group(1), block))
    return files


def test_the_doc_example_is_whole() -> None:
    assert [name for name, _ in doc_files()] == ["billing", "test_billing", "conftest", "conftest"]


async def test_the_doc_example_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    modules: dict[str, types.ModuleType] = {}
    for name, code in doc_files():
        module = modules.setdefault(name, types.ModuleType(name))
        if name != "conftest":  # pytest's own conftest module keeps its name
            monkeypatch.setitem(sys.modules, name, module)
        exec(compile(code, f"docs/testing.md ({name}.py)", "exec"), module.__dict__)
    tests = {n: f for n, f in vars(modules["test_billing"]).items() if n.startswith("test_")}
    assert len(tests) == 4
    for test in tests.values():
        await test()
    assert modules["billing"].charges == []  # the last test: the approval expired

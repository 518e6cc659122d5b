"""A `proceed` that comes back after the lease may have lapsed is not acted on
(`rebuno_proto.may_start_body`): found by the simulator (harsh seed 1334), where
a frozen agent process woke with a `proceed` in its buffer and ran an
at_most_once body the kernel had meanwhile failed as indeterminate."""

from __future__ import annotations

import pytest

import rebuno_anyio.agent._context as context_module
from rebuno_anyio import Agent, tool
from rebuno_anyio.testing import AgentHarness
from rebuno_proto import RENEW_EVERY_S, may_start_body

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("elapsed", "lease", "allowed"),
    [
        (0.0, 120.0, True),
        (118.9, 120.0, True),
        (119.0, 120.0, False),  # a renewal may be up to RENEW_EVERY_S old
        (500.0, 120.0, False),
        (0.4, 1.0, True),  # a lease under two renewal periods keeps half as margin
        (0.5, 1.0, False),
    ],
)
def test_may_start_body(elapsed: float, lease: float, allowed: bool) -> None:
    assert RENEW_EVERY_S == 1.0
    assert may_start_body(asked_at=50.0, now=50.0 + elapsed, lease_timeout_s=lease) is allowed


class _Frozen:
    """A monotonic clock that jumps `freeze_s` between a submit and its answer,
    as if the process froze with the answer in its buffer."""

    def __init__(self, freeze_s: float) -> None:
        self.now = 1000.0
        self.freeze_s = freeze_s
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the second reading of each submit: the answer
            self.now += self.freeze_s
        return self.now


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> _Frozen:
    clock = _Frozen(freeze_s=10_000.0)
    monkeypatch.setattr(context_module, "_monotonic", clock)
    return clock


sent: list[str] = []


@tool("send_email", idempotency="at_most_once")
async def send_email(to: str) -> str:
    sent.append(to)
    return "sent"


async def mailer(to: str) -> str:
    return await send_email(to)


AGENT = Agent("mailer", secret="s", base_url="http://127.0.0.1:1")


async def test_a_late_proceed_stops_the_handler_without_running_the_body(
    frozen: _Frozen,
) -> None:
    sent.clear()
    async with AgentHarness(AGENT, mailer) as h:
        started = await h.start({"to": "ada@example.com"})
        run = await h.wait_for_run(started.id)
        assert run.outcome == "LeaseSuperseded"
        assert "came back after 10000.0 s" in str(run.error)
        assert sent == []  # the body never started
        assert frozen.calls >= 2


async def test_a_prompt_proceed_runs_the_body() -> None:
    sent.clear()
    async with AgentHarness(AGENT, mailer) as h:
        run = await h.run({"to": "ada@example.com"})
        assert run.status == "completed"
        assert sent == ["ada@example.com"]

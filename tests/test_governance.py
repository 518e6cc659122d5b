"""Governance end to end: policy bundles, approvals, approvers, principals, rate limits.

The kernel runs in its own process (`rebuno dev`, or `rebuno server` for named
principals) and the agent (`tests/agents/governed_agent.py`) in its own, on
asyncio and on trio. Policies are loaded with the `rebuno` command or the API,
approvals are decided from the command line, the API or `rebuno_anyio.Client`.
Tool and step bodies append a line to a counter file, so a test counts how
often each body ran across agent processes. Nothing sleeps: tests wait on
process output, on the kernel's long-polled event log, or on process exit, each
with a deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from procs import ROOT, AgentProc, Kernel, Proc, reap

from rebuno_anyio import Client, ForbiddenError

SCRIPT = Path(__file__).resolve().parent / "agents" / "governed_agent.py"
SECRET = "gov-secret"
PARKED = "http://127.0.0.1:9/webhook"  # where an agent is registered before it listens
ADMIN, TOKA, TOKB = "gov-admin-token", "gov-alice-token", "gov-bob-token"

ALLOW_DENY = """\
default_action: deny
rules:
  - id: allow-fetch
    priority: 10
    when: {step_kind: tool_call, target: fetch}
    then: {decision: allow}
  - id: no-danger
    priority: 20
    when: {target: danger}
    then: {decision: deny, reason: "too dangerous"}
  - id: no-secrets
    priority: 30
    when: {step_kind: local, target: read_secret}
    then: {decision: deny, reason: "secrets stay put"}
"""


def gate(approvers: str = "", timeout: str = "", target: str = "deploy") -> str:
    """A bundle that allows everything but holds `target` (a tool) and the
    local step `launch` for approval."""
    config = "".join(
        f"\n        {key}: {value}"
        for key, value in (("approvers", approvers), ("timeout", timeout))
        if value
    )
    return f"""\
default_action: allow
rules:
  - id: allow-fetch
    priority: 5
    when: {{target: fetch}}
    then: {{decision: allow}}
  - id: gate-deploy
    priority: 10
    when: {{step_kind: tool_call, target: {target}}}
    then:
      decision: require_approval
      approval_config:
        message: "deploying needs a human"{config}
  - id: gate-launch
    priority: 20
    when: {{step_kind: local, target: launch}}
    then:
      decision: require_approval
      approval_config:
        message: "launching needs a human"{config}
"""


def rate(per_what: str, rule_id: str) -> str:
    return f"""\
default_action: allow
rules:
  - id: {rule_id}
    priority: 10
    when: {{target: ping}}
    then:
      decision: allow
      rate_limit: {{max_calls: 2, window: 1m, per_what: {per_what}}}
"""


# -- processes and helpers ------------------------------------------------------------


@pytest.fixture(params=["asyncio", "trio"])
def backend(request: pytest.FixtureRequest) -> str:
    """The agent processes' event loop."""
    return str(request.param)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    """One `rebuno dev` for the tests that do not restart it; each test uses
    its own agent ids."""
    proc = Kernel(tmp_path_factory.mktemp("gov") / "gov.db")
    try:
        yield proc
    finally:
        proc.stop()
        reap(proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    """`rebuno server` with an admin token and two named principals."""
    extra = ["--principal", f"alice={TOKA}", "--principal", f"bob={TOKB}"]
    proc = Kernel(tmp_path_factory.mktemp("gov-server") / "gov.db", extra=extra, server_token=ADMIN)
    try:
        yield proc
    finally:
        proc.stop()
        reap(proc)


def cli(*args: str, url: str, token: str = "") -> subprocess.CompletedProcess[str]:
    """Run `rebuno ARGS --url URL` (bearer `token`, if any) and capture it."""
    env = {**os.environ, "COLUMNS": "250", "REBUNO_API_KEY": token}
    env.pop("REBUNO_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "rebuno_anyio.cli", *args, "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.args, result.stdout, result.stderr)
    return result.stdout


def load_policy(k: Kernel, agent_id: str, bundle: str, tmp_path: Path) -> None:
    """`rebuno policy load AGENT FILE`."""
    path = tmp_path / f"{agent_id}.yaml"
    path.write_text(bundle, "utf-8")
    assert ok(cli("policy", "load", agent_id, str(path), url=k.url, token=k.token or "")) == (
        f"loaded policy for {agent_id}\n"
    )


def prepare(k: Kernel, agent_id: str, bundle: str | None, tmp_path: Path) -> None:
    """Register the agent (not listening yet) and load its policy."""
    k.register(agent_id, PARKED, SECRET)
    if bundle is not None:
        load_policy(k, agent_id, bundle, tmp_path)


@contextmanager
def agent(
    k: Kernel, agent_id: str, backend: str, counter: Path, *, exit_on_blocked: bool = False
) -> Iterator[AgentProc]:
    """Start governed_agent.py for `agent_id` and point the agent's webhook at it."""
    env = {
        "REBUNO_URL": k.url,
        "REBUNO_AGENT_SECRET": SECRET,
        "GOV_BACKEND": backend,
        "GOV_COUNTER": str(counter),
        "GOV_EXIT_ON_BLOCKED": "1" if exit_on_blocked else "0",
    }
    proc = AgentProc(SCRIPT, "0", agent_id, env=env)
    try:
        k.register(agent_id, proc.webhook_url, SECRET)
        yield proc
    finally:
        reap(proc)


def create(k: Kernel, agent_id: str, plan: list[Any], on_policy_error: str = "raise") -> str:
    body = {"agent_id": agent_id, "input": {"plan": plan, "on_policy_error": on_policy_error}}
    status, created = k.call("POST", "/v0/executions", body)
    assert status == 201, created
    return str(created["id"])


def wait_event(
    k: Kernel, execution_id: str, event_type: str, *, after: int = 0, timeout: float = 30
) -> dict[str, Any]:
    """Long-poll the event log until an event of `event_type` after `after` appears."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {event_type} in {execution_id}: {types(k.events(execution_id))}"
        wait = max(1, min(int(remaining), 10))
        path = f"/v0/executions/{execution_id}/events?after_seq={after}&limit=1000&wait={wait}"
        status, events = k.call("GET", path)
        assert status == 200, events
        for event in events:
            if event["type"] == event_type:
                return event
        if events:
            after = events[-1]["event_seq"]


def wait_exit(proc: Proc, timeout: float = 30) -> int:
    try:
        return proc.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.args[:3]} still running:\n" + "\n".join(proc.lines)) from None


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events if e["type"] != "dispatch.acked"]


def of_type(events: list[dict[str, Any]], event_type: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == event_type]


def bodies(counter: Path) -> list[tuple[int, str, dict[str, Any]]]:
    """(pid, body, args) for every tool or step body that ran."""
    if not counter.exists():
        return []
    found = []
    for line in counter.read_text("utf-8").splitlines():
        pid, name, args = line.split(" ", 2)
        found.append((int(pid), name, json.loads(args)))
    return found


def ran(counter: Path) -> list[tuple[str, dict[str, Any]]]:
    return [(name, args) for _, name, args in bodies(counter)]


def approval_of(k: Kernel, execution_id: str, status: str = "pending") -> dict[str, Any]:
    """The one approval of the execution with that status."""
    code, found = k.call("GET", f"/v0/approvals?status={status}&limit=1000")
    assert code == 200, found
    mine = [a for a in found if a["execution_id"] == execution_id]
    assert len(mine) == 1, found
    return mine[0]


def get_approval(k: Kernel, approval_id: str) -> dict[str, Any]:
    status, found = k.call("GET", f"/v0/approvals/{approval_id}")
    assert status == 200, found
    return found


def prefix(k: Kernel, approval_id: str) -> str:
    """The shortest prefix (8 characters at least) that no other approval shares."""
    status, found = k.call("GET", "/v0/approvals?status=all&limit=1000")
    assert status == 200, found
    others = [a["id"] for a in found if a["id"] != approval_id]
    for n in range(8, len(approval_id)):
        if not any(other.startswith(approval_id[:n]) for other in others):
            return approval_id[:n]
    return approval_id


def refusal(tool: str, reason: str) -> dict[str, str]:
    return {"refused": f"{tool} not allowed. reason: [policy_denied] {reason} (HTTP 403)"}


# -- allow and deny ---------------------------------------------------------------------------


def test_allow_and_deny(kernel: Kernel, backend: str, tmp_path: Path) -> None:
    agent_id, counter = f"gov-rules-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, ALLOW_DENY, tmp_path)
    assert ok(cli("policy", "show", agent_id, url=kernel.url)) == ALLOW_DENY
    with agent(kernel, agent_id, backend, counter):
        caught = create(
            kernel,
            agent_id,
            [
                ["tool", "fetch", {"item": "a"}],
                ["tool", "danger", {"what": "rm"}],
                ["tool", "deploy", {"env": "prod"}],  # no rule: the default denies
                ["step", "read_secret", {"key": "k"}],
                ["step", "clock", {}],  # an unmatched local step runs
            ],
            on_policy_error="catch",
        )
        escaped = create(kernel, agent_id, [["step", "read_secret", {"key": "k"}]])
        done = kernel.wait_terminal(caught)
        failed = kernel.wait_terminal(escaped)

    assert done["status"] == "completed", done
    assert done["output"] == [
        {"ok": "fetched a"},
        refusal("danger", "too dangerous"),
        refusal("deploy", "no explicit allow rule matched"),
        {
            "policy_error": "[policy_denied] secrets stay put (HTTP 403)",
            "reason": "secrets stay put",
            "rule_id": "no-secrets",
        },
        {"ok": "clock done"},
    ]
    assert failed["status"] == "failed", failed
    assert failed["failure_reason"] == "policy_denied: secrets stay put"
    # Denied bodies never ran.
    assert ran(counter) == [("fetch", {"item": "a"}), ("clock", {})]

    events = kernel.events(caught)
    allowed = {e["payload"]["target"]: e["payload"] for e in of_type(events, "step.allowed")}
    assert allowed["fetch"]["rule_id"] == "allow-fetch"
    assert allowed["clock"]["rule_id"] == "default"
    denied = {e["payload"]["target"]: e["payload"] for e in of_type(events, "step.denied")}
    assert set(denied) == {"danger", "deploy", "read_secret"}
    assert denied["danger"]["rule_id"] == "no-danger"
    assert denied["danger"]["error"] == {"reason": "too dangerous", "rule_id": "no-danger"}
    assert denied["deploy"]["rule_id"] == "default"
    assert denied["deploy"]["error"]["reason"] == "no explicit allow rule matched"
    assert denied["read_secret"]["error"] == {"reason": "secrets stay put", "rule_id": "no-secrets"}
    # A denial is recorded at once: proposed, then denied, with no body run between.
    seqs = [e for e in events if e["payload"].get("step_id") == denied["danger"]["step_id"]]
    assert [e["type"] for e in seqs] == ["step.proposed", "step.denied"]


# -- require approval -----------------------------------------------------------------------


def test_approval_granted_from_the_cli_in_a_new_agent_process(
    kernel: Kernel, backend: str, tmp_path: Path
) -> None:
    agent_id, counter = f"gov-grant-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, gate(), tmp_path)
    plan = [["tool", "fetch", {"item": "a"}], ["tool", "deploy", {"env": "prod"}]]
    with agent(kernel, agent_id, backend, counter, exit_on_blocked=True) as first:
        execution_id = create(kernel, agent_id, plan)
        first.wait_for(r"handler saw Blocked after 1 calls")
        assert wait_exit(first) == 0  # the dispatch unwound and the process left
    assert kernel.call("GET", f"/v0/executions/{execution_id}")[1]["status"] == "blocked"

    approval = approval_of(kernel, execution_id)
    assert (approval["rule_id"], approval["message"]) == ("gate-deploy", "deploying needs a human")
    listed = json.loads(ok(cli("approvals", "list", "--json", url=kernel.url)))
    keys = ("id", "execution_id", "step_id", "status", "rule_id", "message", "approvers")
    assert [{k: a[k] for k in keys} for a in listed if a["id"] == approval["id"]] == [
        {k: approval[k] for k in keys}
    ]
    table = ok(cli("approvals", "list", url=kernel.url))
    row = next(line for line in table.splitlines() if approval["id"] in line)
    for text in ("gate-deploy", "deploying needs a human", "pending"):
        assert text in row, table
    shown = ok(cli("approvals", "get", prefix(kernel, approval["id"]), url=kernel.url))
    assert 'tool_call deploy {"env":"prod"}' in shown, shown
    assert "anyone" in shown, shown  # no approvers named

    with agent(kernel, agent_id, backend, counter) as second:
        granted = cli(
            "approvals", "grant", prefix(kernel, approval["id"]), "--by", "alice",
            "--rationale", "ok", url=kernel.url,
        )  # fmt: skip
        assert ok(granted) == f"granted {approval['id']}\n"
        done = kernel.wait_terminal(execution_id)
    assert done["status"] == "completed", done
    assert done["output"] == [{"ok": "fetched a"}, {"ok": "deployed prod"}]
    # Each body ran exactly once: fetch in the first process, deploy in the second.
    assert [(pid, name) for pid, name, _ in bodies(counter)] == [
        (first.popen.pid, "fetch"),
        (second.popen.pid, "deploy"),
    ]
    decided = get_approval(kernel, approval["id"])
    assert (decided["status"], decided["decided_by"], decided["rationale"]) == (
        "granted",
        "alice",
        "ok",
    )

    events = kernel.events(execution_id)
    assert types(events) == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
        "step.proposed",
        "step.allowed",
        "step.executing",
        "step.succeeded",
        "step.proposed",
        "step.awaiting_approval",
        "approval.requested",
        "execution.blocked",
        "approval.granted",
        "step.allowed",
        "execution.resumed",
        "dispatch.queued",
        "step.executing",
        "step.succeeded",
        "execution.completed",
    ]
    step_id = approval["step_id"]
    awaiting = of_type(events, "step.awaiting_approval")[0]["payload"]
    assert (awaiting["step_id"], awaiting["target"], awaiting["rule_id"]) == (
        step_id,
        "deploy",
        "gate-deploy",
    )
    requested = of_type(events, "approval.requested")[0]["payload"]
    assert requested == {
        "approval_id": approval["id"],
        "step_id": step_id,
        "execution_id": execution_id,
        "status": "pending",
    }
    grant = of_type(events, "approval.granted")[0]["payload"]
    assert (grant["decided_by"], grant["rationale"], grant["status"]) == ("alice", "ok", "granted")
    assert of_type(events, "step.allowed")[1]["payload"]["rule_id"] == "gate-deploy"
    queued = [e["payload"]["dispatch_id"] for e in of_type(events, "dispatch.queued")]
    assert len(set(queued)) == 2  # the resume is a new dispatch
    assert of_type(events, "step.executing")[1]["payload"]["step_id"] == step_id


def test_approval_denied_the_handler_sees_the_rationale(
    kernel: Kernel, backend: str, tmp_path: Path
) -> None:
    agent_id, counter = f"gov-deny-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, gate(), tmp_path)
    plan = [["tool", "deploy", {"env": "prod"}], ["step", "launch", {"n": 1}]]
    with agent(kernel, agent_id, backend, counter):
        execution_id = create(kernel, agent_id, plan, on_policy_error="catch")
        blocked = wait_event(kernel, execution_id, "execution.blocked")
        first = approval_of(kernel, execution_id)
        denied = cli(
            "approvals", "deny", prefix(kernel, first["id"]), "--by", "carol",
            "--rationale", "not today", url=kernel.url,
        )  # fmt: skip
        assert ok(denied) == f"denied {first['id']}\n"
        # The handler carries on and is held again, at the local step.
        wait_event(kernel, execution_id, "execution.blocked", after=blocked["event_seq"])
        second = approval_of(kernel, execution_id)
        assert second["rule_id"] == "gate-launch"
        ok(cli("approvals", "deny", second["id"], "--rationale", "too risky", url=kernel.url))
        done = kernel.wait_terminal(execution_id)

    assert done["status"] == "completed", done
    assert done["output"] == [
        refusal("deploy", "not today"),
        {
            "policy_error": "[policy_denied] too risky (HTTP 403)",
            "reason": "too risky",
            "rule_id": "gate-launch",
        },
    ]
    assert ran(counter) == []  # neither body ran
    events = kernel.events(execution_id)
    start = types(events).index("approval.denied")
    assert types(events)[start : start + 4] == [
        "approval.denied",
        "step.denied",
        "execution.resumed",
        "dispatch.queued",
    ]
    step_denied = of_type(events, "step.denied")
    assert step_denied[0]["payload"]["step_id"] == first["step_id"]
    assert step_denied[0]["payload"]["error"] == {"reason": "not today"}
    assert step_denied[0]["payload"]["rule_id"] == "gate-deploy"
    assert step_denied[1]["payload"]["error"] == {"reason": "too risky"}
    decision = of_type(events, "approval.denied")[0]["payload"]
    assert (decision["decided_by"], decision["rationale"]) == ("carol", "not today")
    assert get_approval(kernel, first["id"])["status"] == "denied"


def test_approval_expires(kernel: Kernel, backend: str, tmp_path: Path) -> None:
    agent_id, counter = f"gov-expire-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, gate(timeout="2s"), tmp_path)
    with agent(kernel, agent_id, backend, counter):
        execution_id = create(kernel, agent_id, [["tool", "deploy", {"env": "prod"}]])
        wait_event(kernel, execution_id, "execution.blocked")
        approval = approval_of(kernel, execution_id)
        expired = wait_event(kernel, execution_id, "approval.expired", timeout=20)
        done = kernel.wait_terminal(execution_id)

    assert expired["payload"]["approval_id"] == approval["id"]
    assert expired["payload"]["rationale"] == "timeout"
    assert done["status"] == "completed", done
    assert done["output"] == [refusal("deploy", "approval_timeout")]
    assert ran(counter) == []
    events = kernel.events(execution_id)
    start = types(events).index("approval.expired")
    assert types(events)[start:] == [
        "approval.expired",
        "step.denied",
        "execution.resumed",
        "dispatch.queued",
        "execution.completed",
    ]
    step_denied = of_type(events, "step.denied")[0]["payload"]
    assert step_denied["error"] == {"reason": "approval_timeout"}
    assert get_approval(kernel, approval["id"])["status"] == "expired"


def test_cancelling_closes_the_pending_approval(
    kernel: Kernel, backend: str, tmp_path: Path
) -> None:
    agent_id, counter = f"gov-cancel-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, gate(), tmp_path)
    with agent(kernel, agent_id, backend, counter):
        execution_id = create(kernel, agent_id, [["tool", "deploy", {"env": "prod"}]])
        wait_event(kernel, execution_id, "execution.blocked")
        approval = approval_of(kernel, execution_id)
        assert ok(cli("exec", "cancel", execution_id, url=kernel.url)) == (
            f"cancelled {execution_id}\n"
        )
    assert kernel.call("GET", f"/v0/executions/{execution_id}")[1]["status"] == "cancelled"
    closed = get_approval(kernel, approval["id"])
    assert (closed["status"], closed["rationale"]) == ("expired", "execution_cancelled")
    events = kernel.events(execution_id)
    assert types(events)[-3:] == ["execution.cancelled", "approval.expired", "step.denied"]
    assert events[-1]["payload"]["error"] == {"reason": "execution_cancelled"}
    late = cli("approvals", "grant", approval["id"], url=kernel.url)
    assert late.returncode != 0
    assert "approval is already expired" in late.stderr
    assert ran(counter) == []


def test_approvers_are_enforced_and_a_decision_is_final(
    kernel: Kernel, backend: str, tmp_path: Path
) -> None:
    agent_id, counter = f"gov-approvers-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, gate(approvers="[alice]"), tmp_path)
    with agent(kernel, agent_id, backend, counter):
        execution_id = create(kernel, agent_id, [["tool", "deploy", {"env": "prod"}]])
        wait_event(kernel, execution_id, "execution.blocked")
        approval = approval_of(kernel, execution_id)
        assert approval["approvers"] == ["alice"]
        before = kernel.events(execution_id)

        by_bob = cli("approvals", "grant", approval["id"], "--by", "bob", url=kernel.url)
        assert by_bob.returncode != 0
        assert "[forbidden] 'bob' may not decide this approval; approvers: alice" in by_bob.stderr
        anonymous = cli("approvals", "deny", approval["id"], url=kernel.url)
        assert anonymous.returncode != 0
        assert "an anonymous caller may not decide" in anonymous.stderr
        assert kernel.events(execution_id) == before
        assert get_approval(kernel, approval["id"]) == approval
        assert kernel.call("GET", f"/v0/executions/{execution_id}")[1]["status"] == "blocked"

        ok(cli("approvals", "grant", approval["id"], "--by", "alice", url=kernel.url))
        done = kernel.wait_terminal(execution_id)
    assert done["status"] == "completed", done
    assert ran(counter) == [("deploy", {"env": "prod"})]

    after = kernel.events(execution_id)
    decided = get_approval(kernel, approval["id"])
    for verb in ("grant", "deny"):
        again = cli("approvals", verb, approval["id"], "--by", "alice", url=kernel.url)
        assert again.returncode != 0
        assert "[conflict] approval is already granted (HTTP 409)" in again.stderr
    status, body = kernel.call(
        "POST", f"/v0/approvals/{approval['id']}/deny", {"rationale": "x", "decided_by": "alice"}
    )
    assert (status, body["code"]) == (409, "conflict")
    assert kernel.events(execution_id) == after
    assert get_approval(kernel, approval["id"]) == decided
    assert decided["decided_by"] == "alice"


def test_named_principals_decide_as_themselves(
    server: Kernel, backend: str, tmp_path: Path
) -> None:
    agent_id, counter = f"gov-principals-{backend}", tmp_path / "count"
    prepare(server, agent_id, gate(approvers="[alice]"), tmp_path)
    with agent(server, agent_id, backend, counter):
        execution_id = create(server, agent_id, [["tool", "deploy", {"env": "prod"}]])
        wait_event(server, execution_id, "execution.blocked")
        approval = approval_of(server, execution_id)
        before = server.events(execution_id)
        path = f"/v0/approvals/{approval['id']}/grant"

        # Bob is not an approver, and cannot type his way in as alice.
        async def bob_grants() -> str:
            async with Client(server.url, TOKB) as client:
                with pytest.raises(ForbiddenError) as refused:
                    await client.grant_approval(approval["id"], rationale="mine")
            return refused.value.message

        assert anyio.run(bob_grants, backend=backend).startswith("'bob' may not decide")
        as_alice = cli(
            "approvals", "grant", approval["id"], "--by", "alice", url=server.url, token=TOKB
        )
        assert as_alice.returncode != 0
        assert "decided_by 'alice' does not match the authenticated principal" in as_alice.stderr
        # Alice's token with someone else's name typed is refused too.
        status, body = server.call(
            "POST", path, {"rationale": "x", "decided_by": "bob"}, token=TOKA
        )
        assert (status, body["code"]) == (403, "forbidden"), body
        # No token, or a wrong one: 401.
        assert server.call("POST", path, {"rationale": "x"}, token="")[0] == 401
        assert server.call("POST", path, {"rationale": "x"}, token="nope")[0] == 401
        assert server.events(execution_id) == before
        assert get_approval(server, approval["id"])["status"] == "pending"

        # Alice decides as herself: nothing typed, the token says who she is.
        granted = cli(
            "approvals", "grant", approval["id"], "--rationale", "ok", url=server.url, token=TOKA
        )
        assert ok(granted) == f"granted {approval['id']}\n"
        done = server.wait_terminal(execution_id)
    assert done["status"] == "completed", done
    assert ran(counter) == [("deploy", {"env": "prod"})]
    decided = get_approval(server, approval["id"])
    assert (decided["status"], decided["decided_by"], decided["rationale"]) == (
        "granted",
        "alice",
        "ok",
    )
    granted_event = of_type(server.events(execution_id), "approval.granted")[0]["payload"]
    assert granted_event["decided_by"] == "alice"


def test_an_approval_releases_only_its_own_step(
    kernel: Kernel, backend: str, tmp_path: Path
) -> None:
    """Grants with `rebuno_anyio.Client`: each call of the gated tool, with other
    arguments or the same ones again, needs its own approval."""
    agent_id, counter = f"gov-exact-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, gate(), tmp_path)
    plan = [
        ["tool", "deploy", {"env": "prod"}],
        ["tool", "deploy", {"env": "staging"}],
        ["tool", "deploy", {"env": "prod"}],
    ]

    async def grant_each(execution_id: str) -> list[tuple[Any, Any]]:
        held: list[tuple[Any, Any]] = []
        after = 0
        async with Client(kernel.url) as client:
            for _ in range(3):
                while True:  # long-poll for the next block
                    events = await client.events(execution_id, after_seq=after, wait=10)
                    assert events, "no event within 10 s"
                    after = events[-1].event_seq
                    if any(e.type == "execution.blocked" for e in events):
                        break
                pending = [
                    a for a in await client.list_approvals() if a.execution_id == execution_id
                ]
                assert len(pending) == 1, pending
                approval = await client.get_approval(pending[0].id)
                step = await client.get_step(execution_id, approval.step_id)
                held.append((approval, step))
                await client.grant_approval(approval.id, decided_by="alice", rationale="go")
        return held

    with agent(kernel, agent_id, backend, counter):
        execution_id = create(kernel, agent_id, plan)
        held = anyio.run(grant_each, execution_id, backend=backend)
        done = kernel.wait_terminal(execution_id)

    assert done["status"] == "completed", done
    assert done["output"] == [
        {"ok": "deployed prod"},
        {"ok": "deployed staging"},
        {"ok": "deployed prod"},
    ]
    steps = [(s.args, s.occurrence) for _, s in held]
    assert steps == [({"env": "prod"}, 0), ({"env": "staging"}, 0), ({"env": "prod"}, 1)]
    assert len({a.id for a, _ in held}) == 3
    assert len({s.step_id for _, s in held}) == 3
    assert all(a.rule_id == "gate-deploy" and a.step_id == s.step_id for a, s in held)
    assert ran(counter) == [("deploy", {"env": e}) for e in ("prod", "staging", "prod")]
    events = kernel.events(execution_id)
    assert len(of_type(events, "approval.requested")) == 3
    assert len(of_type(events, "approval.granted")) == 3


# -- rate limits --------------------------------------------------------------------------


def test_rate_limits(kernel: Kernel, backend: str, tmp_path: Path) -> None:
    agent_id, counter = f"gov-rate-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, rate("execution", "ping-per-execution"), tmp_path)

    def pings(*ns: int) -> list[list[Any]]:
        return [["tool", "ping", {"n": n}] for n in ns]

    with agent(kernel, agent_id, backend, counter):
        # per execution: the third call is refused; another execution has its own budget
        third = kernel.wait_terminal(create(kernel, agent_id, pings(1, 2, 3)))
        other = kernel.wait_terminal(create(kernel, agent_id, pings(4, 5)))
        # per agent: two executions share one budget
        load_policy(kernel, agent_id, rate("agent", "ping-per-agent"), tmp_path)
        first = kernel.wait_terminal(create(kernel, agent_id, pings(6, 7)))
        shared_id = create(kernel, agent_id, pings(8))
        shared = kernel.wait_terminal(shared_id)

    assert (third["status"], third["failure_reason"]) == ("failed", "rate_limit_exceeded")
    assert other["status"] == "completed", other
    assert first["status"] == "completed", first
    assert (shared["status"], shared["failure_reason"]) == ("failed", "rate_limit_exceeded")
    assert [args["n"] for _, args in ran(counter)] == [1, 2, 4, 5, 6, 7]
    limited = of_type(kernel.events(shared_id), "step.rate_limited")
    assert len(limited) == 1
    assert limited[0]["payload"]["rule_id"] == "ping-per-agent"
    assert limited[0]["payload"]["error"]["reason"] == "rate_limit_exceeded"
    assert (
        of_type(kernel.events(third["id"]), "step.rate_limited")[0]["payload"]["target"] == "ping"
    )


# -- restart ----------------------------------------------------------------------------------


def test_a_pending_approval_survives_a_kernel_crash(backend: str, tmp_path: Path) -> None:
    db, counter = tmp_path / "crash.db", tmp_path / "count"
    agent_id = f"gov-crash-{backend}"
    plan = [["tool", "fetch", {"item": "a"}], ["tool", "deploy", {"env": "prod"}]]
    old = Kernel(db)
    try:
        prepare(old, agent_id, gate(), tmp_path)
        with agent(old, agent_id, backend, counter, exit_on_blocked=True) as first:
            execution_id = create(old, agent_id, plan)
            first.wait_for(r"handler saw Blocked")
            assert wait_exit(first) == 0
        approval = approval_of(old, execution_id)
        old.kill()  # SIGKILL: no clean shutdown
    finally:
        reap(old)

    new = Kernel(db)
    try:
        assert get_approval(new, approval["id"]) == approval
        assert approval_of(new, execution_id)["status"] == "pending"
        assert new.call("GET", f"/v0/executions/{execution_id}")[1]["status"] == "blocked"
        with agent(new, agent_id, backend, counter) as second:
            ok(cli("approvals", "grant", approval["id"], "--by", "alice", url=new.url))
            done = new.wait_terminal(execution_id)
        assert done["status"] == "completed", done
        assert done["output"] == [{"ok": "fetched a"}, {"ok": "deployed prod"}]
        assert [(pid, name) for pid, name, _ in bodies(counter)] == [
            (first.popen.pid, "fetch"),
            (second.popen.pid, "deploy"),
        ]
    finally:
        new.stop()
        reap(new)


# -- loading bundles --------------------------------------------------------------------------

BAD_BUNDLE = """\
default_action: deny
rules:
  - id: fine
    priority: 1
    when: {target: fetch}
    then: {decision: allow}
  - id: broken
    priority: 2
    when:
      target: danger
      arguments: {what: {regex: "(rm"}}
    then: {decison: allow}
"""


def test_a_bad_bundle_never_loads(kernel: Kernel, backend: str, tmp_path: Path) -> None:
    agent_id, counter = f"gov-bad-{backend}", tmp_path / "count"
    prepare(kernel, agent_id, ALLOW_DENY, tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_BUNDLE, "utf-8")
    refused = cli("policy", "load", agent_id, str(bad), url=kernel.url)
    assert refused.returncode != 0
    assert "rule 'broken' (rules[1]): when.arguments.what.regex: invalid regex '(rm'" in (
        refused.stderr
    )
    assert "rule 'broken' (rules[1]): then: unknown key 'decison'" in refused.stderr
    status, body = kernel.call("POST", f"/v0/policies/{agent_id}", {"bundle": BAD_BUNDLE})
    assert (status, body["code"]) == (400, "validation_error"), body
    assert "rule 'broken' (rules[1])" in body["message"]
    # The previous bundle is still the one stored, and the one applied.
    assert ok(cli("policy", "show", agent_id, url=kernel.url)) == ALLOW_DENY
    with agent(kernel, agent_id, backend, counter):
        plan = [["tool", "fetch", {"item": "a"}], ["tool", "danger", {"what": "rm"}]]
        done = kernel.wait_terminal(create(kernel, agent_id, plan))
    assert done["output"] == [{"ok": "fetched a"}, refusal("danger", "too dangerous")]
    assert ran(counter) == [("fetch", {"item": "a"})]


def test_dev_manifest_policies_are_enforced(backend: str, tmp_path: Path) -> None:
    inline_id, file_id = f"gov-inline-{backend}", f"gov-file-{backend}"
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "file.yaml").write_text(
        ALLOW_DENY.replace("too dangerous", "the file says no"), "utf-8"
    )
    manifest = tmp_path / "agents.yaml"
    manifest.write_text(
        f"""\
agents:
  - id: {inline_id}
    webhook_url: {PARKED}
    secret: {SECRET}
    policy:
      default_action: allow
      rules:
        - id: inline-no-danger
          priority: 1
          when: {{target: danger}}
          then: {{decision: deny, reason: "the manifest says no"}}
  - id: {file_id}
    webhook_url: {PARKED}
    secret: {SECRET}
    policy_file: policies/file.yaml
""",
        "utf-8",
    )
    k = Kernel(tmp_path / "manifest.db", extra=["--config", str(manifest)])
    try:
        assert "inline-no-danger" in ok(cli("policy", "show", inline_id, url=k.url))
        assert "the file says no" in ok(cli("policy", "show", file_id, url=k.url))
        plan = [["tool", "fetch", {"item": "a"}], ["tool", "danger", {"what": "rm"}]]
        outputs = {}
        for agent_id in (inline_id, file_id):
            with agent(k, agent_id, backend, tmp_path / f"{agent_id}.count"):
                done = k.wait_terminal(create(k, agent_id, plan))
            outputs[agent_id] = done["output"]
            events = k.events(done["id"])
            denied = of_type(events, "step.denied")[0]["payload"]
            assert denied["target"] == "danger"
        assert outputs == {
            inline_id: [{"ok": "fetched a"}, refusal("danger", "the manifest says no")],
            file_id: [{"ok": "fetched a"}, refusal("danger", "the file says no")],
        }
    finally:
        k.stop()
        reap(k)

    # A manifest whose bundle does not validate: the kernel refuses to start.
    bad = tmp_path / "bad-agents.yaml"
    bad.write_text(
        f"agents:\n  - id: gov-badm\n    webhook_url: {PARKED}\n    secret: {SECRET}\n"
        "    policy:\n      rules:\n        - {id: oops, priority: 1, then: {decision: maybe}}\n",
        "utf-8",
    )
    started = subprocess.run(
        [sys.executable, "-m", "rebuno_anyio.cli", "dev", "--db", ":memory:", "--port", "0",
         "--config", str(bad)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert started.returncode != 0
    assert "agent 'gov-badm': invalid policy" in started.stderr
    assert "rule 'oops' (rules[0]): then.decision" in started.stderr


def test_cli_finds_a_new_approval_among_many(tmp_path: Path) -> None:
    """Id prefixes resolve among the newest approvals too, not only the oldest page."""
    agent_id, counter = "gov-many", tmp_path / "count"
    k = Kernel(":memory:")
    try:
        prepare(k, agent_id, gate(), tmp_path)
        with agent(k, agent_id, "asyncio", counter):
            ids = [create(k, agent_id, [["tool", "deploy", {"env": str(i)}]]) for i in range(120)]
            for execution_id in ids:
                wait_event(k, execution_id, "execution.blocked")
            newest = approval_of(k, ids[-1])
            shown = ok(cli("approvals", "get", prefix(k, newest["id"]), url=k.url))
            assert newest["id"] in shown
            listed = json.loads(ok(cli("approvals", "list", "--json", url=k.url)))
            assert newest["id"] in [a["id"] for a in listed]
            granted = cli("approvals", "grant", prefix(k, newest["id"]), url=k.url)
            assert ok(granted) == f"granted {newest['id']}\n"
            assert k.wait_terminal(ids[-1])["status"] == "completed"
    finally:
        k.stop()
        reap(k)

"""The `rebuno` command against real kernel processes.

Client verbs (`exec`, `agents`, `policy`, `approvals`) run in process through
click's runner against a `rebuno dev` process (a few through the real entry
point); `rebuno dev` / `rebuno server` are started as processes: the manifest,
`--db :memory:`, bearer tokens, named principals and `--v1-only`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import shlex
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import click
import pytest
from click.testing import CliRunner, Result
from procs import PYTHON, ROOT, AgentProc, Kernel, Proc, reap, running

from rebuno_anyio import Client
from rebuno_anyio.cli._main import cli as rebuno_cli
from rebuno_proto import sign_request

AGENT_SCRIPT = Path(__file__).resolve().parent / "agents" / "counter_agent.py"
SECRET = "cli-secret"
WIDE = "250"  # columns, so that tables do not fold ids

POLICY = """\
default_action: allow
rules:
  - id: hold-approval-tags
    priority: 1
    when:
      target: finish
      arguments: {tag: {regex: "^appr"}}
    then:
      decision: require_approval
      approval_config: {message: "finish it?"}
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    proc = Kernel(tmp_path_factory.mktemp("cli") / "rebuno.db", lease_timeout=2)
    try:
        yield proc
    finally:
        assert reap(proc, graceful=True) == 0, "\n".join(proc.lines[-20:])


@pytest.fixture(scope="module")
def agent(kernel: Kernel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProc]:
    """A live agent (this SDK) registered as `worker`."""
    counter = tmp_path_factory.mktemp("cli-agent") / "count"
    kernel.register("worker", "http://127.0.0.1:9/not-yet", SECRET)
    with running(AgentProc(AGENT_SCRIPT, "worker", kernel.url, SECRET, str(counter))) as proc:
        kernel.register("worker", proc.webhook_url, SECRET)
        yield proc


def rebuno(kernel: Kernel | None, *args: str, env: dict[str, str] | None = None) -> Result:
    """Run `rebuno ARGS` in process, with REBUNO_URL pointing at `kernel`."""
    full_env = {"COLUMNS": WIDE, "REBUNO_API_KEY": "", "REBUNO_BEARER_TOKEN": ""}
    if kernel is not None:
        full_env["REBUNO_URL"] = kernel.url
    full_env.update(env or {})
    return CliRunner().invoke(rebuno_cli, list(args), env=full_env, catch_exceptions=False)


def succeeds(result: Result) -> str:
    assert result.exit_code == 0, (result.exit_code, result.output)
    return result.stdout


def fails(result: Result, *needles: str, code: int = 1) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert "Traceback" not in result.output
    return result.stderr


def as_json(result: Result) -> Any:
    return json.loads(succeeds(result))


def all_ids(kernel: Kernel) -> list[str]:
    status, page = kernel.call("GET", "/v0/executions?limit=200")
    assert status == 200
    return [e["id"] for e in page["executions"]]


def unique_prefix(execution_id: str, ids: list[str]) -> str:
    for length in range(2, len(execution_id)):
        prefix = execution_id[:length]
        if [i for i in ids if i.startswith(prefix)] == [execution_id]:
            return prefix
    raise AssertionError("no unique prefix")


# -- agents --------------------------------------------------------------------------------------


def test_agents_register_list_get_delete(kernel: Kernel) -> None:
    out = succeeds(
        rebuno(
            kernel,
            "agents",
            "register",
            "cli-a",
            "--url",
            "http://127.0.0.1:7/hook",
            "--secret",
            "sa",
        )
    )
    assert out.strip() == "registered cli-a -> http://127.0.0.1:7/hook"
    registered = as_json(
        rebuno(
            kernel,
            "agents",
            "register",
            "cli-b",
            "--url",
            "https://b.example/hook",
            "--secret",
            "sb",
            "--json",
        )
    )
    assert registered["id"] == "cli-b"
    assert registered["webhook_url"] == "https://b.example/hook"
    assert "secret" not in registered
    table = succeeds(rebuno(kernel, "agents", "list"))
    assert "cli-a" in table
    assert "http://127.0.0.1:7/hook" in table
    assert "cli-b" in table
    assert "sa" not in table.split()
    listed = as_json(rebuno(kernel, "agents", "list", "--json"))
    assert {"cli-a", "cli-b"} <= {a["id"] for a in listed}
    assert all("secret" not in a for a in listed)
    shown = succeeds(rebuno(kernel, "agents", "get", "cli-a"))
    assert "http://127.0.0.1:7/hook" in shown
    assert "none (all steps allowed)" in shown
    assert as_json(rebuno(kernel, "agents", "get", "cli-a", "--json"))["id"] == "cli-a"
    assert succeeds(rebuno(kernel, "agents", "delete", "cli-b")).strip() == "deleted cli-b"
    fails(rebuno(kernel, "agents", "get", "cli-b"), "not found")
    fails(rebuno(kernel, "agents", "delete", "cli-b"), "not found")
    assert as_json(rebuno(kernel, "agents", "delete", "cli-a", "--json")) == {"deleted": "cli-a"}
    fails(
        rebuno(kernel, "agents", "register", "bad id", "--url", "http://x/h", "--secret", "s"),
        "id: must be",
    )


# -- exec ----------------------------------------------------------------------------------------


def test_exec_create_get_list_events_cancel(kernel: Kernel) -> None:
    kernel.register("idle", "http://127.0.0.1:9/webhook", SECRET)  # never answers
    created = as_json(rebuno(kernel, "exec", "create", "idle", '{"n": 1}', "--json"))
    assert created["agent_id"] == "idle"
    assert created["status"] == "running"
    assert created["input"] == {"n": 1}
    text = succeeds(rebuno(kernel, "exec", "create", "idle", "[1, 2]", "--session", "s-1"))
    second = next(line.split()[1] for line in text.splitlines() if line.startswith("id"))
    assert "running" in text
    assert "s-1" in text  # the session line
    keyed = as_json(rebuno(kernel, "exec", "create", "idle", "--idempotency-key", "k1", "--json"))
    again = as_json(rebuno(kernel, "exec", "create", "idle", "--idempotency-key", "k1", "--json"))
    assert again["id"] == keyed["id"]
    assert keyed["input"] is None
    fails(rebuno(kernel, "exec", "create", "idle", "{nope"), "not valid JSON", code=2)
    fails(rebuno(kernel, "exec", "create", "ghost"), "not registered")

    ids = all_ids(kernel)
    prefix = unique_prefix(created["id"], ids)
    shown = succeeds(rebuno(kernel, "exec", "get", prefix))
    assert created["id"] in shown
    assert '{"n":1}' in shown
    assert as_json(rebuno(kernel, "exec", "get", prefix.upper(), "--json"))["id"] == created["id"]
    assert as_json(rebuno(kernel, "exec", "get", created["id"], "--json"))["id"] == created["id"]
    common = next(
        created["id"][:i] for i in range(len(second), 0, -1) if second.startswith(created["id"][:i])
    )
    assert len(common) >= 2
    err = fails(rebuno(kernel, "exec", "get", common), "is ambiguous")
    assert created["id"] in err or second in err
    fails(rebuno(kernel, "exec", "get", "fffff"), "no execution id starts with 'fffff'")

    table = succeeds(rebuno(kernel, "exec", "list", "--agent", "idle"))
    assert created["id"] in table
    assert second in table
    page = as_json(rebuno(kernel, "exec", "list", "--agent", "idle", "--json"))
    assert [e["id"] for e in page["executions"]][:3] == [keyed["id"], second, created["id"]]
    page = as_json(rebuno(kernel, "exec", "list", "--agent", "idle", "--limit", "1", "--json"))
    assert len(page["executions"]) == 1
    assert page["next_cursor"] == keyed["id"]

    events = as_json(rebuno(kernel, "exec", "events", prefix, "--json"))
    assert [e["event_seq"] for e in events] == list(range(1, len(events) + 1))
    assert [e["type"] for e in events][:3] == [
        "execution.created",
        "execution.started",
        "dispatch.queued",
    ]
    later = as_json(rebuno(kernel, "exec", "events", prefix, "--after", "2", "--json"))
    assert later == events[2:]
    table = succeeds(rebuno(kernel, "exec", "events", prefix))
    assert "execution.created" in table
    assert "dispatch.queued" in table

    assert (
        succeeds(rebuno(kernel, "exec", "cancel", prefix)).strip() == f"cancelled {created['id']}"
    )
    fails(rebuno(kernel, "exec", "cancel", prefix), "already terminal")
    assert as_json(rebuno(kernel, "exec", "cancel", second, "--json")) == {"cancelled": second}
    cancelled = as_json(
        rebuno(kernel, "exec", "list", "--agent", "idle", "--status", "cancelled", "--json")
    )
    assert {e["id"] for e in cancelled["executions"]} == {created["id"], second}
    shown = succeeds(rebuno(kernel, "exec", "get", prefix))
    assert "cancelled" in shown
    assert "client_cancelled" in shown
    # A watch of an execution that did not complete exits non-zero.
    watched = rebuno(kernel, "exec", "watch", prefix)
    assert watched.exit_code == 1
    assert "execution.cancelled" in watched.stdout
    assert "cancelled: " in watched.stdout


def test_exec_create_wait_and_watch_with_a_live_agent(
    kernel: Kernel, agent: AgentProc, tmp_path: Path
) -> None:
    out = succeeds(rebuno(kernel, "exec", "create", "worker", '{"tag": "w1", "n": 2}', "--wait"))
    assert "completed" in out
    assert '"done":"w1:1"' in out
    failed = rebuno(
        kernel,
        "exec",
        "create",
        "worker",
        '{"tag": "w2", "n": 0, "fail": true}',
        "--wait",
        "--json",
    )
    assert failed.exit_code == 1
    assert json.loads(failed.stdout)["status"] == "failed"
    assert "tool_error: explode" in json.loads(failed.stdout)["failure_reason"]

    # Follow a run that is still going: watch waits on the event log (long polls).
    gate = tmp_path / "gate"
    created = as_json(
        rebuno(
            kernel,
            "exec",
            "create",
            "worker",
            json.dumps({"tag": "w3", "gate": str(gate)}),
            "--json",
        )
    )
    agent.wait_for("at gate w3")
    args = [
        PYTHON,
        "-m",
        "rebuno_anyio.cli",
        "exec",
        "watch",
        created["id"][:30],
        "--url",
        kernel.url,
    ]
    with running(Proc(args, env={"COLUMNS": WIDE})) as watch:
        watch.wait_for(r"^3 .*dispatch\.queued")
        gate.touch()
        watch.wait_for("execution.completed")
        final = watch.wait_for(r"^completed: ")
        assert watch.popen.wait(timeout=30) == 0
    assert '"done":"w3:5"' in final.string
    lines = [
        json.loads(line)
        for line in succeeds(rebuno(kernel, "exec", "watch", created["id"], "--json")).splitlines()
    ]
    assert lines[0]["event_seq"] == 1
    assert lines[-1]["type"] == "execution.completed"


# -- policy and approvals ------------------------------------------------------------------------


def test_policy_load_and_show(kernel: Kernel, agent: AgentProc, tmp_path: Path) -> None:
    kernel.register("pol", "http://127.0.0.1:9/webhook", SECRET)
    shown = succeeds(rebuno(kernel, "policy", "show", "pol"))
    assert shown.strip() == "pol has no policy bundle: every step is allowed"
    bundle = tmp_path / "policy.yaml"
    bundle.write_text(POLICY)
    assert (
        succeeds(rebuno(kernel, "policy", "load", "pol", str(bundle))).strip()
        == "loaded policy for pol"
    )
    assert succeeds(rebuno(kernel, "policy", "show", "pol")) == POLICY
    assert as_json(rebuno(kernel, "policy", "show", "pol", "--json")) == {
        "agent_id": "pol",
        "bundle": POLICY,
    }
    assert "yes" in succeeds(rebuno(kernel, "agents", "get", "pol"))
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "rules:\n  - id: r9\n    priority: one\n    when: {}\n    then: {decision: allow}\n"
    )
    fails(
        rebuno(kernel, "policy", "load", "pol", str(broken)),
        "invalid policy bundle",
        "r9",
        "priority",
    )
    assert succeeds(rebuno(kernel, "policy", "show", "pol")) == POLICY  # unchanged
    fails(rebuno(kernel, "policy", "load", "ghost", str(bundle)), "not found")
    fails(rebuno(kernel, "policy", "show", "ghost"), "not found")
    fails(
        rebuno(kernel, "policy", "load", "pol", str(tmp_path / "none.yaml")),
        "No such file",
        code=2,
    )


def test_approvals_list_get_grant_deny(kernel: Kernel, agent: AgentProc, tmp_path: Path) -> None:
    bundle = tmp_path / "policy.yaml"
    bundle.write_text(POLICY)
    succeeds(rebuno(kernel, "policy", "load", "worker", str(bundle)))
    try:
        assert "approvals (pending): none" in succeeds(rebuno(kernel, "approvals", "list"))
        held = [
            as_json(
                rebuno(
                    kernel,
                    "exec",
                    "create",
                    "worker",
                    json.dumps({"tag": f"appr{i}", "n": 1}),
                    "--json",
                )
            )["id"]
            for i in range(2)
        ]
        pending: list[dict[str, Any]] = []
        for execution_id in held:  # follow each until it blocks
            after = 0
            while True:
                _, events = kernel.call(
                    "GET", f"/v0/executions/{execution_id}/events?after_seq={after}&wait=10"
                )
                assert events, "no progress within 10 s"
                after = events[-1]["event_seq"]
                if events[-1]["type"] == "execution.blocked":
                    break
        pending = as_json(rebuno(kernel, "approvals", "list", "--json"))
        assert sorted(a["execution_id"] for a in pending) == sorted(held)
        table = succeeds(rebuno(kernel, "approvals", "list"))
        for approval in pending:
            assert approval["id"] in table
        assert "finish it?" in table
        first = next(a for a in pending if a["execution_id"] == held[0])
        second = next(a for a in pending if a["execution_id"] == held[1])
        detail = succeeds(rebuno(kernel, "approvals", "get", first["id"][:-6]))
        assert "finish" in detail
        assert "pending" in detail
        got = as_json(rebuno(kernel, "approvals", "get", first["id"], "--json"))
        assert got["approval"]["id"] == first["id"]
        assert got["step"]["target"] == "finish"
        out = succeeds(
            rebuno(
                kernel, "approvals", "grant", first["id"][:-4], "--by", "ops", "--rationale", "ok"
            )
        )
        assert out.strip() == f"granted {first['id']}"
        fails(rebuno(kernel, "approvals", "grant", first["id"]), "already granted")
        assert as_json(
            rebuno(kernel, "approvals", "deny", second["id"], "--rationale", "nope", "--json")
        ) == {"denied": second["id"]}
        granted = as_json(rebuno(kernel, "approvals", "list", "--status", "granted", "--json"))
        assert [a["decided_by"] for a in granted if a["id"] == first["id"]] == ["ops"]
        assert [
            a["id"]
            for a in as_json(rebuno(kernel, "approvals", "list", "--status", "all", "--json"))
        ] != []
        done = kernel.wait_terminal(held[0])
        assert done["status"] == "completed"
        assert done["output"]["done"] == "appr0:0"
        denied = kernel.wait_terminal(held[1])
        assert denied["status"] == "completed"  # a @tool denial returns text
        assert denied["output"]["done"].startswith("finish not allowed")
        fails(rebuno(kernel, "approvals", "grant", "fffff"), "no approval id starts with")
    finally:
        kernel.call(
            "POST",
            "/v0/agents",
            {"id": "worker", "webhook_url": agent.webhook_url, "secret": SECRET},
        )
        status, _ = kernel.call(
            "POST", "/v0/policies/worker", {"bundle": "default_action: allow\n"}
        )
        assert status == 204


# -- the kernel commands -------------------------------------------------------------------------


def test_entry_point_help_version_and_unreachable_kernel() -> None:
    run = subprocess.run(
        [PYTHON, "-m", "rebuno_anyio.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode == 0
    for command in ("dev", "server", "exec", "agents", "approvals", "policy"):
        assert command in run.stdout
    assert succeeds(rebuno(None, "--version")).startswith("rebuno, version ")
    fails(
        rebuno(None, "exec", "list", "--url", "http://127.0.0.1:9"),
        "cannot reach the kernel at http://127.0.0.1:9",
    )


def test_server_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    fails(rebuno(None, "server", "--db", db), "needs --bearer-token", code=2)
    fails(rebuno(None, "server", "--db", db, "--bearer-token", ""), "needs --bearer-token", code=2)
    fails(
        rebuno(None, "server", "--db", db, "--bearer-token", "t", "--principal", "bob"),
        "NAME=TOKEN",
        code=2,
    )
    fails(
        rebuno(None, "server", "--db", db, "--bearer-token", "t", "--principal", "bob=t"),
        "distinct",
        code=2,
    )
    fails(rebuno(None, "server"), "--db", code=2)
    assert not Path(db).exists()


def body_signed(url: str, path: str, agent_id: str, secret: str, *, v1: bool) -> int:
    request = urllib.request.Request(url + path, method="GET")
    if v1:
        stamp = int(time.time())
        request.add_header("Rebuno-Timestamp", str(stamp))
        signature = sign_request(
            secret.encode(), method="GET", target=path, timestamp=stamp, body=b""
        )
    else:
        signature = "sha256=" + hmac.new(secret.encode(), b"", hashlib.sha256).hexdigest()
    request.add_header("Rebuno-Agent-Id", agent_id)
    request.add_header("Rebuno-Signature", signature)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_server_with_token_principals_and_v1_only(tmp_path: Path) -> None:
    extra = ["--principal", "alice=alice-token", "--v1-only"]
    with running(Kernel(tmp_path / "s.db", server_token="admin-token", extra=extra)) as server:
        fails(rebuno(server, "exec", "list"), "missing bearer token")
        fails(rebuno(server, "exec", "list", "--api-key", "wrong"), "invalid bearer token")
        assert as_json(rebuno(server, "exec", "list", "--api-key", "admin-token", "--json")) == {
            "executions": [],
            "next_cursor": "",
        }
        assert (
            as_json(
                rebuno(server, "agents", "list", "--json", env={"REBUNO_API_KEY": "alice-token"})
            )
            == []
        )
        succeeds(
            rebuno(
                server,
                "agents",
                "register",
                "sv",
                "--url",
                "http://127.0.0.1:9/h",
                "--secret",
                "sv-secret",
                "--api-key",
                "admin-token",
            )
        )
        created = as_json(
            rebuno(server, "exec", "create", "sv", "--json", "--api-key", "admin-token")
        )
        path = f"/v0/executions/{created['id']}"
        assert body_signed(server.url, path, "sv", "sv-secret", v1=True) == 200
        assert body_signed(server.url, path, "sv", "sv-secret", v1=False) == 401  # --v1-only
        status, body = server.call("GET", "/v0/health", token="")
        assert (status, body) == (200, {"status": "ok"})


def test_dev_server_accepts_the_body_form(kernel: Kernel) -> None:
    kernel.register("bf", "http://127.0.0.1:9/webhook", "bf-secret")
    status, created = kernel.call("POST", "/v0/executions", {"agent_id": "bf"})
    assert status == 201
    path = f"/v0/executions/{created['id']}"
    assert body_signed(kernel.url, path, "bf", "bf-secret", v1=False) == 200
    assert body_signed(kernel.url, path, "bf", "wrong", v1=False) == 401


def test_dev_registers_the_manifest(tmp_path: Path) -> None:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "strict.yaml").write_text("default_action: deny\n")
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(
        "agents:\n"
        "  - id: hello\n"
        "    webhook_url: http://127.0.0.1:5000/webhook\n"
        "    secret: dev-secret\n"
        "  - id: guarded\n"
        "    webhook_url: https://agents.example/guarded\n"
        "    secret: g-secret\n"
        "    policy_file: policies/strict.yaml\n"
        "  - id: inline\n"
        "    webhook_url: http://127.0.0.1:5001/webhook\n"
        "    secret: i-secret\n"
        "    policy:\n"
        "      default_action: allow\n"
        "      rules: [{id: no-rm, priority: 1, when: {target: rm}, then: {decision: deny}}]\n"
    )
    with running(Kernel(":memory:", extra=["--config", str(manifest)])) as dev:
        agents = as_json(rebuno(dev, "agents", "list", "--json"))
        assert [(a["id"], a["webhook_url"], a["has_policy"]) for a in agents] == [
            ("guarded", "https://agents.example/guarded", True),
            ("hello", "http://127.0.0.1:5000/webhook", False),
            ("inline", "http://127.0.0.1:5001/webhook", True),
        ]
        assert succeeds(rebuno(dev, "policy", "show", "guarded")) == "default_action: deny\n"
        assert "no-rm" in succeeds(rebuno(dev, "policy", "show", "inline"))
        created = as_json(rebuno(dev, "exec", "create", "hello", '"hi"', "--json"))
        assert created["input"] == "hi"


@contextmanager
def taken_port() -> Iterator[str]:
    """A port something listens on: a `dev` run in process that should be
    refused, but is not, fails to listen instead of serving for ever."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield str(sock.getsockname()[1])


HELLO = "agents:\n  - id: hello\n    webhook_url: http://x/w\n    secret: s\n"


@pytest.mark.parametrize(
    ("manifest", "needles"),
    [
        (
            "agents:\n  - id: hello\n    webhook_url: ftp://x\n    secret: s\n",
            ["agent 'hello'", "webhook_url"],
        ),
        (
            "agents:\n  - id: hello\n    webhook_url: http://x/w\n",
            ["agent 'hello'", "secret: is required"],
        ),
        (
            HELLO + "    colour: red\n    7: x\n",
            ["agent 'hello'", "unknown keys 7, colour"],
        ),
        (
            "agents:\n  - id: 2024-01-01\n    webhook_url: http://x/w\n    secret: s\n",
            ["id: must be a string"],
        ),
        (
            HELLO
            + "    policy: {rules: [{id: r1, priority: x, when: {}, then: {decision: allow}}]}\n",
            ["agent 'hello'", "invalid policy", "r1", "priority"],
        ),
        (
            HELLO + "    policy_file: missing.yaml\n",
            ["agent 'hello'", "policy_file"],
        ),
        (
            "agents:\n"
            "  - {id: a, webhook_url: 'http://x/w', secret: s}\n"
            "  - {id: a, webhook_url: 'http://x/w', secret: s}\n",
            ["repeated: a"],
        ),
        ("agents: [1\n", ["not valid YAML"]),
        ("- just a list\n", ["top level"]),
        # URLs the dispatcher's HTTP client would refuse at every delivery.
        (
            "agents:\n  - id: a\n    webhook_url: 'http://h:abc/'\n    secret: s\n",
            ["agent 'a'", "webhook_url: is not a valid URL", "http://h:abc/"],
        ),
        (
            'agents:\n  - id: a\n    webhook_url: "http://x\\0y/"\n    secret: s\n',
            ["agent 'a'", "webhook_url: must not contain", "control characters"],
        ),
        (
            "agents:\n  - id: a\n    webhook_url: 'http://[::1/'\n    secret: s\n",
            ["agent 'a'", "webhook_url: is not a valid URL"],
        ),
        ("agents: " + "[" * 5000 + "]" * 5000 + "\n", ["nested too deeply"]),
        ("agents:\n  - id: a\n    secret: " + "[" * 5000 + "]" * 5000 + "\n", ["nested too"]),
    ],
)
def test_dev_rejects_a_bad_manifest(tmp_path: Path, manifest: str, needles: list[str]) -> None:
    path = tmp_path / "manifest.yaml"
    path.write_text(manifest)
    db = tmp_path / "never.db"
    with taken_port() as port:
        result = rebuno(None, "dev", "--db", str(db), "--port", port, "--config", str(path))
    fails(result, *needles)
    assert not db.exists()  # refused before anything started


def test_dev_rejects_a_manifest_that_is_not_utf8(tmp_path: Path) -> None:
    db = tmp_path / "never.db"
    path = tmp_path / "manifest.yaml"
    path.write_bytes(b"agents:\n  - id: \xff\xfe\n")
    with taken_port() as port:
        args = ["dev", "--db", str(db), "--port", port, "--config", str(path)]
        fails(rebuno(None, *args), "manifest", "is not UTF-8")
        path.write_bytes(HELLO.encode() + b"    policy_file: p.yaml\n")
        (tmp_path / "p.yaml").write_bytes(b"default_action: \xff\n")
        fails(rebuno(None, *args), "agent 'hello'", "policy_file", "is not UTF-8")
    assert not db.exists()


def test_dev_reports_an_unusable_db_or_port_in_one_line(tmp_path: Path) -> None:
    """Errors raised inside the kernel's task groups arrive wrapped in
    exception groups: still one line and exit 1, never a traceback."""
    missing = tmp_path / "no-such-dir" / "x.db"
    fails(
        rebuno(None, "dev", "--db", str(missing), "--port", "0"),
        "cannot create",
        "does not exist",
    )
    fails(
        rebuno(None, "dev", "--db", "postgres://db/rebuno", "--port", "0"),
        "--db",
        "PostgreSQL",
        code=2,
    )
    db = tmp_path / "taken.db"
    with running(Kernel(db)) as first:
        fails(
            rebuno(None, "dev", "--db", str(db), "--port", "0"),
            "in use by another rebuno kernel",
        )
        fails(
            rebuno(None, "dev", "--db", ":memory:", "--port", str(first.port)),
            f"cannot listen on 127.0.0.1:{first.port}",
        )
    # Through the real entry point as well: no traceback on stderr.
    run = subprocess.run(
        [PYTHON, "-m", "rebuno_anyio.cli", "dev", "--db", str(missing), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    (line,) = run.stderr.strip().splitlines()  # one line
    assert line.startswith(f"Error: cannot create {missing}: "), line


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["exec", "create", "a", "1e999999"], {}, ["JSON", "out of range"]),
        (["exec", "create", "a", '{"x": NaN}'], {}, ["JSON", "NaN is not a JSON number"]),
        (["exec", "create", "a", "[" * 5000 + "]" * 5000], {}, ["JSON", "nested too deeply"]),
        (["exec", "list", "--url", "http://[::1"], {}, ["--url", "not a valid URL"]),
        (["exec", "list", "--url", "ftp://kernel"], {}, ["--url", "http:// or https://"]),
        (["exec", "list"], {"REBUNO_URL": "http://h:abc"}, ["--url", "not a valid URL"]),
        (
            [
                "agents",
                "register",
                "a",
                "--url",
                "http://a/",
                "--secret",
                "s",
                "--kernel",
                "http://[::1",
            ],
            {},
            ["--kernel", "not a valid URL"],
        ),
        (["exec", "list", "--api-key", "ключ"], {}, ["--api-key", "printable ASCII"]),
        (["exec", "list", "--api-key", "tok\nen"], {}, ["--api-key", "printable ASCII"]),
        (["exec", "list"], {"REBUNO_API_KEY": "clé"}, ["--api-key", "printable ASCII"]),
    ],
)
def test_client_arguments_that_cannot_be_sent_are_usage_errors(
    args: list[str], env: dict[str, str], needles: list[str]
) -> None:
    fails(rebuno(None, *args, env={"REBUNO_URL": "http://127.0.0.1:9", **env}), *needles, code=2)


def test_dev_with_memory_db_and_options(tmp_path: Path) -> None:
    extra = ["--max-attempts", "1", "--synchronous", "normal"]
    with running(Kernel(":memory:", extra=extra)) as dev:
        assert not list(tmp_path.iterdir())
        dev.register("m", "http://127.0.0.1:9/webhook", "s")
        created = as_json(rebuno(dev, "exec", "create", "m", "--json"))
        done = dev.wait_terminal(created["id"], timeout=30)
        # One delivery attempt to nowhere, then the execution fails.
        assert done["failure_reason"] == "dispatch_exhausted"
        assert not list(ROOT.glob(":memory:*"))


# -- the documentation's commands ------------------------------------------------------------

DOCS = Path(__file__).resolve().parent.parent / "docs"


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every `rebuno ...` line in the shell blocks of the kernel's docs."""
    found = []
    for name in ("cli.md", "deployment.md", "kernel.md"):
        text = (DOCS / name).read_text("utf-8")
        for block in re.findall(r"^```sh\n(.*?)^```$", text, flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                    words.pop(0)  # VAR=value rebuno ...
                if words and words[0] == "rebuno":
                    found.append((name, words[1:]))
    return found


def parse(args: list[str]) -> click.Context:
    """Parse a command line down to its subcommand, converting every value,
    without running anything."""
    command: click.Command = rebuno_cli
    name, parent = "rebuno", None
    while True:
        ctx = command.make_context(name, list(args), parent=parent)
        if not isinstance(command, click.Group):
            return ctx
        sub_name, sub, args = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        assert sub is not None
        command, name, parent = sub, str(sub_name), ctx


def test_every_documented_command_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policy.yaml").write_text(POLICY)  # `policy load` opens its file
    commands = documented_commands()
    assert len(commands) >= 40
    seen = set()
    for doc, args in commands:
        if args in (["--help"], ["--version"]) or "--help" in args:
            result = rebuno(None, *args)
            assert result.exit_code == 0, (doc, args, result.output)
            continue
        with parse(args) as ctx:  # closing it closes files the command opened
            seen.add(ctx.command_path)
    # Every command is documented with at least one example.
    everything = set()
    for group_name, group in rebuno_cli.commands.items():
        if isinstance(group, click.Group):
            everything |= {f"rebuno {group_name} {sub}" for sub in group.commands}
        else:
            everything.add(f"rebuno {group_name}")
    assert everything <= seen, everything - seen


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_dev_refuses_a_lease_timeout_that_is_not_a_number(tmp_path: Path, value: str) -> None:
    db = tmp_path / "never.db"
    result = rebuno(None, "dev", "--db", str(db), "--port", "0", "--lease-timeout", value)
    fails(result, "--lease-timeout", "finite", code=2)
    assert not db.exists()


def test_watch_prints_the_last_events_of_a_run_that_ends_between_reads(
    kernel: Kernel, agent: AgentProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run ends right after watch has read a page of events: the events of
    its end must still be printed."""
    gate = tmp_path / "gate"
    created = as_json(
        rebuno(
            kernel,
            "exec",
            "create",
            "worker",
            json.dumps({"tag": "w4", "gate": str(gate)}),
            "--json",
        )
    )
    agent.wait_for("at gate w4")
    real_events = Client.events
    calls = 0

    async def events_then_finish(self: Client, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        page = await real_events(self, *args, **kwargs)
        if calls == 1:  # the run ends after this read, before the next one
            gate.touch()
            await anyio.to_thread.run_sync(kernel.wait_terminal, created["id"])
        return page

    monkeypatch.setattr(Client, "events", events_then_finish)
    out = succeeds(rebuno(kernel, "exec", "watch", created["id"]))
    assert calls >= 2
    assert "execution.completed" in out
    assert out.rstrip().splitlines()[-1].startswith("completed: ")

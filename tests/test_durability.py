"""Durability of `rebuno dev` on its SQLite file (synchronous FULL, the default).

The kernel is SIGKILLed while executions are mid-run, then restarted on the
same file and port: everything a client had been told before the kill is still
there, unchanged (the old event log is a byte prefix of the new one, recorded
step results are identical), no recorded tool body runs again, and every
execution finishes. Also: one kernel per file, online backups, and a database
from a newer kernel is refused.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from procs import PYTHON, ROOT, AgentProc, Kernel, reap, running

SCRIPT = Path(__file__).resolve().parent / "agents" / "counter_agent.py"
SECRET = "durable-secret"
AGENT_ID = "durable"


def raw_get(kernel: Kernel, path: str) -> bytes:
    with urllib.request.urlopen(kernel.url + path, timeout=30) as response:
        assert response.status == 200
        return bytes(response.read())


def create(kernel: Kernel, input: Any) -> str:
    status, body = kernel.call("POST", "/v0/executions", {"agent_id": AGENT_ID, "input": input})
    assert status == 201, body
    return str(body["id"])


def seen(kernel: Kernel, execution_id: str) -> dict[str, Any]:
    """What a client has been told about an execution."""
    events_raw = raw_get(kernel, f"/v0/executions/{execution_id}/events?limit=1000")
    steps = json.loads(raw_get(kernel, f"/v0/executions/{execution_id}/steps"))
    return {
        "execution": json.loads(raw_get(kernel, f"/v0/executions/{execution_id}")),
        "events_raw": events_raw,
        "events": json.loads(events_raw),
        "steps": {s["step_id"]: s for s in steps},
    }


def assert_kept(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Nothing acknowledged was lost or changed."""
    old, new = before["events_raw"], after["events_raw"]
    assert old.startswith(b"[")
    assert old.endswith(b"]")
    assert new.startswith(old[:-1]), "the old event log is not a byte prefix of the new one"
    assert after["events"][: len(before["events"])] == before["events"]
    for step_id, step in before["steps"].items():
        now = after["steps"][step_id]
        if step["status"] in ("succeeded", "failed", "denied", "cancelled"):
            assert now == step
        else:
            for key in ("kind", "target", "args", "args_hash", "occurrence", "idempotency"):
                assert now[key] == step[key]
    old_x, new_x = before["execution"], after["execution"]
    assert new_x["id"] == old_x["id"]
    assert new_x["input"] == old_x["input"]
    assert new_x["created_at"] == old_x["created_at"]
    if old_x["status"] in ("completed", "failed", "cancelled"):
        assert new_x == old_x


def test_sigkill_and_restart_loses_nothing_acknowledged(tmp_path: Path) -> None:
    db, counter = tmp_path / "rebuno.db", tmp_path / "count"
    gates = {f"held{i}": tmp_path / f"gate{i}" for i in range(3)}
    first = Kernel(db, lease_timeout=3)
    port = first.port
    with running(AgentProc(SCRIPT, AGENT_ID, first.url, SECRET, str(counter))) as agent:
        first.register(AGENT_ID, agent.webhook_url, SECRET)
        finished = [create(first, {"tag": f"done{i}", "n": 3}) for i in range(3)]
        held = [create(first, {"tag": tag, "n": 2, "gate": str(g)}) for tag, g in gates.items()]
        waiting = set(gates)
        while waiting:
            waiting.discard(agent.wait_for(r"at gate (held\d)").group(1))
        for execution_id in finished:
            assert first.wait_terminal(execution_id)["status"] == "completed"
        gone = create(first, {"tag": "gone", "n": 1, "gate": str(tmp_path / "never")})
        agent.wait_for("at gate gone")
        status, _ = first.call("POST", f"/v0/executions/{gone}/cancel")
        assert status == 204
        # Started just before the kill: caught at whatever point the kill finds them.
        racing = [create(first, {"tag": f"race{i}", "n": 3}) for i in range(3)]
        everything = [*finished, *held, gone, *racing]
        before = {execution_id: seen(first, execution_id) for execution_id in everything}
        reap(first)  # SIGKILL, mid-run

        second = Kernel(db, lease_timeout=3, extra=["--port", str(port)])
        try:
            assert second.port == port
            for execution_id in everything:
                assert_kept(before[execution_id], seen(second, execution_id))
            for gate in gates.values():
                gate.touch()
            done = {e: second.wait_terminal(e, timeout=60) for e in everything}
            after = {execution_id: seen(second, execution_id) for execution_id in everything}
        finally:
            assert reap(second, graceful=True) == 0
    for execution_id in everything:
        assert_kept(before[execution_id], after[execution_id])
        events = after[execution_id]["events"]
        assert [e["event_seq"] for e in events] == list(range(1, len(events) + 1))
    assert done[gone]["status"] == "cancelled"
    for execution_id in [*finished, *held, *racing]:
        execution = done[execution_id]
        assert execution["status"] == "completed", execution
        tag = execution["input"]["tag"]
        n = execution["input"]["n"]
        assert execution["output"]["total"] == sum(i * i for i in range(n))
        assert execution["output"]["done"] == f"{tag}:{execution['output']['total']}"
        token = [s for s in after[execution_id]["steps"].values() if s["target"] == "token"]
        assert [s["result"] for s in token] == [execution["output"]["token"]]
    # No recorded body ran again: every step recorded before the kill ran once;
    # a body whose result the kill cut off may have run one more time.
    runs = Counter(counter.read_text("utf-8").splitlines())
    recorded_before = {
        f"{s['args']['tag']} work {s['args']['i']}"
        for b in before.values()
        for s in b["steps"].values()
        if s["target"] == "work" and s["status"] == "succeeded"
    }
    assert recorded_before >= {f"done{i} work {j}" for i in range(3) for j in range(3)}
    for line in recorded_before:
        assert runs[line] == 1, line
    for execution_id in [*finished, *held, *racing]:
        tag = done[execution_id]["input"]["tag"]
        n = done[execution_id]["input"]["n"]
        for line in [f"{tag} work {i}" for i in range(n)] + [f"{tag} finish"]:
            assert 1 <= runs[line] <= 2, (line, runs[line])
    for tag in [*gates, "done0", "done1", "done2"]:
        assert runs[f"{tag} finish"] == 1
    assert runs["gone finish"] == 0


def start_dev(db: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "rebuno_anyio.cli", "dev", "--db", str(db), "--port", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


def test_one_kernel_per_file_and_online_backup(tmp_path: Path) -> None:
    db = tmp_path / "rebuno.db"
    kernel = Kernel(db)
    try:
        kernel.register("bk", "http://127.0.0.1:9/webhook", "s")
        ids = [
            kernel.call("POST", "/v0/executions", {"agent_id": "bk", "input": i})[1]["id"]
            for i in range(5)
        ]
        # A second kernel on the same file fails fast, naming the problem.
        second = start_dev(db)
        assert second.returncode != 0
        assert "in use by another rebuno kernel" in second.stderr
        assert str(db) in second.stderr
        # The documented online backup, while the kernel runs.
        backup = tmp_path / "backup.db"
        copied = subprocess.run(
            ["sqlite3", str(db), f".backup {backup}"], capture_output=True, text=True, timeout=30
        )
        assert copied.returncode == 0, copied.stderr
        status, _ = kernel.call("GET", "/v0/health")
        assert status == 200  # the backup did not disturb the kernel
    finally:
        assert reap(kernel, graceful=True) == 0
    # The copy is a working kernel database.
    restored = Kernel(backup)
    try:
        for execution_id in ids:
            status, body = restored.call("GET", f"/v0/executions/{execution_id}")
            assert status == 200
            assert body["agent_id"] == "bk"
    finally:
        reap(restored, graceful=True)


def test_database_from_a_newer_kernel_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "rebuno.db"
    kernel = Kernel(db)
    reap(kernel, graceful=True)
    with sqlite3.connect(db) as conn:
        (version,) = conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
        conn.execute(
            "INSERT INTO schema_migrations (version, applied_at) VALUES (?, 0)", (version + 1,)
        )
    conn.close()
    refused = start_dev(db)
    assert refused.returncode != 0
    assert re.search(r"schema version \d+ is newer than this kernel understands", refused.stderr)
    assert "upgrade" in refused.stderr


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "notes.txt"
    db.write_text("these are not the tables you are looking for\n" * 100)
    refused = start_dev(db)
    assert refused.returncode != 0
    assert "cannot open" in refused.stderr
    assert "rebuno database" in refused.stderr
    missing = start_dev(tmp_path / "no" / "such" / "dir" / "rebuno.db")
    assert missing.returncode != 0
    assert "does not exist" in missing.stderr

"""Kernel restarts with agents mid-handler, real processes on loopback.

A clean stop (SIGTERM) saves what the kernel keeps in memory and the next start
keeps every lease: the agent rides the restart out and nothing is delivered or
run again. A crash (SIGKILL) retires the leases instead: the execution is
delivered again at once, recorded steps replay, and it completes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import ROOT, AgentProc, Kernel, free_port, reap, running

SCRIPT = ROOT / "tests" / "agents" / "gated_agent.py"


def attempts_delivered(kernel: Kernel, execution_id: str) -> list[int]:
    return [
        e["payload"]["attempt"]
        for e in kernel.events(execution_id)
        if e["type"] == "dispatch.acked"
    ]


def wait_for_event(kernel: Kernel, execution_id: str, event_type: str) -> None:
    """Long-poll the execution's events until one of `event_type` is committed."""
    after = 0
    for _ in range(120):
        _, events = kernel.call(
            "GET", f"/v0/executions/{execution_id}/events?after_seq={after}&wait=1"
        )
        if any(e["type"] == event_type for e in events or []):
            return
        if events:
            after = events[-1]["event_seq"]
    raise AssertionError(f"no {event_type} for {execution_id}")


LEASE_S = 8


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("how", ["clean", "crash"])
def test_an_agent_mid_handler_survives_a_kernel_restart(
    tmp_path: Path, backend: str, how: str
) -> None:
    db, log, gate = tmp_path / "k.db", tmp_path / "log", tmp_path / "gate"
    port = free_port()
    extra = ["--port", str(port)]
    # Short enough that a crash restart, which waits out the leases it
    # retires, re-delivers within seconds; long enough to ride out a restart.
    kernel = Kernel(db, lease_timeout=LEASE_S, extra=extra)
    try:
        with running(
            AgentProc(SCRIPT, "0", str(log), str(gate), backend, env={"REBUNO_URL": kernel.url})
        ) as agent:
            kernel.register("gated", agent.webhook_url, "gated-secret")
            status, created = kernel.call(
                "POST", "/v0/executions", {"agent_id": "gated", "input": {"x": 4}}
            )
            assert status == 201, created
            execution_id = created["id"]
            # `first` has run and its result is recorded (acknowledged to the agent).
            wait_for_event(kernel, execution_id, "step.succeeded")

            if how == "clean":
                assert reap(kernel, graceful=True) == 0
            else:
                reap(kernel)
            kernel = Kernel(db, lease_timeout=LEASE_S, extra=extra)
            gate.touch()
            final = kernel.wait_terminal(execution_id, timeout=60)

        assert final["status"] == "completed", final
        assert final["output"] == 50
        ran = [line.split()[0] for line in log.read_text().splitlines()]
        assert ran == ["first", "second"]  # no body ran twice
        if how == "clean":
            # Leases stayed in force: the one delivery carried the execution through.
            assert attempts_delivered(kernel, execution_id) == [1]
        else:
            # Retired at the restart and delivered again once the old lease would
            # have lapsed; not charged as a failed attempt.
            assert attempts_delivered(kernel, execution_id) == [1, 2]
    finally:
        reap(kernel)

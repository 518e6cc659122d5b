"""The main job, end to end: a kernel on its embedded SQLite default, the hello
agent, one execution; prints the output and the event log.

    python examples/demo.py [--name Ada] [--db PATH] [--backend asyncio|trio]

Starts `rebuno dev` and `examples/hello.py` as real processes on free loopback
ports, registers the agent, creates an execution, waits for it, and stops both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import anyio
from rich.console import Console
from rich.table import Table

from rebuno_anyio import Client

HERE = Path(__file__).resolve().parent


def start(args: list[str], env: dict[str, str], what: str) -> tuple[subprocess.Popen[str], str]:
    """Start a process and wait for its `listening on <url>` line (no fixed sleeps)."""
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    found = threading.Event()
    url: list[str] = []
    lines: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip())
            match = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if match and not found.is_set():
                url.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(30) or not url:
        proc.kill()
        sys.exit(f"{what} did not start:\n" + "\n".join(lines[-20:]))
    return proc, url[0]


async def run_execution(kernel_url: str, agent_url: str, name: str) -> None:
    console = Console()
    async with Client(kernel_url) as client:
        await client.register_agent(
            "hello", webhook_url=f"{agent_url}/webhook", secret="dev-secret"
        )
        created = await client.create("hello", {"name": name})
        console.print(f"execution [bold]{created.id}[/bold] created")
        done = await client.wait(created.id, timeout=60)
        console.print(f"status: [bold]{done.status}[/bold]")
        if done.status == "completed":
            console.print("output: " + json.dumps(done.output, ensure_ascii=False))
        else:
            console.print(f"failure: {done.failure_reason}")
        events = await client.events(created.id, limit=1000)
        table = Table(title="event log", title_justify="left")
        for column in ("seq", "type", "detail"):
            table.add_column(column)
        for event in events:
            payload = event.payload if isinstance(event.payload, dict) else {}
            detail = {
                k: v
                for k, v in payload.items()
                if k in ("target", "attempt", "reason", "output", "rule_id")
            }
            table.add_row(str(event.event_seq), event.type, json.dumps(detail) if detail else "")
        console.print(table)
        if done.status != "completed":
            sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="Ada", help="who to greet")
    parser.add_argument("--db", default=None, help="SQLite file (default: a fresh temporary one)")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = options.db or os.path.join(tmp, "rebuno.db")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        kernel, kernel_url = start(
            [
                sys.executable,
                "-m",
                "rebuno_anyio.cli",
                "dev",
                "--db",
                db,
                "--port",
                "0",
                "--log-level",
                "warning",
            ],
            env,
            "the kernel",
        )
        agent = None
        try:
            agent_env = {
                **env,
                "REBUNO_URL": kernel_url,
                "REBUNO_AGENT_SECRET": "dev-secret",
                "REBUNO_BACKEND": options.backend,
            }
            agent, agent_url = start(
                [sys.executable, str(HERE / "hello.py"), "0"], agent_env, "the hello agent"
            )
            print(f"kernel {kernel_url} (SQLite {db}), agent {agent_url}", file=sys.stderr)
            anyio.run(run_execution, kernel_url, agent_url, options.name, backend=options.backend)
        finally:
            for proc in (agent, kernel):
                if proc is not None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        proc.kill()


if __name__ == "__main__":
    main()

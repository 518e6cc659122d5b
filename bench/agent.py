"""End-to-end steps/s: kernel process + agent process, real HTTP on loopback.

    .venv/bin/python bench/agent.py [--steps 2000] [--backends asyncio,trio]

An agent (our SDK) whose handler calls a tool with a trivial body N times runs
against a kernel (`rebuno dev`, SQLite, synchronous=FULL). We time executions
from creation until every one has completed, with 1 and with 16 concurrent
executions, on asyncio and on trio. Beside it, in the same run, the
kernel-only floor of bench/kernel.py: the same steps driven straight at the
kernel (no agent SDK, no webhook, no handler).
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
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel import AGENT, SECRET, Driver, steps_per_second

from rebuno_anyio import Client
from rebuno_anyio._server import HttpServer

AGENT_CODE = """
import sys
from rebuno_anyio import Agent, tool

@tool
async def noop(i: int) -> int:
    return i

agent = Agent("bench-e2e", secret="bench-secret", base_url=sys.argv[1])

async def process(steps: int) -> int:
    total = 0
    for i in range(steps):
        total += await noop(i)
    return total

agent.run(process, host="127.0.0.1", port=0, backend=sys.argv[2])
"""


def spawn(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        match = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
            return proc, match.group(1)
    raise SystemExit(f"{args[:3]} failed to start (exit {proc.wait()})")


async def end_to_end(kernel_url: str, executions: int, steps: int) -> float:
    async with Client(kernel_url, timeout=120) as client:
        start = time.perf_counter()
        created = [await client.create("bench-e2e", {"steps": steps}) for _ in range(executions)]
        results: list[Any] = []

        async def wait(execution_id: str) -> None:
            results.append(await client.wait(execution_id, timeout=600))

        async with anyio.create_task_group() as tg:
            for execution in created:
                tg.start_soon(wait, execution.id)
        elapsed = time.perf_counter() - start
    bad = [r for r in results if r.status != "completed" or r.output != steps * (steps - 1) // 2]
    if bad:
        raise SystemExit(f"{len(bad)} executions did not complete correctly: {bad[0]}")
    return executions * steps / elapsed


async def run(options: argparse.Namespace, tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    kernel, url = spawn(
        [
            sys.executable,
            "-m",
            "rebuno_anyio.cli",
            "dev",
            "--db",
            os.path.join(tmp, "k.db"),
            "--port",
            "0",
            "--log-level",
            "warning",
        ]
    )
    try:
        driver = Driver(url)
        async with anyio.create_task_group() as tg:
            port = await tg.start(HttpServer(driver.webhook).serve, "127.0.0.1", 0)
            await driver.admin(
                "POST",
                "/v0/agents",
                {
                    "id": AGENT,
                    "webhook_url": f"http://127.0.0.1:{port}/webhook",
                    "secret": SECRET.decode(),
                },
            )
            for n in (1, 16):
                results[f"kernel_only_steps_per_s_{n}"] = await steps_per_second(
                    driver, n, options.seconds
                )
            tg.cancel_scope.cancel()
        await driver.http.aclose()
        for backend in options.backends:
            agent, agent_url = spawn([sys.executable, "-c", AGENT_CODE, url, backend])
            try:
                async with Client(url) as client:
                    await client.register_agent(
                        "bench-e2e", webhook_url=f"{agent_url}/webhook", secret="bench-secret"
                    )
                await end_to_end(url, 1, 50)  # warm up
                results[f"{backend}_steps_per_s_1"] = await end_to_end(url, 1, options.steps)
                results[f"{backend}_steps_per_s_16"] = await end_to_end(
                    url, 16, max(options.steps // 8, 50)
                )
            finally:
                agent.kill()
    finally:
        kernel.kill()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="end-to-end steps/s, agent SDK + kernel")
    parser.add_argument("--steps", type=int, default=2000, help="steps of the single execution")
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="duration of the kernel-only floor"
    )
    parser.add_argument("--backends", default="asyncio,trio")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    options.backends = [b for b in options.backends.split(",") if b]
    with tempfile.TemporaryDirectory() as tmp:
        results = anyio.run(run, options, tmp)
    if options.json:
        print(json.dumps(results, indent=2))
        return
    for n in (1, 16):
        floor = results[f"kernel_only_steps_per_s_{n}"]
        print(f"{n:>2} execution(s): kernel-only floor {floor:,.0f} steps/s")
        for backend in options.backends:
            sps = results[f"{backend}_steps_per_s_{n}"]
            print(
                f"    end to end, {backend:<7} {sps:,.0f} steps/s"
                f"  (x{sps / floor:.2f} of the floor)"
            )


if __name__ == "__main__":
    main()

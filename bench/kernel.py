"""Kernel throughput over real HTTP on loopback, against floors from the same run.

    .venv/bin/python bench/kernel.py [--seconds 3] [--replay 100,10000] [--synchronous FULL]

The kernel runs in its own process (SQLite file, `synchronous=FULL` by
default). This process plays the agent: it receives the webhook, then drives
steps (submit + complete, signed v1) with the project's lean HTTP client.

Reported:
  * steps/s with 1 and with 16 concurrent executions;
  * replay cost per step for executions with 100 and 10,000 recorded steps
    (record them, let the lease lapse, and time the re-delivered attempt
    replaying every step);
  * floors: raw SQLite commits/s with the same pragmas (one small insert per
    commit), and raw HTTP round trips/s through the same server (a handler that
    answers at once).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio

from rebuno_anyio._h11client import HttpClient
from rebuno_anyio._http import Request, Response
from rebuno_anyio._server import HttpServer
from rebuno_proto import sign_request

SECRET = b"bench-secret"
AGENT = "bench"

KERNEL = """
import anyio, sys
from rebuno_anyio.kernel import KernelConfig, serve_kernel
from rebuno_proto import DispatchSettings
cfg = KernelConfig(db=sys.argv[1], port=int(sys.argv[4]), synchronous=sys.argv[3],
                   settings=DispatchSettings(lease_timeout_s=float(sys.argv[2])),
                   poll_interval_s=0.2)
async def main():
    async with anyio.create_task_group() as tg:
        running = await tg.start(serve_kernel, cfg)
        print(f"listening on http://127.0.0.1:{running.port}", file=sys.stderr, flush=True)
anyio.run(main)
"""

ECHO = """
import anyio, sys
from rebuno_anyio._server import HttpServer
from rebuno_anyio._http import Response
async def handler(request):
    return Response.json(200, b'{"decision":"proceed"}')
async def main():
    async with anyio.create_task_group() as tg:
        port = await tg.start(HttpServer(handler).serve, "127.0.0.1", 0)
        print(f"listening on http://127.0.0.1:{port}", file=sys.stderr, flush=True)
anyio.run(main)
"""


def spawn(code: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
            return proc, match.group(1)
    raise SystemExit(f"process failed to start (exit {proc.wait()})")


def sqlite_floor(path: str, synchronous: str, seconds: float) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t (v) VALUES (?)", ("x" * 100,))
        conn.execute("COMMIT")
        n += 1
    elapsed = time.perf_counter() - start
    conn.close()
    return n / elapsed


class Driver:
    """Plays the agent: collects webhooks, signs and sends kernel calls."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = HttpClient(url, max_connections=64)
        self.leases: dict[str, list[dict[str, Any]]] = {}
        self.arrived = anyio.Event()

    async def webhook(self, request: Request) -> Response:
        payload = json.loads(request.body)
        self.leases.setdefault(payload["execution_id"], []).append(payload)
        self.arrived.set()
        self.arrived = anyio.Event()
        return Response(200)

    async def call(self, method: str, path: str, body: bytes, lease: dict[str, Any] | None) -> Any:
        ts = int(time.time())
        headers = [
            ("Content-Type", "application/json"),
            ("Rebuno-Agent-Id", AGENT),
            ("Rebuno-Timestamp", str(ts)),
        ]
        dispatch_id = attempt = None
        if lease is not None:
            dispatch_id, attempt = lease["dispatch_id"], lease["dispatch_attempt"]
            headers += [
                ("Rebuno-Dispatch-Id", dispatch_id),
                ("Rebuno-Dispatch-Attempt", str(attempt)),
            ]
        signature = sign_request(
            SECRET,
            method=method,
            target=self.http.target(path),
            timestamp=ts,
            body=body,
            dispatch_id=dispatch_id,
            attempt=attempt,
        )
        headers.append(("Rebuno-Signature", signature))
        response = await self.http.request(method, path, headers=headers, body=body)
        if response.status >= 300:
            raise RuntimeError(f"{method} {path}: {response.status} {response.body[:200]!r}")
        return json.loads(response.body) if response.body else None

    async def admin(self, method: str, path: str, body: Any) -> Any:
        response = await self.http.request(
            method,
            path,
            headers=[("Content-Type", "application/json")],
            body=json.dumps(body).encode(),
        )
        assert response.status < 300, response.body
        return json.loads(response.body) if response.body else None

    async def lease_for(self, execution_id: str, attempt: int) -> dict[str, Any]:
        while True:
            for lease in self.leases.get(execution_id, []):
                if lease["dispatch_attempt"] >= attempt:
                    return lease
            await self.arrived.wait()

    async def start(self) -> tuple[str, dict[str, Any]]:
        created = await self.admin("POST", "/v0/executions", {"agent_id": AGENT, "input": {}})
        return created["id"], await self.lease_for(created["id"], 1)

    async def step(self, execution_id: str, lease: dict[str, Any], i: int) -> str:
        body = json.dumps(
            {
                "kind": "tool_call",
                "target": "tool",
                "args": {"i": i, "q": "hello world"},
                "idempotency": "safe_to_retry",
                "resources": [],
            }
        ).encode()
        decision = await self.call("POST", f"/v0/executions/{execution_id}/steps", body, lease)
        if decision["decision"] == "proceed":
            result = json.dumps({"result": {"i": i, "ok": True}}).encode()
            await self.call(
                "POST",
                f"/v0/executions/{execution_id}/steps/{decision['step_id']}/complete",
                result,
                lease,
            )
        return str(decision["decision"])


async def steps_per_second(driver: Driver, executions: int, seconds: float) -> float:
    started = [await driver.start() for _ in range(executions)]
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker(execution_id: str, lease: dict[str, Any]) -> None:
        nonlocal count
        i = 0
        while time.perf_counter() < deadline:
            await driver.step(execution_id, lease, i)
            i += 1
            count += 1

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for execution_id, lease in started:
            tg.start_soon(worker, execution_id, lease)
    return count / (time.perf_counter() - start)


async def replay_cost(
    driver: Driver, steps: int, total: int, restart: Callable[[], None]
) -> tuple[float, float]:
    """(seconds per recorded step, seconds per replayed step) for executions of
    `steps` recorded steps; enough executions that about `total` steps replay,
    so short histories are timed over as many steps as long ones.

    The re-delivery comes from restarting the kernel (SIGKILL, start on the same
    file): a start retires every earlier lease and re-delivers at once."""
    executions = [await driver.start() for _ in range(max(1, total // steps))]
    start = time.perf_counter()
    for execution_id, lease in executions:
        for i in range(steps):
            assert await driver.step(execution_id, lease, i) == "proceed"
    count = steps * len(executions)
    record = (time.perf_counter() - start) / count
    restart()
    await driver.http.aclose()
    driver.http = HttpClient(driver.url, max_connections=64)
    seconds = [await driver.lease_for(execution_id, 2) for execution_id, _ in executions]
    start = time.perf_counter()
    for (execution_id, _), lease in zip(executions, seconds, strict=True):
        for i in range(steps):
            got = await driver.step(execution_id, lease, i)
            assert got == "replay", (got, i, lease)
    return record, (time.perf_counter() - start) / count


async def http_floor(url: str, seconds: float, concurrency: int) -> float:
    client = HttpClient(url, max_connections=concurrency)
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            await client.request(
                "POST", "/x", headers=[("Content-Type", "application/json")], body=b"{}"
            )
            count += 1

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    await client.aclose()
    return count / (time.perf_counter() - start)


async def run(options: argparse.Namespace, tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {"synchronous": options.synchronous}
    results["sqlite_commits_per_s"] = sqlite_floor(
        os.path.join(tmp, "floor.db"), options.synchronous, options.seconds
    )
    echo, echo_url = spawn(ECHO)
    try:
        results["http_rtt_per_s_1"] = await http_floor(echo_url, options.seconds, 1)
        results["http_rtt_per_s_16"] = await http_floor(echo_url, options.seconds, 16)
    finally:
        echo.kill()
    db = os.path.join(tmp, "kernel.db")
    kernel, url = spawn(KERNEL, db, str(options.lease), options.synchronous, "0")
    procs = [kernel]

    def restart() -> None:
        procs[-1].kill()
        procs[-1].wait()
        procs.append(
            spawn(KERNEL, db, str(options.lease), options.synchronous, url.rsplit(":", 1)[1])[0]
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
            results["steps_per_s_1"] = await steps_per_second(driver, 1, options.seconds)
            results["steps_per_s_16"] = await steps_per_second(driver, 16, options.seconds)
            for n in options.replay:
                record, replay = await replay_cost(driver, n, max(options.replay), restart)
                results[f"record_ms_per_step_{n}"] = record * 1000
                results[f"replay_ms_per_step_{n}"] = replay * 1000
            tg.cancel_scope.cancel()
        await driver.http.aclose()
    finally:
        for proc in procs:
            proc.kill()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="kernel steps/s and replay cost over HTTP")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument(
        "--replay", default="100,10000", help="recorded-step counts for the replay test"
    )
    parser.add_argument(
        "--lease", type=float, default=120.0, help="lease timeout of the benchmark kernel (s)"
    )
    parser.add_argument("--synchronous", default="FULL", choices=["FULL", "NORMAL"])
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    options.replay = [int(n) for n in options.replay.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        results = anyio.run(run, options, tmp)
    if options.json:
        print(json.dumps(results, indent=2))
        return
    sqlite, rtt1, rtt16 = (
        results["sqlite_commits_per_s"],
        results["http_rtt_per_s_1"],
        results["http_rtt_per_s_16"],
    )
    print(
        f"floors: SQLite commits/s ({options.synchronous}) {sqlite:,.0f}; "
        f"HTTP round trips/s {rtt1:,.0f} (1 conn), {rtt16:,.0f} (16)"
    )
    for n in (1, 16):
        sps = results[f"steps_per_s_{n}"]
        rtt = results[f"http_rtt_per_s_{n}"]
        print(
            f"steps/s, {n:>2} executions: {sps:,.0f}  (x{sps / sqlite:.2f} of SQLite commits/s, "
            f"x{2 * sps / rtt:.2f} of HTTP round trips)"
        )
    base = None
    for n in options.replay:
        replay = results[f"replay_ms_per_step_{n}"]
        base = base or replay
        print(
            f"replay, {n:>6} steps: {replay:.3f} ms/step "
            f"(recording {results[f'record_ms_per_step_{n}']:.3f} ms/step), "
            f"x{replay / base:.2f} of the first"
        )


if __name__ == "__main__":
    main()

"""Benchmark: our kernel HTTP client against httpx.AsyncClient.

Starts a minimal h11 server on anyio in a subprocess (so client and server do not
share one interpreter's GIL), then measures requests per second for each client:
sequentially on one keep-alive connection, and with 16 concurrent tasks, on asyncio
and on trio. "raw" is the floor: bare anyio streams sending a pre-encoded request.
Prints a table and the ratios ours / httpx and ours / raw.

    .venv/bin/python bench/http_client.py [--seconds 1.5] [--rounds 3] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import h11
import httpx
from anyio.abc import SocketStream

from rebuno_anyio._h11client import HttpClient

BODY = b'{"decision":"proceed","step_id":"s_0123456789abcdef","occurrence":1,"result":null}'
PATH = "/v0/executions/e_bench/steps"
HEADERS = [("content-type", "application/json"), ("x-rebuno-signature", "v1=" + "ab" * 32)]
Call = Callable[[], Awaitable[None]]
REQUEST_BODY = b'{"tool_id":"search","arguments":{"q":"durable execution"},"idempotent":true}'


async def _serve_connection(stream: SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    conn.receive_data(await stream.receive(65536))
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                continue
            if isinstance(event, h11.Request):
                continue
            if isinstance(event, h11.Data):
                continue
            if isinstance(event, h11.EndOfMessage):
                headers = [("content-type", "application/json"), ("content-length", str(len(BODY)))]
                out = conn.send(h11.Response(status_code=200, headers=headers))
                out += conn.send(h11.Data(data=BODY)) + conn.send(h11.EndOfMessage())
                try:
                    await stream.send(out)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
                if conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
                continue
            return  # ConnectionClosed, PAUSED or anything else: stop


async def _serve(port: int) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    print(listener.extra(anyio.abc.SocketAttribute.local_port), flush=True)
    await listener.serve(_serve_connection)


async def _rate(fn: Call, seconds: float, concurrency: int) -> float:
    for _ in range(50):  # warm up: open the connections, fill caches
        await fn()
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            await fn()
            count += 1

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return count / (time.perf_counter() - start)


@asynccontextmanager
async def _raw(url: str) -> AsyncIterator[Call]:
    """The floor: bare anyio streams, a pre-encoded request, no pool logic, no timeout."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    request = (
        f"POST {PATH} HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-length: {len(REQUEST_BODY)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in HEADERS)
        + "\r\n"
    ).encode() + REQUEST_BODY
    idle: list[SocketStream] = []

    async def call() -> None:
        stream = idle.pop() if idle else await anyio.connect_tcp(host, int(port))
        await stream.send(request)
        data = await stream.receive()
        while not data.endswith(BODY):
            data += await stream.receive()
        idle.append(stream)

    yield call
    for stream in idle:
        await stream.aclose()


@asynccontextmanager
async def _ours(url: str) -> AsyncIterator[Call]:
    async with HttpClient(url) as client:

        async def call() -> None:
            response = await client.request("POST", PATH, headers=HEADERS, body=REQUEST_BODY)
            assert response.status == 200

        yield call


@asynccontextmanager
async def _httpx(url: str) -> AsyncIterator[Call]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

        async def call() -> None:
            response = await client.post(PATH, headers=HEADERS, content=REQUEST_BODY)
            assert response.status_code == 200

        yield call


CLIENTS = {"raw": _raw, "ours": _ours, "httpx": _httpx}


async def _measure(url: str, seconds: float, concurrency: int) -> dict[tuple[str, int], float]:
    out: dict[tuple[str, int], float] = {}
    for conc in (1, concurrency):
        for name, client in CLIENTS.items():
            async with client(url) as call:
                out[name, conc] = await _rate(call, seconds, conc)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        anyio.run(_serve, args.serve)
        return
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        results: dict[str, dict[tuple[str, int], float]] = {}
        for _ in range(args.rounds):  # interleave the rounds, keep each figure's best
            for backend in ("asyncio", "trio"):
                got = anyio.run(_measure, url, args.seconds, args.concurrency, backend=backend)
                best = results.setdefault(backend, got)
                for key, rate in got.items():
                    best[key] = max(best[key], rate)
    finally:
        server.terminate()
        server.wait()
    print(
        f"\nrequests/s, h11 server on anyio (asyncio) in a subprocess, "
        f"best of {args.rounds} x {args.seconds:g} s"
    )
    print(
        f"{'backend':<8} {'mode':<14} {'raw':>8} {'ours':>8} {'httpx':>8} "
        f"{'ours/httpx':>11} {'ours/raw':>9}"
    )
    for backend, res in results.items():
        for conc in (1, args.concurrency):
            mode = "sequential" if conc == 1 else f"{conc} concurrent"
            raw, ours, theirs = res["raw", conc], res["ours", conc], res["httpx", conc]
            print(
                f"{backend:<8} {mode:<14} {raw:>8.0f} {ours:>8.0f} {theirs:>8.0f} "
                f"{ours / theirs:>10.2f}x {ours / raw:>8.2f}x"
            )


if __name__ == "__main__":
    main()

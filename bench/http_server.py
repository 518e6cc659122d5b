"""Benchmark: requests per second through the built-in HTTP/1.1 server.

Starts the server in a subprocess (so clients and server do not share one
interpreter's GIL) with a trivial handler, then drives it from this process with N
concurrent keep-alive raw-socket clients written on anyio, each sending one
request and reading its whole response before the next. Runs 1 and 16
connections on asyncio and on trio, and the same against a floor: an anyio
server that answers each request head with canned bytes, parsing nothing. The
ratio rebuno / floor is the cost of h11, the Request/Response model and the
server's bookkeeping. It also prints the server process's CPU time per request
(from /proc, Linux only), which other load on the machine disturbs far less than
throughput.

    .venv/bin/python bench/http_server.py [--seconds 3] [--connections 1 16] [--repeat 3]

Each figure is the best of `--repeat` runs, since on a shared machine noise only
ever lowers a throughput.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import anyio
from anyio.abc import SocketStream

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rebuno_anyio._http import Request, Response
from rebuno_anyio._server import HttpServer

BODY = b'{"decision":"proceed","step_id":"s_0123456789abcdef","occurrence":1}'
REQUEST = (
    b"POST /v0/executions/e_1/steps HTTP/1.1\r\nHost: bench\r\n"
    b"Content-Type: application/json\r\nContent-Length: 27\r\n\r\n"
    b'{"tool_id":"search","n":42}'
)
CANNED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)


async def handler(request: Request) -> Response:
    return Response.json(200, BODY)


async def _floor_connection(stream: SocketStream) -> None:
    async with stream:
        pending = b""
        while True:
            try:
                pending += await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            # Every request here has a 27-byte body after its head.
            while (end := pending.find(b"\r\n\r\n")) >= 0 and len(pending) >= end + 31:
                pending = pending[end + 31 :]
                await stream.send(CANNED)


async def serve(kind: str) -> None:
    if kind == "rebuno":
        server = HttpServer(handler)
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            print(port, flush=True)
    else:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        print(listener.extra(anyio.abc.SocketAttribute.local_port), flush=True)
        await listener.serve(_floor_connection)


async def _client(port: int, stop_at: float, counts: list[int]) -> None:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        buffer = b""
        done = 0
        while anyio.current_time() < stop_at:
            await stream.send(REQUEST)
            while (end := buffer.find(b"\r\n\r\n")) < 0:
                buffer += await stream.receive(65536)
            start = buffer.find(b"content-length: ", 0, end) + 16
            length = int(buffer[start : buffer.index(b"\r\n", start)])
            while len(buffer) < end + 4 + length:
                buffer += await stream.receive(65536)
            buffer = buffer[end + 4 + length :]
            done += 1
        counts.append(done)


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used (0 where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(
    port: int, pid: int, connections: int, seconds: float, repeat: int
) -> tuple[float, float]:
    """The best requests/s of `repeat` runs after a short warm-up, and the
    server's CPU microseconds per request over all of them."""
    rates = []
    total = 0
    cpu_at = 0.0
    for run, duration in enumerate((min(0.5, seconds), *[seconds] * repeat)):
        if run == 1:
            cpu_at = _cpu_s(pid)
        counts: list[int] = []
        stop_at = anyio.current_time() + duration
        async with anyio.create_task_group() as tg:
            for _ in range(connections):
                tg.start_soon(_client, port, stop_at, counts)
        rates.append(sum(counts) / duration)
        total += sum(counts) if run else 0
    return max(rates[1:]), (_cpu_s(pid) - cpu_at) / total * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--serve", nargs=2, metavar=("BACKEND", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        backend, kind = args.serve
        anyio.run(serve, kind, backend=backend)
        return
    print(
        f"{'backend':8} {'conns':>5} {'rebuno req/s':>13} {'floor req/s':>12} {'ratio':>6}"
        f" {'rebuno cpu µs/req':>18} {'floor cpu µs/req':>17}"
    )
    for backend in ("asyncio", "trio"):
        for connections in args.connections:
            rates, cpu = {}, {}
            for kind in ("rebuno", "floor"):
                command = [sys.executable, __file__, "--serve", backend, kind]
                with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
                    assert child.stdout is not None
                    port = int(child.stdout.readline())
                    try:
                        rates[kind], cpu[kind] = anyio.run(
                            drive,
                            port,
                            child.pid,
                            connections,
                            args.seconds,
                            args.repeat,
                            backend=backend,
                        )
                    finally:
                        child.terminate()
            ratio = rates["rebuno"] / rates["floor"]
            print(
                f"{backend:8} {connections:5d} {rates['rebuno']:13,.0f} "
                f"{rates['floor']:12,.0f} {ratio:6.2f} {cpu['rebuno']:18.0f} {cpu['floor']:17.0f}"
            )


if __name__ == "__main__":
    main()

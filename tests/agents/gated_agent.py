"""An agent for restart tests: tool `first`, then wait for a gate file, then
tool `second`. Every tool body appends its name and the pid to a log file.

    python gated_agent.py PORT LOG GATE [BACKEND]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from _gate import wait_for_gate

from rebuno_anyio import Agent, tool

LOG = Path(sys.argv[2])
GATE = Path(sys.argv[3])


def record(name: str) -> None:
    with LOG.open("a") as f:
        f.write(f"{name} {os.getpid()}\n")


@tool
async def first(x: int) -> int:
    record("first")
    return x + 1


@tool
async def second(x: int) -> int:
    record("second")
    return x * 10


agent = Agent("gated", secret="gated-secret", base_url=os.environ["REBUNO_URL"])


async def process(x: int) -> int:
    y = await first(x)
    # The test opens the gate once the kernel has restarted.
    await anyio.to_thread.run_sync(wait_for_gate, str(GATE), abandon_on_cancel=True)
    return await second(y)


if __name__ == "__main__":
    agent.run(
        process,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        backend=sys.argv[4] if len(sys.argv) > 4 else "asyncio",
    )

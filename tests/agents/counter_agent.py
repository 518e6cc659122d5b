"""An agent on this SDK for the end-to-end tests (not collected by pytest).

usage: counter_agent.py AGENT_ID KERNEL_URL SECRET COUNTER_FILE [BACKEND]

Serves on a free loopback port and announces `listening on http://...`. Every
tool body appends one line to COUNTER_FILE, so a test can count how often each
body ran. Input: `{"tag": str, "n": int, "gate": path | null, "fail": bool}`:
`n` tool calls, one local step, then (if `gate` is set) a wait until that file
exists, announced once per dispatch as `at gate TAG`, then one more tool.
"""

from __future__ import annotations

import os
import sys

import anyio
import anyio.to_thread
from _gate import wait_for_gate

from rebuno_anyio import Agent, step, tool

AGENT_ID, KERNEL_URL, SECRET, COUNTER = sys.argv[1:5]
BACKEND = sys.argv[5] if len(sys.argv) > 5 else "asyncio"


def record(line: str) -> None:
    with open(COUNTER, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


@tool
async def work(tag: str, i: int) -> dict[str, object]:
    record(f"{tag} work {i}")
    return {"i": i, "square": i * i}


@tool
async def finish(tag: str, total: int) -> str:
    record(f"{tag} finish")
    return f"{tag}:{total}"


@tool
async def explode(tag: str) -> None:
    record(f"{tag} explode")
    raise RuntimeError(f"{tag} went wrong")


async def process(
    tag: str, n: int = 3, gate: str | None = None, fail: bool = False
) -> dict[str, object]:
    results = [await work(tag, i) for i in range(n)]
    token = await step("token", lambda: os.urandom(8).hex())
    if fail:
        await explode(tag)
    if gate is not None:
        print(f"at gate {tag}", file=sys.stderr, flush=True)
        await anyio.to_thread.run_sync(wait_for_gate, gate, abandon_on_cancel=True)
    total = sum(int(r["square"]) for r in results)  # type: ignore[call-overload]
    done = await finish(tag, total)
    return {"tag": tag, "total": total, "token": token, "done": done, "pid": os.getpid()}


if __name__ == "__main__":
    agent = Agent(AGENT_ID, secret=SECRET, base_url=KERNEL_URL, kernel_timeout=10.0)
    agent.run(process, host="127.0.0.1", port=0, backend=BACKEND)

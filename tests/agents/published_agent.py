"""An agent on the *published* `rebuno` SDK (0.29.2) for the interop tests.

usage: published_agent.py AGENT_ID KERNEL_URL SECRET COUNTER_FILE PORT

`Agent.run` serves with uvicorn on 127.0.0.1:PORT (uvicorn logs `Uvicorn
running on ...` once it listens). Every tool body appends a line to
COUNTER_FILE. Input: `{"tag": str, "n": int, "gate": path | null}`: `n`
lookups, a local step, an optional wait for the gate file (announced as `at
gate TAG`), then one more tool. With `"session"` runs it keeps a tally in the
session state.
"""

from __future__ import annotations

import os
import random
import sys

import anyio
import anyio.to_thread
from _gate import wait_for_gate
from rebuno import Agent, Result, previous, step, tool

AGENT_ID, KERNEL_URL, SECRET, COUNTER, PORT = sys.argv[1:6]


def record(line: str) -> None:
    with open(COUNTER, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


@tool
async def lookup(tag: str, i: int) -> dict[str, int]:
    record(f"{tag} lookup {i}")
    return {"i": i, "cube": i**3}


@tool("shout")
async def shout(text: str) -> str:
    record(f"{text} shout")
    return text.upper()


async def process(tag: str, n: int = 2, gate: str | None = None, tally: bool = False) -> object:
    found = [await lookup(tag, i) for i in range(n)]
    pick = await step("pick", lambda: random.randint(1, 10**9))
    if gate is not None:
        print(f"at gate {tag}", file=sys.stderr, flush=True)
        await anyio.to_thread.run_sync(wait_for_gate, gate, abandon_on_cancel=True)
    loud = await shout(tag)
    output = {"tag": tag, "cubes": [f["cube"] for f in found], "pick": pick, "loud": loud}
    if not tally:
        return output
    prior = await previous() or {"runs": 0}
    return Result(output={**output, "runs": prior["runs"] + 1}, state={"runs": prior["runs"] + 1})


if __name__ == "__main__":
    agent = Agent(AGENT_ID, secret=SECRET, base_url=KERNEL_URL, description="interop agent")
    agent.run(process, host="127.0.0.1", port=int(PORT))

"""The agent of tests/test_sdk_processes.py's kill-and-restart test (not collected).

usage: sdk_replay_agent.py PORT COUNTER_FILE

Environment: REBUNO_URL, REBUNO_AGENT_SECRET, SDK_AGENT_BACKEND (`asyncio` or
`trio`), and SDK_AGENT_HANG=1 to stop for good after the first two tools and
the local step, announcing `HANGING <attempt>` on stderr, so that the test can
kill the process right there.

Every tool and step body appends its name to COUNTER_FILE: the test counts
how often each body really ran.
"""

from __future__ import annotations

import os
import sys
import uuid

import anyio

from rebuno_anyio import Agent, execution, step, tool

PORT, COUNTER = int(sys.argv[1]), sys.argv[2]


def record(name: str) -> None:
    with open(COUNTER, "a", encoding="utf-8") as f:
        f.write(name + "\n")


@tool
async def first(x: int) -> int:
    record("first")
    return x + 1


@tool
def second(x: int) -> int:
    record("second")
    return x * 10


@tool
async def third(x: int) -> int:
    record("third")
    return x - 1


def new_token() -> str:
    record("token")
    return uuid.uuid4().hex


async def process(x: int) -> dict[str, object]:
    a = await first(x)
    b = await second(a)
    token = await step("token", new_token)
    if os.environ.get("SDK_AGENT_HANG") == "1":
        print(f"HANGING {execution().dispatch_attempt}", file=sys.stderr, flush=True)
        await anyio.sleep_forever()
    c = await third(b)
    return {"a": a, "b": b, "c": c, "token": token, "attempt": execution().dispatch_attempt}


if __name__ == "__main__":
    agent = Agent("sdk-agent", description="kill-and-restart test agent")
    agent.run(process, host="127.0.0.1", port=PORT, backend=os.environ["SDK_AGENT_BACKEND"])

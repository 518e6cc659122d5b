"""An agent under policy, for tests/test_governance.py.

Usage: `python governed_agent.py PORT AGENT_ID` (PORT 0: any free port), with
`REBUNO_URL`, `REBUNO_AGENT_SECRET`, `GOV_BACKEND` (asyncio | trio) and
`GOV_COUNTER` (a file every tool or step body appends one line to, so a test
can count how often each body really ran, across processes).

The input is a plan: `{"plan": [[kind, name, args], ...], "on_policy_error":
"raise" | "catch"}`, `kind` being `tool` (a `@tool`) or `step` (`rebuno.step`).
Each call's outcome goes to the output list. A tool's refusal string is
branched on: the handler records it and carries on. A `PolicyError` from a
step is caught and recorded (`catch`) or left to fail the execution (`raise`).

With `GOV_EXIT_ON_BLOCKED=1` the process exits once a handler has seen
`Blocked` (the dispatch unwinds, the kernel keeps the execution blocked).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from rebuno_anyio import Agent, Blocked, PolicyError, step, tool

COUNTER = os.environ["GOV_COUNTER"]


def _count(name: str, args: dict[str, Any]) -> None:
    with open(COUNTER, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {name} {json.dumps(args, sort_keys=True)}\n")


@tool
async def fetch(item: str) -> str:
    _count("fetch", {"item": item})
    return f"fetched {item}"


@tool
async def deploy(env: str) -> str:
    _count("deploy", {"env": env})
    return f"deployed {env}"


@tool
async def danger(what: str) -> str:
    _count("danger", {"what": what})
    return f"did {what}"


@tool
async def ping(n: int) -> str:
    _count("ping", {"n": n})
    return f"pong {n}"


TOOLS = {"fetch": fetch, "deploy": deploy, "danger": danger, "ping": ping}


def _local(name: str):
    def body(**args: Any) -> str:
        _count(name, args)
        return f"{name} done"

    return body


async def _call(kind: str, name: str, args: dict[str, Any], on_policy_error: str) -> Any:
    if kind == "tool":
        result = await TOOLS[name](**args)
        if isinstance(result, str) and result.startswith(f"{name} not allowed. reason: "):
            return {"refused": result}  # the handler branches on the refusal
        return {"ok": result}
    try:
        return {"ok": await step(name, _local(name), args)}
    except PolicyError as err:
        if on_policy_error != "catch":
            raise
        return {"policy_error": str(err), "reason": err.reason, "rule_id": err.rule_id}


async def process(plan: list, on_policy_error: str = "raise") -> list:
    out = []
    try:
        for kind, name, args in plan:
            out.append(await _call(kind, name, args, on_policy_error))
    except Blocked:
        print(f"handler saw Blocked after {len(out)} calls", file=sys.stderr, flush=True)
        if os.environ.get("GOV_EXIT_ON_BLOCKED") == "1":
            # SIGTERM ends `Agent.run`; the dispatch unwinds without writing anything.
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    return out


if __name__ == "__main__":
    agent = Agent(sys.argv[2])
    agent.run(process, host="127.0.0.1", port=int(sys.argv[1]), backend=os.environ["GOV_BACKEND"])

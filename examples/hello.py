"""A durable hello-world agent: two tools and a local step.

Run a kernel (`rebuno dev --config examples/hello.yaml`), then this agent
(`python examples/hello.py`), then create an execution:
`rebuno exec create hello '{"name": "Ada"}' --wait`.
"""

from __future__ import annotations

import os
import random
import sys

from rebuno_anyio import Agent, step, tool


@tool
async def greet(name: str) -> str:
    """A tool: its result is recorded and replays on a re-run."""
    return f"Hello, {name}!"


@tool("count_letters")
def count_letters(text: str) -> int:
    """A synchronous tool runs in a worker thread."""
    return sum(c.isalpha() for c in text)


agent = Agent(
    "hello",
    secret=os.environ.get("REBUNO_AGENT_SECRET", "dev-secret"),
    base_url=os.environ.get("REBUNO_URL", "http://127.0.0.1:8080"),
    description="Greets someone, durably.",
)


async def process(name: str = "world") -> dict:
    greeting = await greet(name)
    letters = await count_letters(greeting)
    # Anything non-deterministic goes through step(), so a replay sees the same value.
    lucky = await step("lucky_number", lambda: random.randint(1, 100))
    return {"greeting": greeting, "letters": letters, "lucky": lucky}


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("PORT", "5000"))
    backend = os.environ.get("REBUNO_BACKEND", "asyncio")
    agent.run(process, host="127.0.0.1", port=port, backend=backend)

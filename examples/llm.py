"""An agent that asks an LLM, durably: its chat completion is a recorded step.

The call goes through `http_client()`. The first time, it reaches the provider
and the answer is recorded; if the execution is delivered again (the agent
crashed, its lease lapsed), the recorded answer comes back and the provider is
not called a second time. Plain httpx against any OpenAI-compatible endpoint:

    OPENAI_BASE_URL   the API base (default https://api.openai.com/v1)
    OPENAI_API_KEY    sent as a bearer token (headers are not recorded)
    LLM_MODEL         the model (default gpt-4o-mini)

Run a kernel (`rebuno dev --config examples/llm.yaml`), then this agent
(`python examples/llm.py [PORT]`), then create an execution:
`rebuno exec create llm '{"question": "What is durable execution?"}' --wait`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import httpx

from rebuno_anyio import Agent, http_client, raise_for_refusal

agent = Agent(
    "llm",
    secret=os.environ.get("REBUNO_AGENT_SECRET", "dev-secret"),
    base_url=os.environ.get("REBUNO_URL", "http://127.0.0.1:8080"),
    description="Answers a question with an LLM; the call is recorded and replayed.",
)


async def process(question: str, system: str = "Answer in one short paragraph.") -> dict[str, Any]:
    base_url = os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1").rstrip("/")
    api_key = os.environ.get("OPENAI_API_KEY", "")
    model = os.environ.get("LLM_MODEL", "gpt-4o-mini")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # The whole body is the step's identity: the same request replays, any change
    # (another question, model or temperature) is a new call.
    request = {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }
    async with http_client(base_url=base_url, headers=headers, timeout=120.0) as llm:
        response = await llm.post("/chat/completions", json=request)
    try:
        response.raise_for_status()
    except httpx.HTTPStatusError as err:
        # A refused call (policy denial, approval pending, rate limit) arrives as a
        # provider error; turn it back into the Rebuno signal it stands for.
        raise_for_refusal(err)
        raise RuntimeError(
            f"the provider answered {response.status_code}: {response.text}"
        ) from err
    data = response.json()
    return {
        "answer": data["choices"][0]["message"]["content"],
        "model": data.get("model", model),
        "usage": data.get("usage"),
    }


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("PORT", "5001"))
    backend = os.environ.get("REBUNO_BACKEND", "asyncio")
    agent.run(process, host="127.0.0.1", port=port, backend=backend)

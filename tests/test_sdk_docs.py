"""The SDK's guides stay usable: their Python blocks compile, their links lead
somewhere, and the getting-started agent runs against a real kernel."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
from kernels import inprocess_kernel
from sdk_support import SECRET, served

from rebuno_anyio import Agent, Client

DOCS = Path(__file__).resolve().parent.parent / "docs"
GUIDES = ["getting-started.md", "agents.md", "tools.md", "sessions.md", "client.md"]


def python_blocks(name: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", (DOCS / name).read_text("utf-8"), re.S | re.M)


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("name", GUIDES)
def test_python_blocks_compile(name: str) -> None:
    blocks = python_blocks(name)
    assert blocks
    for i, block in enumerate(blocks):
        # Snippets may await at top level, as if inside a handler.
        compile(block, f"{name}[{i}]", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("name", GUIDES)
def test_links_resolve(name: str) -> None:
    text = (DOCS / name).read_text("utf-8")
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
        if target.startswith("http"):
            continue
        path = DOCS / (target or name)
        assert path.exists(), f"{name} links to missing {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text("utf-8"), re.M)
            assert anchor in {slug(h) for h in headings}, f"{name}: no #{anchor} in {path.name}"


@pytest.mark.anyio
async def test_getting_started_agent_runs() -> None:
    namespace: dict[str, Any] = {"__name__": "quotes"}
    exec(compile(python_blocks("getting-started.md")[0], "quotes.py", "exec"), namespace)
    process = namespace["process"]
    assert namespace["agent"].agent_id == "quotes"
    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = Agent("sdk-agent", secret=SECRET, base_url=k.url)
            async with served(k, process, agent=agent):
                final = await client.wait((await client.create("sdk-agent", {"symbol": "ACME"})).id)
                recorded = await client.list_steps(final.id)
    assert final.status == "completed", final.failure_reason
    assert final.output["price"] == 101.5
    assert final.output["checked_at"] == next(
        s.result for s in recorded if s.target == "checked_at"
    )

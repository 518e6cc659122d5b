"""docs/protocol.md stays true: its python blocks run, and its state tables are
the tables in `_state.py` and `_agent.py`.

Run this file directly to print the tables for pasting into the document:
`python tests/test_docs_example.py`.
"""

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from rebuno_proto import (
    APPROVAL_TRANSITIONS,
    DISPATCH_TRANSITIONS,
    EXECUTION_TRANSITIONS,
    STEP_TRANSITIONS,
)
from rebuno_proto._agent import _NEXT

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
TABLES: dict[str, Mapping[tuple[Any, Any], Any]] = {
    "execution": EXECUTION_TRANSITIONS,
    "step": STEP_TRANSITIONS,
    "dispatch": DISPATCH_TRANSITIONS,
    "approval": APPROVAL_TRANSITIONS,
}


def _name(value: Any) -> str:
    if isinstance(value, type):
        return value.__name__
    return str(value.value)


def render(table: Mapping[tuple[Any, Any], Any]) -> str:
    """A transition table as markdown, in the table's own order."""
    lines = ["| from | on | to |", "|---|---|---|"]
    for (state, trigger), target in table.items():
        lines.append(f"| `{_name(state)}` | `{_name(trigger)}` | `{_name(target)}` |")
    return "\n".join(lines)


def rendered_tables() -> dict[str, str]:
    out = {name: render(table) for name, table in TABLES.items()}
    out["agent-dispatch"] = render(_NEXT)
    return out


def doc_text() -> str:
    return DOC.read_text("utf-8")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_doc_has_python_blocks() -> None:
    blocks = python_blocks(doc_text())
    assert len(blocks) >= 2
    assert any("decide_submission" in b for b in blocks)


def test_python_blocks_run() -> None:
    """Every python block runs, in order, in one namespace (later blocks may
    use names from earlier ones)."""
    namespace: dict[str, Any] = {"__name__": "docs_protocol"}
    for i, block in enumerate(python_blocks(doc_text())):
        code = compile(block, f"docs/protocol.md[python block {i}]", "exec")
        exec(code, namespace)
    # The example ends by replaying the recorded result.
    assert namespace["replayed"].decision.value == "replay"
    assert namespace["replayed"].result == namespace["recorded_result"]


@pytest.mark.parametrize("name", [*TABLES, "agent-dispatch"])
def test_state_tables_match_the_code(name: str) -> None:
    text = doc_text()
    match = re.search(
        rf"<!-- table:{re.escape(name)} -->\n(.*?)\n<!-- /table -->", text, flags=re.S
    )
    assert match is not None, f"docs/protocol.md has no table:{name} block"
    assert match.group(1).strip() == rendered_tables()[name]


if __name__ == "__main__":
    for name, text in rendered_tables().items():
        print(f"<!-- table:{name} -->\n{text}\n<!-- /table -->\n")

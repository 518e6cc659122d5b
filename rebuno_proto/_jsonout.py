"""Writing JSON responses that embed stored JSON verbatim.

The kernel stores every JSON value a peer sent (`input`, `args`, `result`,
`output`...) as canonical text, so a replayed result is byte-for-byte what was
recorded. `RawJSON` marks such text inside a response; `dumps` writes it as is
and encodes everything else normally.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["JSONOut", "RawJSON", "dumps"]

_encode_str: Final = json.JSONEncoder(ensure_ascii=False).encode


class RawJSON:
    """A JSON text to embed verbatim (it must already be valid JSON)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"RawJSON({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RawJSON) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


JSONOut = RawJSON | str | int | float | bool | None | Mapping[str, "JSONOut"] | Sequence["JSONOut"]


def _write(value: JSONOut, parts: list[str]) -> None:
    if isinstance(value, str):
        parts.append(_encode_str(value))
    elif isinstance(value, RawJSON):
        parts.append(value.text)
    elif value is None:
        parts.append("null")
    elif value is True:
        parts.append("true")
    elif value is False:
        parts.append("false")
    elif isinstance(value, int | float):
        parts.append(json.dumps(value, allow_nan=False))
    elif isinstance(value, Mapping):
        parts.append("{")
        first = True
        for key, item in value.items():
            if not first:
                parts.append(",")
            first = False
            parts.append(_encode_str(key))
            parts.append(":")
            _write(item, parts)
        parts.append("}")
    else:
        parts.append("[")
        for i, item in enumerate(value):
            if i:
                parts.append(",")
            _write(item, parts)
        parts.append("]")


def dumps(value: JSONOut) -> str:
    """Compact JSON text of `value`, with `RawJSON` parts embedded verbatim."""
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts)

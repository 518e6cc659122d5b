"""Rebuno's canonical JSON (PROTOCOL.md §1.1), and exact JSON documents.

The canonical form is what the Go kernel's `identity.CanonicalizeJSON` writes:
no whitespace, object keys in byte-wise order, duplicate keys last-wins, number
literals kept exactly as written, strings escaped as Go's `encoding/json` does
(`<`, `>`, `&`, U+2028 and U+2029 as `\\u` escapes, everything else non-ASCII
raw), invalid UTF-8 and unpaired surrogates turned into U+FFFD.

How it is fast: the standard library's C scanner and encoder do the work. Number
literals are parsed into *marker strings* (the literal between two NUL
characters); the C encoder writes them as `"\\u0000<literal>\\u0000"` and two
`str.replace` calls strip the quotes back off. That is only sound when no string
in the input contains NUL, so any input with a `\\u0000` escape takes the slow,
pure-Python path instead, where numbers are `Number` objects. So does an
input with an unpaired surrogate escape (keys may collide once it becomes
U+FFFD, and only the slow decoder sees them in document order), and one whose
strings spell a marker's closing half in plain characters. Both paths give
the same bytes; the property tests hold them to that.

`Document` is the parsed form the wire-message parsers use: it knows which of
the two representations it holds, so a field can be read as a string or an
integer, and any subtree (a step's `args`, a `result`) can be written in
canonical form without re-reading the body.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from ._errors import CanonicalJSONError

__all__ = ["Document", "Number", "canonical_json", "parse_document"]

_MARK: Final = "\x00"
_MARKED_OPEN: Final = '"\\u0000'
_MARKED_CLOSE: Final = '\\u0000"'
# A string holding a backslash then "u0000" as plain characters (sent as
# `\u005cu0000`, which the `\u0000` test in `parse_document` does not see) is
# encoded `\\u0000`, and its tail would pass for a marker's closing half; such
# a text takes the slow path.
_SPOOFED_MARK: Final = "\\\\u0000"
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
# Escapes in the order the decoder reads them: an escaped backslash, a valid
# surrogate pair, or (group 1) an unpaired surrogate. The shared leading
# backslash lets the regex engine skip straight from one backslash to the next.
_SURROGATE_ESCAPES: Final = re.compile(
    r"\\(?:\\|u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    r"|(u[dD][89a-fA-F][0-9a-fA-F]{2}))"
)
_GO_ESCAPES: Final = (
    ("<", "\\u003c"),
    (">", "\\u003e"),
    ("&", "\\u0026"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
)
_NULL: Final = b"null"


class Number:
    """A JSON number kept as its literal text (slow path only)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Number({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Number) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def _marked(literal: str) -> str:
    return _MARK + literal + _MARK


def _reject_constant(name: str) -> Any:
    raise CanonicalJSONError(f"invalid JSON: {name} is not a JSON value")


def _clean_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Unpaired surrogates become U+FFFD *before* keys are merged, as in Go,
    # so two keys that differ only in a lone surrogate collide (last wins).
    return {_SURROGATE.sub("\ufffd", k): v for k, v in pairs}


_FAST_DECODER: Final = json.JSONDecoder(
    parse_float=_marked, parse_int=_marked, parse_constant=_reject_constant
)
_SLOW_DECODER: Final = json.JSONDecoder(
    parse_float=Number,
    parse_int=Number,
    parse_constant=_reject_constant,
    object_pairs_hook=_clean_pairs,
)
_FAST_ENCODER: Final = json.JSONEncoder(
    ensure_ascii=False, sort_keys=True, separators=(",", ":"), check_circular=False
)
_STRING_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, check_circular=False)


def _decode_utf8(data: bytes) -> str:
    """UTF-8 decode where each invalid byte becomes one U+FFFD, as Go's
    `utf8.DecodeRune` reports it (Python's "replace" merges some sequences)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    parts: list[str] = []
    start = 0
    while True:
        try:
            parts.append(data[start:].decode("utf-8"))
            return "".join(parts)
        except UnicodeDecodeError as err:
            parts.append(data[start : start + err.start].decode("utf-8"))
            parts.append("\ufffd")
            start += err.start + 1


def _go_escape(text: str) -> str:
    for raw, escaped in _GO_ESCAPES:
        if raw in text:
            text = text.replace(raw, escaped)
    return text


def _parse(text: str, decoder: json.JSONDecoder) -> Any:
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as err:
        raise CanonicalJSONError(
            f"invalid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    except RecursionError:
        raise CanonicalJSONError("invalid JSON: nesting too deep") from None


class Document:
    """A parsed JSON text that can write any of its parts in canonical form.

    Build one with `parse_document`. `value` is the parsed tree: objects are
    `dict`, arrays `list`, strings `str`, `true`/`false`/`null` the Python
    singletons; numbers are opaque (read them with `integer` or `plain`).
    """

    __slots__ = ("_is_marked", "value")

    def __init__(self, value: Any, *, is_marked: bool) -> None:
        self.value = value
        self._is_marked = is_marked

    def is_number(self, node: Any) -> bool:
        """Whether `node` (a part of `value`) is a JSON number."""
        if self._is_marked:
            return isinstance(node, str) and node[:1] == _MARK
        return isinstance(node, Number)

    def is_string(self, node: Any) -> bool:
        """Whether `node` (a part of `value`) is a JSON string."""
        return isinstance(node, str) and not (self._is_marked and node[:1] == _MARK)

    def number_text(self, node: Any) -> str | None:
        """The literal text of a JSON number node, or `None` if it is not one."""
        if self._is_marked:
            if isinstance(node, str) and node[:1] == _MARK:
                return node[1:-1]
            return None
        return node.text if isinstance(node, Number) else None

    def integer(self, node: Any) -> int | None:
        """A number node written as a plain integer literal, as an `int`."""
        text = self.number_text(node)
        # Past 20 digits it is no count or id the protocol has, and Python
        # refuses to convert past 4300: either way, not an integer we accept.
        if text is None or len(text) > 20 or not re.fullmatch(r"-?[0-9]+", text):
            return None
        return int(text)

    def plain(self, node: Any) -> Any:
        """`node` as ordinary Python values: numbers become `int` or `float`."""
        if self.is_number(node):
            text = self.number_text(node)
            assert text is not None
            if len(text) <= 4000 and re.fullmatch(r"-?[0-9]+", text):
                return int(text)
            return float(text)  # beyond float range this is +-inf, never an error
        if isinstance(node, str):
            return node if node.isascii() else _SURROGATE.sub("\ufffd", node)
        if isinstance(node, dict):
            return {self.plain(k): self.plain(v) for k, v in node.items()}
        if isinstance(node, list):
            return [self.plain(v) for v in node]
        return node

    def canonical(self, node: Any) -> bytes:
        """The canonical JSON text of `node`, a part of `value` (or `value`)."""
        if self._is_marked:
            try:
                text = _FAST_ENCODER.encode(node)
            except RecursionError:
                raise CanonicalJSONError("invalid JSON: nesting too deep") from None
            if _MARKED_OPEN in text:
                if _SPOOFED_MARK in text:
                    return _slow_dump_marked(node)
                text = text.replace(_MARKED_OPEN, "").replace(_MARKED_CLOSE, "")
            text = _go_escape(text)
            try:
                return text.encode("utf-8")
            except UnicodeEncodeError:
                # An unpaired surrogate (`parse_document` sends those texts down
                # the slow path; a hand-built tree may still hold one): U+FFFD,
                # and keys must be re-merged and re-sorted, which the slow path does.
                pass
            return _slow_dump_marked(node)
        return _slow_dump(node)


def _unmark(node: Any) -> Any:
    """Fast-path tree to slow-path tree (markers to `Number`, lone surrogates
    cleaned and keys re-merged)."""
    if isinstance(node, str):
        if node[:1] == _MARK:
            return Number(node[1:-1])
        return node
    if isinstance(node, dict):
        return _clean_pairs([(k, _unmark(v)) for k, v in node.items()])
    if isinstance(node, list):
        return [_unmark(v) for v in node]
    return node


def _slow_dump_marked(node: Any) -> bytes:
    try:
        tree = _unmark(node)
    except RecursionError:
        raise CanonicalJSONError("invalid JSON: nesting too deep") from None
    return _slow_dump(tree)


def _has_unpaired_surrogate(text: str) -> bool:
    """Whether a JSON text has a `\\u` escape of an unpaired surrogate.

    Such a string becomes U+FFFD, and two keys may then collide; only the slow
    decoder still sees the pairs in document order, so it must merge them.
    """
    if "\\ud" not in text and "\\uD" not in text:
        return False
    return any(m.group(1) for m in _SURROGATE_ESCAPES.finditer(text))


def _slow_dump(node: Any) -> bytes:
    parts: list[str] = []
    try:
        _slow_write(node, parts)
    except RecursionError:
        raise CanonicalJSONError("invalid JSON: nesting too deep") from None
    return "".join(parts).encode("utf-8")


def _slow_string(text: str) -> str:
    return _go_escape(_STRING_ENCODER.encode(_SURROGATE.sub("\ufffd", text)))


def _slow_write(node: Any, parts: list[str]) -> None:
    if isinstance(node, Number):
        parts.append(node.text)
    elif isinstance(node, str):
        parts.append(_slow_string(node))
    elif node is None:
        parts.append("null")
    elif node is True:
        parts.append("true")
    elif node is False:
        parts.append("false")
    elif isinstance(node, list):
        parts.append("[")
        for i, item in enumerate(node):
            if i:
                parts.append(",")
            _slow_write(item, parts)
        parts.append("]")
    elif isinstance(node, dict):
        parts.append("{")
        # Go's sort.Strings compares UTF-8 bytes.
        for i, key in enumerate(sorted(node, key=lambda k: k.encode("utf-8"))):
            if i:
                parts.append(",")
            parts.append(_slow_string(key))
            parts.append(":")
            _slow_write(node[key], parts)
        parts.append("}")
    else:  # pragma: no cover - only parser output reaches here
        raise TypeError(f"not a JSON node: {type(node).__name__}")


def parse_document(data: bytes) -> Document:
    """Parse one JSON text exactly (numbers kept as written).

    Args:
        data: the raw bytes. Empty input is the JSON `null` (PROTOCOL.md §1.1).

    Returns:
        A `Document` over the parsed tree.

    Raises:
        CanonicalJSONError: invalid JSON, `NaN`/`Infinity`, trailing data,
            nesting deeper than the interpreter allows.
    """
    if not data:
        return Document(None, is_marked=True)
    text = _decode_utf8(data)
    if "\\u0000" in text or _has_unpaired_surrogate(text):
        return Document(_parse(text, _SLOW_DECODER), is_marked=False)
    return Document(_parse(text, _FAST_DECODER), is_marked=True)


def canonical_json(data: bytes) -> bytes:
    """Rebuno's canonical form of a JSON text (PROTOCOL.md §1.1).

    Args:
        data: the raw JSON bytes as they arrived (UTF-8). Empty input means
            "no value" and canonicalises to `null`.

    Returns:
        The canonical UTF-8 bytes.

    Raises:
        CanonicalJSONError: a `ValueError` naming what is wrong: invalid JSON
            (with line and column), `NaN`/`Infinity`, trailing data, or nesting
            too deep.
    """
    if not data:
        return _NULL
    doc = parse_document(data)
    return doc.canonical(doc.value)

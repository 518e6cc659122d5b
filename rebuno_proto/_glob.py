"""Target globs for policy rules, matched in linear time.

`*` (any run, `/` included), `?` (one character), `[...]` sets with ranges,
negated by `!` or `^`, and `\\` to escape the next character. The matcher is
iterative with one backtrack point, so no pattern can take super-linear time
(unlike a regex translation); `glob_error` says why a pattern is malformed,
which the bundle loader reports.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

__all__ = ["glob_error", "glob_match"]


@dataclass(frozen=True, slots=True)
class _Class:
    """A `[...]` set: ranges of characters, maybe negated."""

    is_negated: bool
    ranges: tuple[tuple[str, str], ...]

    def has(self, char: str) -> bool:
        inside = any(lo <= char <= hi for lo, hi in self.ranges)
        return inside is not self.is_negated


class _Wild(enum.Enum):
    STAR = "*"
    ANY = "?"


_Token = str | _Wild | _Class


def glob_match(pattern: str, text: str) -> bool:
    """Whether `text` matches the glob `pattern`, in time linear in `text`
    for a given pattern (at most len(pattern) x len(text) steps, never more).

    `*` matches any run of characters (including `/`), `?` any one character,
    `[abc]`, `[a-z]` one of a set, `[!a]` or `[^a]` one character not in it;
    `\\` makes the next character literal. A `[` with no closing `]` is a
    literal `[` (`glob_error` reports it when a bundle is loaded).

    Args:
        pattern: the glob.
        text: the text to test, such as a step target.

    Returns:
        True if the whole of `text` matches.
    """
    tokens = _tokens(pattern)
    p = t = 0
    star = -1  # the token index just after the last `*` seen
    resume = 0  # where in `text` that `*` would next resume
    n_tokens, n_text = len(tokens), len(text)
    # Greedy two-pointer walk: on a mismatch, let the last `*` absorb one more
    # character and retry from there. Earlier stars never need revisiting, so
    # there is no exponential backtracking.
    while t < n_text:
        if p < n_tokens:
            token = tokens[p]
            if token is _Wild.STAR:
                p += 1
                star, resume = p, t
                continue
            if _one(token, text[t]):
                p += 1
                t += 1
                continue
        if star < 0:
            return False
        resume += 1
        p, t = star, resume
    while p < n_tokens and tokens[p] is _Wild.STAR:
        p += 1
    return p == n_tokens


def _one(token: _Token, char: str) -> bool:
    if token is _Wild.ANY:
        return True
    if isinstance(token, str):
        return token == char
    return isinstance(token, _Class) and token.has(char)


def glob_error(pattern: str) -> str | None:
    """What is wrong with a glob, or `None` if it is well formed.

    Args:
        pattern: the glob.

    Returns:
        A short description (an unterminated `[`, a trailing `\\`), or `None`.
    """
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            if i + 1 == n:
                return "trailing backslash"
            i += 2
        elif char == "[":
            parsed = _parse_class(pattern, i + 1)
            if parsed is None:
                return f"unterminated character class at offset {i}"
            i = parsed[1]
        else:
            i += 1
    return None


@functools.lru_cache(maxsize=1024)
def _tokens(pattern: str) -> tuple[_Token, ...]:
    out: list[_Token] = []
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "*":
            if not out or out[-1] is not _Wild.STAR:  # `**` is `*`
                out.append(_Wild.STAR)
            i += 1
        elif char == "?":
            out.append(_Wild.ANY)
            i += 1
        elif char == "\\" and i + 1 < n:
            out.append(pattern[i + 1])
            i += 2
        elif char == "[" and (parsed := _parse_class(pattern, i + 1)) is not None:
            out.append(parsed[0])
            i = parsed[1]
        else:
            out.append(char)
            i += 1
    return tuple(out)


def _parse_class(pattern: str, start: int) -> tuple[_Class, int] | None:
    """Parse a class whose `[` is just before `start`: the class and the index
    after its `]`, or `None` if it never closes. A `]` first in the set is literal."""
    i, n = start, len(pattern)
    is_negated = i < n and pattern[i] in "!^"
    if is_negated:
        i += 1
    first = i
    ranges: list[tuple[str, str]] = []
    while i < n:
        if pattern[i] == "]" and i > first:
            return _Class(is_negated, tuple(ranges)), i + 1
        lo, i = _class_char(pattern, i)
        hi = lo
        if i + 1 < n and pattern[i] == "-" and pattern[i + 1] != "]":
            hi, i = _class_char(pattern, i + 1)
        ranges.append((lo, hi))
    return None


def _class_char(pattern: str, i: int) -> tuple[str, int]:
    if pattern[i] == "\\" and i + 1 < len(pattern):
        return pattern[i + 1], i + 2
    return pattern[i], i + 1

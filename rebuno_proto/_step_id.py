"""Step identity (PROTOCOL.md §1.2): `args_hash`, `step_id`, and the UUID
spelling the preimage uses.

The kernel derives every step id from content; the agent computes nothing.
"""

from __future__ import annotations

import hashlib
from typing import Final

from ._canonical import canonical_json

__all__ = ["NULL_ARGS_HASH", "args_hash", "canonical_uuid", "step_id"]

_HEX: Final = frozenset("0123456789abcdef")
_DASHES: Final = (8, 13, 18, 23)

#: `args_hash` of absent or `null` arguments (PROTOCOL.md §1.2).
NULL_ARGS_HASH: Final = "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b"


def args_hash(data: bytes) -> str:
    """Lowercase hex SHA-256 of the canonical form of a JSON text.

    Args:
        data: raw JSON bytes of the arguments; empty means absent (`null`).

    Raises:
        CanonicalJSONError: the bytes are not valid JSON.
    """
    return hashlib.sha256(canonical_json(data)).hexdigest()


def step_id(execution_id: str, kind: str, target: str, args_hash: str, occurrence: int) -> str:
    """The content-derived id of a step (PROTOCOL.md §1.2).

    Each field is written as its UTF-8 byte length in decimal, a colon, then its
    bytes, with no separator between fields; the id is the SHA-256 of that.

    Args:
        execution_id: the canonical lowercase hyphenated UUID of the execution.
        kind: `tool_call`, `llm_call` or `local`, exactly as submitted.
        target: tool id, model id or local step name, exactly as submitted.
        args_hash: `args_hash(...)` of the submitted arguments.
        occurrence: how many identical (kind, target, args_hash) effects came
            before this one in the dispatch attempt (0, 1, ...).

    Raises:
        ValueError: `occurrence` is negative.
    """
    if occurrence < 0:
        raise ValueError(f"occurrence must be >= 0, got {occurrence}")
    digest = hashlib.sha256()
    for field in (execution_id, kind, target, args_hash, str(occurrence)):
        raw = field.encode("utf-8")
        digest.update(b"%d:" % len(raw))
        digest.update(raw)
    return digest.hexdigest()


def canonical_uuid(text: str) -> str | None:
    """The lowercase hyphenated spelling of a UUID, or `None` if `text` is not one.

    Accepts the spellings Go's `uuid.Parse` does: `xxxxxxxx-xxxx-xxxx-xxxx-
    xxxxxxxxxxxx` in either case, the same in braces or after `urn:uuid:`, and
    32 bare hex digits. The step-id preimage always uses the canonical form.
    """
    if len(text) == 45 and text[:9].lower() == "urn:uuid:":
        text = text[9:]
    elif len(text) == 38 and text[0] == "{" and text[-1] == "}":
        text = text[1:-1]
    lowered = text.lower()
    if len(lowered) == 36:
        if any(lowered[i] != "-" for i in _DASHES):
            return None
        digits = lowered.replace("-", "")
    elif len(lowered) == 32:
        digits = lowered
    else:
        return None
    if len(digits) != 32 or not _HEX.issuperset(digits):
        return None
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"

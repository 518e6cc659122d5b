"""Step identity against the shared golden vectors and PROTOCOL.md §1.2."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebuno_proto import NULL_ARGS_HASH, args_hash, canonical_json, canonical_uuid, step_id

VECTORS = json.loads((Path(__file__).parent / "identity_vectors.json").read_text("utf-8"))

EXAMPLE_EXECUTION = "0192f1a0-0000-7000-8000-000000000000"
EXAMPLE_ARGS = b'{"q": "<b>\\u2028", "n": 1.50, "a": [true, null]}'
EXAMPLE_CANONICAL = b'{"a":[true,null],"n":1.50,"q":"\\u003cb\\u003e\\u2028"}'
EXAMPLE_HASH = "da64883585660b96c167ecfad97cba6078a4f449d669d03edb3d4cc998c6685f"


def test_vector_file_has_twelve_cases() -> None:
    assert len(VECTORS) == 12
    assert {v["target"] for v in VECTORS} == {f"tool_{i}" for i in range(12)}


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["target"])
def test_vector_canonical_bytes(vector: dict[str, object]) -> None:
    raw = json.dumps(vector["args"]).encode("utf-8")
    assert canonical_json(raw) == str(vector["canonical"]).encode("utf-8")


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["target"])
def test_vector_args_hash(vector: dict[str, object]) -> None:
    raw = json.dumps(vector["args"]).encode("utf-8")
    assert args_hash(raw) == vector["args_hash"]


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["target"])
def test_vector_step_id(vector: dict[str, object]) -> None:
    assert (
        step_id(
            str(vector["execution_id"]),
            str(vector["kind"]),
            str(vector["target"]),
            str(vector["args_hash"]),
            int(str(vector["occurrence"])),
        )
        == vector["step_id"]
    )


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["target"])
def test_vector_survives_other_spellings(vector: dict[str, object]) -> None:
    """The SDK sends ensure_ascii bodies; compact and non-ASCII spellings hash alike."""
    for raw in (
        json.dumps(vector["args"], ensure_ascii=False).encode("utf-8"),
        json.dumps(vector["args"], separators=(",", ":")).encode("utf-8"),
        json.dumps(vector["args"], indent=3).encode("utf-8"),
    ):
        assert args_hash(raw) == vector["args_hash"]


def test_worked_example_canonical() -> None:
    assert canonical_json(EXAMPLE_ARGS) == EXAMPLE_CANONICAL


def test_worked_example_args_hash() -> None:
    assert args_hash(EXAMPLE_ARGS) == EXAMPLE_HASH


def test_worked_example_step_ids() -> None:
    assert (
        step_id(EXAMPLE_EXECUTION, "tool_call", "search", EXAMPLE_HASH, 0)
        == "c9c4a4ca399606682649d8183c2f125b8ae915407a0f2a6bb874f933304988ef"
    )
    assert (
        step_id(EXAMPLE_EXECUTION, "tool_call", "search", EXAMPLE_HASH, 1)
        == "3c68efdf241e55fd4dd3478345faa01728f5fcfd836c5f799dc84af4ca05ee95"
    )


def test_worked_example_preimage() -> None:
    """The documented preimage hashes to the documented id."""
    import hashlib

    preimage = f"36:{EXAMPLE_EXECUTION}9:tool_call6:search64:{EXAMPLE_HASH}1:0".encode()
    assert hashlib.sha256(preimage).hexdigest() == step_id(
        EXAMPLE_EXECUTION, "tool_call", "search", EXAMPLE_HASH, 0
    )


def test_null_and_absent_args_hash() -> None:
    expected = "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b"
    assert expected == NULL_ARGS_HASH
    assert args_hash(b"") == expected
    assert args_hash(b"null") == expected
    assert args_hash(b"  null\n") == expected


def test_empty_object_is_not_null() -> None:
    assert args_hash(b"{}") != NULL_ARGS_HASH


def test_step_id_lengths_are_utf8_bytes() -> None:
    """A two-byte character counts twice in the length prefix."""
    import hashlib

    expected = hashlib.sha256(b"1:e9:tool_call2:\xc3\xa91:h1:0").hexdigest()
    assert step_id("e", "tool_call", "\u00e9", "h", 0) == expected


def test_step_id_fields_are_not_ambiguous() -> None:
    """Moving characters between fields changes the id (length prefixes)."""
    assert step_id("e", "ab", "c", "h", 0) != step_id("e", "a", "bc", "h", 0)


def test_step_id_multi_digit_occurrence() -> None:
    import hashlib

    assert step_id("e", "k", "t", "h", 12) == hashlib.sha256(b"1:e1:k1:t1:h2:12").hexdigest()


def test_step_id_rejects_negative_occurrence() -> None:
    with pytest.raises(ValueError, match="occurrence must be >= 0"):
        step_id("e", "k", "t", "h", -1)


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=10_000))
def test_step_id_differs_exactly_when_occurrence_differs(a: int, b: int) -> None:
    first = step_id(EXAMPLE_EXECUTION, "tool_call", "search", EXAMPLE_HASH, a)
    second = step_id(EXAMPLE_EXECUTION, "tool_call", "search", EXAMPLE_HASH, b)
    assert (first == second) == (a == b)
    assert len(first) == 64
    assert first == first.lower()


@pytest.mark.parametrize(
    "spelling",
    [
        "0192F1A0-0000-7000-8000-00000000ABCD",
        "{0192f1a0-0000-7000-8000-00000000abcd}",
        "urn:uuid:0192f1a0-0000-7000-8000-00000000abcd",
        "URN:UUID:0192f1a0-0000-7000-8000-00000000abcd",
        "0192f1a0000070008000" + "00000000abcd",
        "0192f1a0-0000-7000-8000-00000000abcd",
    ],
)
def test_canonical_uuid_spellings(spelling: str) -> None:
    assert canonical_uuid(spelling) == "0192f1a0-0000-7000-8000-00000000abcd"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not-a-uuid",
        "0192f1a0-0000-7000-8000-00000000abcg",
        "0192f1a0_0000_7000_8000_00000000abcd",
        "0192f1a00-000-7000-8000-00000000abcd",
        "{0192f1a0-0000-7000-8000-00000000abcd",
        "0192f1a0000070008000" + "00000000abc",
        "0192f1a0-0000-7000-8000-00000000abcd0",
        "0192f1a0-0000-7000-8000-0000000-abcd",
    ],
)
def test_canonical_uuid_rejects(text: str) -> None:
    assert canonical_uuid(text) is None


@given(st.uuids())
def test_canonical_uuid_matches_stdlib(value: object) -> None:
    import uuid

    assert isinstance(value, uuid.UUID)
    for spelling in (str(value).upper(), value.hex, f"{{{value}}}", value.urn):
        assert canonical_uuid(spelling) == str(value)

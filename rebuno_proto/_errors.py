"""The core's exception types, after h11.

`ProtocolError` is the base. `LocalProtocolError` means our own caller did
something the protocol does not allow (an event out of order, a transition that
is not in a table). `RemoteProtocolError` means the peer sent something invalid:
a message that does not parse, a bad signature, an unknown decision.

Kernel *decisions* (`replay`, `denied`, `blocked`...) are data, never exceptions.
"""

from __future__ import annotations

__all__ = [
    "CanonicalJSONError",
    "LocalProtocolError",
    "MessageError",
    "ProtocolError",
    "RemoteProtocolError",
]


class ProtocolError(Exception):
    """Base class of every error the protocol core raises on purpose."""


class LocalProtocolError(ProtocolError):
    """Our caller broke the protocol: for example a (state, event) pair that no
    transition table allows."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol: malformed message, bad signature, unknown value."""


class CanonicalJSONError(RemoteProtocolError, ValueError):
    """A JSON text that has no canonical form: invalid JSON, `NaN`, `Infinity`,
    trailing data or nesting too deep. The message says what is wrong."""


class MessageError(RemoteProtocolError, ValueError):
    """A wire message that does not parse or has a field of the wrong shape.

    Attributes:
        field: dotted path of the offending field (`""` for the whole message).
        problem: what is wrong with it, in words.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}" if field else problem)

"""rebuno_anyio: durable agents and the kernel, on asyncio or trio.

The agent SDK (`Agent`, `tool`, `wrap_tool`, `step`, `http_client`, `Result`,
`previous`, `execution`, `raise_for_refusal`, the error classes) and `Client`,
with the names and defaults of the published Rebuno SDK (`REBUNO_URL`,
`REBUNO_AGENT_SECRET`, `REBUNO_API_KEY`). The kernel lives in
`rebuno_anyio.kernel`; the `rebuno` command in `rebuno_anyio.cli`.
"""

from . import types
from ._client import Client
from .agent import (
    Agent,
    ExecutionContext,
    RebunoTransport,
    Result,
    execution,
    http_client,
    previous,
    step,
    tool,
    wrap_tool,
)
from .errors import (
    APIError,
    Blocked,
    ConflictError,
    ForbiddenError,
    KernelUnreachable,
    LeaseSuperseded,
    NetworkError,
    NotFoundError,
    PolicyError,
    RateLimited,
    RebunoError,
    Terminated,
    ToolError,
    UnauthorizedError,
    ValidationError,
    failure_reason,
    raise_for_refusal,
)

__all__ = [
    "APIError",
    "Agent",
    "Blocked",
    "Client",
    "ConflictError",
    "ExecutionContext",
    "ForbiddenError",
    "KernelUnreachable",
    "LeaseSuperseded",
    "NetworkError",
    "NotFoundError",
    "PolicyError",
    "RateLimited",
    "RebunoError",
    "RebunoTransport",
    "Result",
    "Terminated",
    "ToolError",
    "UnauthorizedError",
    "ValidationError",
    "execution",
    "failure_reason",
    "http_client",
    "previous",
    "raise_for_refusal",
    "step",
    "tool",
    "types",
    "wrap_tool",
]

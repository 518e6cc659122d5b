"""The agent SDK: `Agent`, the recording primitives and the execution context."""

from ._agent import Agent
from ._context import ExecutionContext, Result, execution, previous
from ._kernel_client import KernelClient
from ._llm import RebunoTransport, http_client
from ._tools import step, tool, wrap_tool

__all__ = [
    "Agent",
    "ExecutionContext",
    "KernelClient",
    "RebunoTransport",
    "Result",
    "execution",
    "http_client",
    "previous",
    "step",
    "tool",
    "wrap_tool",
]

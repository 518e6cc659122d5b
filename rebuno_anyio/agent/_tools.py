"""Recording primitives for tools and local work: `@tool`, `wrap_tool`, `step`.

Each call becomes a durable step: its arguments go to the kernel, which decides
(PROTOCOL.md §5.2). On `proceed` the body runs and its result is recorded; on
`replay` the recorded result comes back and the body never runs. A tool turns a
policy denial into the refusal string the published SDK returns, so a model can
read it; `step()` lets `PolicyError` propagate.

`resources=` is accepted everywhere the published SDK takes it, so ported code
runs, and ignored: this runtime records no resource snapshots or checkpoints
(see docs/tools.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

from ..errors import PolicyError
from ._context import current, offload

__all__ = ["Idempotency", "step", "tool", "wrap_tool"]

Idempotency = Literal["safe_to_retry", "at_most_once"]
F = TypeVar("F", bound=Callable[..., Any])
_IDEMPOTENCY = ("safe_to_retry", "at_most_once")


def _check_idempotency(idempotency: str) -> None:
    if idempotency not in _IDEMPOTENCY:
        raise ValueError(
            f"idempotency must be 'safe_to_retry' or 'at_most_once', got {idempotency!r}"
        )


def _refusal(tool_id: str, err: PolicyError) -> str:
    return f"{tool_id} not allowed. reason: {err}"


def _context(what: str) -> Any:
    ctx = current()
    if ctx is None:
        raise RuntimeError(
            f"{what} called outside an execution: tools and steps record durably only "
            "inside a handler run by Agent (agent.run(), agent.app)"
        )
    return ctx


def _wrap(fn: Callable[..., Any], tool_id: str, idempotency: str) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = _context(f"tool {tool_id!r}")
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        recorded = dict(bound.arguments)
        try:
            return await ctx.invoke(
                kind="tool_call",
                target=tool_id,
                args=recorded,
                idempotency=idempotency,
                run=lambda: offload(fn, *bound.args, **bound.kwargs),
            )
        except PolicyError as err:
            return _refusal(tool_id, err)

    wrapper.__idempotency__ = idempotency  # type: ignore[attr-defined]
    wrapper.__rebuno_tool_id__ = tool_id  # type: ignore[attr-defined]
    return wrapper


@overload
def tool(name: F, /) -> F: ...
@overload
def tool(
    name: str | None = None,
    /,
    *,
    idempotency: Idempotency = "safe_to_retry",
    resources: list[str] | None = None,
) -> Callable[[F], F]: ...


def tool(
    name: Any = None,
    /,
    *,
    idempotency: Idempotency = "safe_to_retry",
    resources: list[str] | None = None,
) -> Any:
    """Make a function a durable tool: `@tool`, `@tool()`, `@tool("id")` or
    `@tool("id", idempotency="at_most_once")`.

    The tool id defaults to the function's name. Its bound arguments (defaults
    included) are the recorded arguments, so they must be JSON-serializable. A
    synchronous function runs in a worker thread. `at_most_once` marks a body
    that must not run twice: if a crash leaves its outcome unknown, the next
    attempt gets `ToolError` ("outcome unknown") instead of running it again.
    `resources` is accepted for code written against the published SDK, and
    ignored (resources and checkpoints are not supported).
    """
    _check_idempotency(idempotency)
    if callable(name):
        return _wrap(name, name.__name__, idempotency)

    def decorate(fn: F) -> F:
        return _wrap(fn, name or fn.__name__, idempotency)  # type: ignore[return-value]

    return decorate


def wrap_tool(
    name: str,
    invoke: Callable[[dict[str, Any]], Any],
    *,
    description: str = "",
    args_schema: dict[str, Any] | None = None,
    idempotency: Idempotency = "safe_to_retry",
    to_result: Callable[[Any], Any] | None = None,
    transform_args: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    resources: list[str] | None = None,
) -> Callable[..., Any]:
    """Route a tool that is not a plain function (a framework tool object, an
    MCP tool) through the kernel.

    Args:
        name: the tool id the kernel and the model see.
        invoke: `invoke(args)` does the work (sync or async).
        description: becomes the callable's docstring.
        args_schema: JSON Schema of the arguments; its properties become the
            callable's keyword-only signature, for frameworks that introspect.
        idempotency: `safe_to_retry` or `at_most_once`.
        to_result: maps `invoke`'s return value to what is recorded.
        transform_args: maps the caller's keyword arguments before they are
            recorded and passed to `invoke`.
        resources: accepted for code written against the published SDK, and
            ignored (resources and checkpoints are not supported).
    """
    _check_idempotency(idempotency)
    schema = args_schema or {}

    async def wrapper(**kwargs: Any) -> Any:
        ctx = _context(f"tool {name!r}")
        args = transform_args(kwargs) if transform_args is not None else dict(kwargs)

        async def run() -> Any:
            result = await offload(invoke, args)
            return to_result(result) if to_result is not None else result

        try:
            return await ctx.invoke(
                kind="tool_call", target=name, args=args, idempotency=idempotency, run=run
            )
        except PolicyError as err:
            return _refusal(name, err)

    properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
    required = set(schema.get("required", [])) if isinstance(schema, dict) else set()
    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = description or None
    wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                key,
                inspect.Parameter.KEYWORD_ONLY,
                default=inspect.Parameter.empty if key in required else None,
            )
            for key in properties
        ]
    )
    wrapper.__input_schema__ = schema  # type: ignore[attr-defined]
    wrapper.__idempotency__ = idempotency  # type: ignore[attr-defined]
    return wrapper


async def step(
    name: str,
    fn: Callable[..., Any],
    args: dict[str, Any] | None = None,
    *,
    idempotency: Idempotency = "safe_to_retry",
    resources: list[str] | None = None,
) -> Any:
    """Record non-deterministic local work (the clock, random choices, new ids)
    as a durable `local` step named `name`, so a replay sees the same value.

    `fn(**args)` runs only the first time; `args` (default `{}`) also identify
    the step. A policy denial raises `PolicyError`. `resources` is accepted for
    code written against the published SDK, and ignored.
    """
    _check_idempotency(idempotency)
    ctx = _context(f"step({name!r})")
    payload = args or {}
    return await ctx.invoke(
        kind="local",
        target=name,
        args=payload,
        idempotency=idempotency,
        run=lambda: offload(fn, **payload),
    )

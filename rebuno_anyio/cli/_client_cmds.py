"""Client verbs of the `rebuno` command: exec, agents, approvals, policy.

Each talks HTTP to the kernel through `Client`. People get rich tables;
`--json` prints JSON for scripts. Ids may be given as unambiguous prefixes.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import anyio
import click
import httpx
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from rebuno_proto import canonical_uuid

from .._client import Client
from ..errors import NetworkError, RebunoError, Terminated
from ..types import Approval, Event, Execution

__all__ = ["agents", "approvals", "execs", "policy"]

T = TypeVar("T")
_TERMINAL = ("completed", "failed", "cancelled")
_MAX_APPROVALS = 1000  # the most the kernel lists at once
_STATUS_STYLE = {
    "completed": "green",
    "failed": "red",
    "cancelled": "yellow",
    "blocked": "magenta",
    "running": "cyan",
    "pending": "white",
    "granted": "green",
    "denied": "red",
    "expired": "yellow",
}


def _kernel_url(ctx: click.Context | None, param: click.Parameter | None, value: str) -> str:
    """`--url`: a URL httpx can send to (`http://[::1` is not)."""
    try:
        url = httpx.URL(value)
        scheme, host = url.scheme, url.host
    except (httpx.InvalidURL, ValueError, TypeError) as err:  # IDNA errors are ValueErrors
        raise click.BadParameter(f"not a valid URL ({err}): {value!r}") from None
    if scheme not in ("http", "https") or not host:
        raise click.BadParameter(f"must be an http:// or https:// URL with a host, got {value!r}")
    return value


def _api_key(ctx: click.Context | None, param: click.Parameter | None, value: str) -> str:
    """`--api-key`: it travels in an HTTP header, so printable ASCII only."""
    bad = next((c for c in value if not (c.isascii() and c.isprintable())), None)
    if bad is not None:
        raise click.BadParameter(
            f"a bearer token must be printable ASCII (it is sent in a header), got {bad!r}"
        )
    return value


def _url_option(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        *names,
        envvar="REBUNO_URL",
        default="http://127.0.0.1:8080",
        show_default=True,
        callback=_kernel_url,
        help="Kernel URL. Env: REBUNO_URL.",
    )


def _api_key_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--api-key",
        envvar="REBUNO_API_KEY",
        default="",
        callback=_api_key,
        help="Bearer token. Env: REBUNO_API_KEY.",
    )(fn)


def _client_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(fn)
    fn = _api_key_option(fn)
    fn = _url_option("--url")(fn)
    return fn


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _json_argument(text: str) -> Any:
    """Parse a JSON argument as the kernel would: no NaN/Infinity, no numbers
    that overflow to infinity (`1e999999`), no nesting past the interpreter's
    limit."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise click.BadParameter("not valid JSON: nested too deeply", param_hint="JSON") from None
    except ValueError as err:
        raise click.BadParameter(f"not valid JSON: {err}", param_hint="JSON") from None


def _run(url: str, api_key: str, work: Callable[[Client], Awaitable[T]]) -> T:
    async def main() -> T:
        async with Client(url, api_key) as client:
            return await work(client)

    try:
        return anyio.run(main)
    except NetworkError as err:
        raise click.ClickException(f"cannot reach the kernel at {url}: {err}") from None
    except Terminated as err:
        raise click.ClickException(f"execution is already terminal: {err}") from None
    except RebunoError as err:
        raise click.ClickException(str(err)) from None
    except httpx.InvalidURL as err:  # the options are checked; this is a last resort
        raise click.ClickException(f"invalid kernel URL {url!r}: {err}") from None
    except RecursionError:
        raise click.ClickException("the request is nested too deeply to send") from None


def _console() -> Console:
    return Console(soft_wrap=False, highlight=False)


def _print_json(value: Any) -> None:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def _styled(status: str) -> str:
    style = _STATUS_STYLE.get(status, "white")
    return f"[{style}]{status}[/{style}]"


def _compact(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _table(title: str, columns: Iterable[str], rows: Iterable[Iterable[str]]) -> None:
    table = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    count = 0
    for row in rows:
        table.add_row(*row)
        count += 1
    if count:
        _console().print(table)
    else:
        click.echo(f"{title}: none")


def _details(pairs: Iterable[tuple[str, str]]) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in pairs:
        table.add_row(key, value)
    _console().print(table)


async def _resolve_execution(client: Client, ref: str) -> str:
    full = canonical_uuid(ref)
    if full is not None:
        return full
    matches: list[str] = []
    cursor = ""
    for _ in range(10):  # the newest 2,000 executions
        page = await client.list(limit=200, cursor=cursor)
        matches += [e.id for e in page.executions if e.id.startswith(ref.lower())]
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    return _one(ref, matches, "execution")


async def _resolve_approval(client: Client, ref: str) -> str:
    full = canonical_uuid(ref)
    if full is not None:
        return full
    # The kernel lists the oldest first: in a long-lived kernel a new approval
    # is not on the first page of all of them, so look among the pending ones
    # (the ones people decide) as well.
    matches: dict[str, None] = {}
    for status in ("pending", "all"):
        for a in await client.list_approvals(status=status, limit=_MAX_APPROVALS):
            if a.id.startswith(ref.lower()):
                matches[a.id] = None
    return _one(ref, list(matches), "approval")


def _one(ref: str, matches: list[str], what: str) -> str:
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise click.ClickException(f"no {what} id starts with {ref!r}")
    raise click.ClickException(
        f"{ref!r} is ambiguous: it starts {len(matches)} {what} ids ({', '.join(matches[:5])}...)"
    )


def _show_execution(execution: Execution) -> None:
    pairs = [
        ("id", execution.id),
        ("agent", execution.agent_id),
        ("status", _styled(execution.status)),
        ("input", _compact(execution.input, 200)),
    ]
    if execution.status == "completed":
        pairs.append(("output", _compact(execution.output, 400)))
    if execution.failure_reason:
        pairs.append(("failure", execution.failure_reason))
    if execution.session:
        pairs.append(("session", execution.session))
    if execution.parent_execution_id:
        pairs.append(("continues", execution.parent_execution_id))
    pairs += [("created", execution.created_at), ("updated", execution.updated_at)]
    _details(pairs)


def _event_row(event: Event) -> list[str]:
    payload = event.payload if isinstance(event.payload, dict) else {}
    detail = {k: v for k, v in payload.items() if k not in ("execution_id", "step_type", "status")}
    return [str(event.event_seq), event.occurred_at, event.type, _compact(detail, 90)]


# -- exec ---------------------------------------------------------------------------


@click.group("exec")
def execs() -> None:
    """Create, inspect, follow and cancel executions."""


@execs.command("create")
@click.argument("agent")
@click.argument("input_json", metavar="[JSON]", required=False)
@click.option(
    "--session", default="", help="Continue the agent's last completed execution in this session."
)
@click.option(
    "--idempotency-key", default="", help="A repeat with the same key returns the first execution."
)
@click.option("--wait", "wait", is_flag=True, help="Wait until it ends and show the result.")
@_client_options
def exec_create(
    agent: str,
    input_json: str | None,
    session: str,
    idempotency_key: str,
    wait: bool,
    url: str,
    api_key: str,
    as_json: bool,
) -> None:
    """Start an execution of AGENT with an optional JSON input."""
    value: Any = None if input_json is None else _json_argument(input_json)

    async def work(client: Client) -> Execution:
        created = await client.create(
            agent, value, session=session, idempotency_key=idempotency_key
        )
        return await client.wait(created.id) if wait else created

    execution = _run(url, api_key, work)
    if as_json:
        _print_json(execution)
    else:
        _show_execution(execution)
    if wait and execution.status != "completed":
        sys.exit(1)


@execs.command("get")
@click.argument("execution_id")
@_client_options
def exec_get(execution_id: str, url: str, api_key: str, as_json: bool) -> None:
    """Show one execution (an unambiguous id prefix is enough)."""

    async def work(client: Client) -> Execution:
        return await client.get(await _resolve_execution(client, execution_id))

    execution = _run(url, api_key, work)
    _print_json(execution) if as_json else _show_execution(execution)


@execs.command("list")
@click.option("--agent", default="", help="Only this agent's executions.")
@click.option(
    "--status", default="", type=click.Choice(["", *("pending", "running", "blocked"), *_TERMINAL])
)
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 200))
@_client_options
def exec_list(agent: str, status: str, limit: int, url: str, api_key: str, as_json: bool) -> None:
    """List executions, newest first."""
    page = _run(url, api_key, lambda c: c.list(agent_id=agent, status=status, limit=limit))
    if as_json:
        _print_json(page)
        return
    _table(
        "executions",
        ["id", "agent", "status", "created", "failure"],
        (
            [e.id, e.agent_id, _styled(e.status), e.created_at, e.failure_reason]
            for e in page.executions
        ),
    )


@execs.command("events")
@click.argument("execution_id")
@click.option(
    "--after", default=0, show_default=True, help="Only events after this sequence number."
)
@_client_options
def exec_events(execution_id: str, after: int, url: str, api_key: str, as_json: bool) -> None:
    """Show an execution's event log."""

    async def work(client: Client) -> list[Event]:
        resolved = await _resolve_execution(client, execution_id)
        found: list[Event] = []
        cursor = after
        while True:
            page = await client.events(resolved, after_seq=cursor, limit=1000)
            found += page
            if len(page) < 1000:
                return found
            cursor = page[-1].event_seq

    events = _run(url, api_key, work)
    if as_json:
        _print_json(events)
        return
    _table("events", ["seq", "at", "type", "detail"], (_event_row(e) for e in events))


@execs.command("watch")
@click.argument("execution_id")
@_client_options
def exec_watch(execution_id: str, url: str, api_key: str, as_json: bool) -> None:
    """Follow an execution's events until it ends (exit 0 if it completed)."""

    async def work(client: Client) -> Execution:
        resolved = await _resolve_execution(client, execution_id)
        after = 0
        while True:
            # The status first: once it is terminal, the events read next include
            # the last ones (read the other way round, the final events could be
            # committed between the two reads and never printed).
            execution = await client.get(resolved)
            done = execution.is_terminal
            page = await client.events(
                resolved, after_seq=after, limit=1000, wait=0 if done else 25
            )
            for event in page:
                after = event.event_seq
                if as_json:
                    click.echo(event.model_dump_json())
                else:
                    click.echo("  ".join(_event_row(event)))
            if done and len(page) < 1000:
                return execution

    execution = _run(url, api_key, work)
    if not as_json:
        click.echo(
            f"{execution.status}: "
            + _compact(
                execution.output if execution.status == "completed" else execution.failure_reason,
                400,
            )
        )
    if execution.status != "completed":
        sys.exit(1)


@execs.command("cancel")
@click.argument("execution_id")
@_client_options
def exec_cancel(execution_id: str, url: str, api_key: str, as_json: bool) -> None:
    """Cancel an execution."""

    async def work(client: Client) -> str:
        resolved = await _resolve_execution(client, execution_id)
        await client.cancel(resolved)
        return resolved

    resolved = _run(url, api_key, work)
    _print_json({"cancelled": resolved}) if as_json else click.echo(f"cancelled {resolved}")


# -- agents -------------------------------------------------------------------------


@click.group("agents")
def agents() -> None:
    """Register and inspect agents."""


@agents.command("list")
@_client_options
def agents_list(url: str, api_key: str, as_json: bool) -> None:
    """List registered agents."""
    found = _run(url, api_key, lambda c: c.list_agents())
    if as_json:
        _print_json(found)
        return
    _table(
        "agents",
        ["id", "webhook", "registered", "policy", "description"],
        (
            [
                a.id,
                a.webhook_url,
                a.registered_at,
                "yes" if a.has_policy else "-",
                a.description or "",
            ]
            for a in found
        ),
    )


@agents.command("register")
@click.argument("agent_id")
@click.option("--url", "webhook_url", required=True, help="The agent's webhook URL.")
@click.option("--secret", required=True, help="The shared secret the agent signs with.")
@_url_option("--kernel", "url")
@_api_key_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def agents_register(
    agent_id: str, webhook_url: str, secret: str, url: str, api_key: str, as_json: bool
) -> None:
    """Register (or update) an agent. Here --url is the agent's webhook; the
    kernel is --kernel / REBUNO_URL."""
    agent = _run(
        url, api_key, lambda c: c.register_agent(agent_id, webhook_url=webhook_url, secret=secret)
    )
    _print_json(agent) if as_json else click.echo(f"registered {agent.id} -> {agent.webhook_url}")


@agents.command("get")
@click.argument("agent_id")
@_client_options
def agents_get(agent_id: str, url: str, api_key: str, as_json: bool) -> None:
    """Show one agent (never its secret)."""
    agent = _run(url, api_key, lambda c: c.get_agent(agent_id))
    if as_json:
        _print_json(agent)
        return
    _details(
        [
            ("id", agent.id),
            ("webhook", agent.webhook_url),
            ("registered", agent.registered_at),
            ("description", agent.description or ""),
            ("policy", "yes" if agent.has_policy else "none (all steps allowed)"),
            ("input schema", _compact(agent.input_schema, 200)),
        ]
    )


@agents.command("delete")
@click.argument("agent_id")
@_client_options
def agents_delete(agent_id: str, url: str, api_key: str, as_json: bool) -> None:
    """Delete an agent registration."""
    _run(url, api_key, lambda c: c.delete_agent(agent_id))
    _print_json({"deleted": agent_id}) if as_json else click.echo(f"deleted {agent_id}")


# -- approvals ----------------------------------------------------------------------------


@click.group("approvals")
def approvals() -> None:
    """List and decide human approvals."""


def _approval_rows(found: list[Approval]) -> Iterable[list[str]]:
    for a in found:
        yield [
            a.id,
            a.execution_id,
            _styled(a.status),
            a.rule_id,
            a.message,
            a.timeout_at,
            a.decided_by,
        ]


@approvals.command("list")
@click.option(
    "--status",
    default="pending",
    show_default=True,
    type=click.Choice(["pending", "granted", "denied", "expired", "all"]),
)
@_client_options
def approvals_list(status: str, url: str, api_key: str, as_json: bool) -> None:
    """List approvals (pending ones by default)."""
    found = _run(url, api_key, lambda c: c.list_approvals(status=status, limit=_MAX_APPROVALS))
    if as_json:
        _print_json(found)
        return
    _table(
        f"approvals ({status})",
        ["id", "execution", "status", "rule", "message", "times out", "decided by"],
        _approval_rows(found),
    )


@approvals.command("get")
@click.argument("approval_id")
@_client_options
def approvals_get(approval_id: str, url: str, api_key: str, as_json: bool) -> None:
    """Show one approval and the step it holds."""

    async def work(client: Client) -> tuple[Approval, Any]:
        approval = await client.get_approval(await _resolve_approval(client, approval_id))
        step = await client.get_step(approval.execution_id, approval.step_id)
        return approval, step

    approval, step = _run(url, api_key, work)
    if as_json:
        _print_json(
            {"approval": approval.model_dump(mode="json"), "step": step.model_dump(mode="json")}
        )
        return
    _details(
        [
            ("id", approval.id),
            ("status", _styled(approval.status)),
            ("execution", approval.execution_id),
            ("step", f"{step.kind} {step.target} {_compact(step.args, 300)}"),
            ("rule", approval.rule_id),
            ("message", approval.message),
            ("approvers", ", ".join(approval.approvers) or "anyone"),
            ("times out", approval.timeout_at),
            ("decided by", approval.decided_by),
            ("rationale", approval.rationale),
        ]
    )


_BY_HELP = (
    "Who decides. With a named principal's token leave it out: "
    "the token names the decider, and another name is refused."
)


def _decide(verb: str) -> Callable[..., None]:
    @click.argument("approval_id")
    @click.option("--by", "decided_by", default="", help=_BY_HELP)
    @click.option(
        "--rationale",
        default="",
        help="Why; a denial's rationale becomes the step's denial reason.",
    )
    @_client_options
    def command(
        approval_id: str, decided_by: str, rationale: str, url: str, api_key: str, as_json: bool
    ) -> None:
        async def work(client: Client) -> str:
            resolved = await _resolve_approval(client, approval_id)
            method = client.grant_approval if verb == "grant" else client.deny_approval
            await method(resolved, decided_by=decided_by, rationale=rationale)
            return resolved

        resolved = _run(url, api_key, work)
        done = "granted" if verb == "grant" else "denied"
        _print_json({done: resolved}) if as_json else click.echo(f"{done} {resolved}")

    command.__doc__ = f"{verb.capitalize()} a pending approval (the execution resumes)."
    return functools.update_wrapper(command, command)


approvals.command("grant")(_decide("grant"))
approvals.command("deny")(_decide("deny"))


# -- policy ---------------------------------------------------------------------------------


@click.group("policy")
def policy() -> None:
    """Load and show agents' policy bundles."""


@policy.command("load")
@click.argument("agent_id")
@click.argument("file", type=click.File("r", encoding="utf-8"))
@_client_options
def policy_load(agent_id: str, file: Any, url: str, api_key: str, as_json: bool) -> None:
    """Replace AGENT_ID's policy with the YAML bundle in FILE (validated by the kernel)."""
    bundle = file.read()
    _run(url, api_key, lambda c: c.load_policy(agent_id, bundle))
    _print_json({"loaded": agent_id}) if as_json else click.echo(f"loaded policy for {agent_id}")


@policy.command("show")
@click.argument("agent_id")
@_client_options
def policy_show(agent_id: str, url: str, api_key: str, as_json: bool) -> None:
    """Print AGENT_ID's policy bundle."""
    bundle = _run(url, api_key, lambda c: c.show_policy(agent_id))
    if as_json:
        _print_json({"agent_id": agent_id, "bundle": bundle})
    elif bundle is None:
        click.echo(f"{agent_id} has no policy bundle: every step is allowed")
    else:
        click.echo(bundle.rstrip("\n"))

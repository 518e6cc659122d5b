"""`rebuno` entry point and the kernel-running commands (`dev`, `server`)."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import click

from rebuno_proto import DispatchSettings

from ..kernel import KernelConfig, ManifestError, load_manifest, serve_kernel
from ..store import StoreError
from ._client_cmds import agents, approvals, execs, policy

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="rebuno-sansio", prog_name="rebuno")
def cli() -> None:
    """rebuno: durable execution for AI agents.

    Run a kernel with `rebuno dev` (embedded SQLite, no auth) or `rebuno server`
    (production: bearer token required); drive it with `rebuno exec`, `rebuno
    agents`, `rebuno approvals` and `rebuno policy`.
    """


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    # FloatRange lets nan and inf through; the kernel needs a real number of seconds.
    if not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number of seconds, got {value}")
    return value


def _kernel_options(fn: Any) -> Any:
    options = [
        click.option(
            "--config",
            "config",
            type=click.Path(dir_okay=False),
            default=None,
            help="Manifest (YAML) of agents to register: "
            "agents: [{id, webhook_url, secret, policy | policy_file}].",
        ),
        click.option(
            "--host", default="127.0.0.1", show_default=True, help="Interface to listen on."
        ),
        click.option(
            "--port",
            default=8080,
            show_default=True,
            type=click.IntRange(0, 65535),
            help="Port to listen on (0: any free port).",
        ),
        click.option(
            "--lease-timeout",
            default=120.0,
            show_default=True,
            type=click.FloatRange(min=0.1),
            callback=_finite,
            help="Seconds a dispatch lease lasts without a heartbeat before it is re-delivered.",
        ),
        click.option(
            "--max-attempts",
            default=5,
            show_default=True,
            type=click.IntRange(min=1),
            help="Webhook delivery attempts before an execution fails dispatch_exhausted.",
        ),
        click.option(
            "--claim-interval",
            default=2.0,
            show_default=True,
            type=click.FloatRange(min=0.01),
            callback=_finite,
            help="Longest the dispatcher waits between looks for due work "
            "(new work wakes it at once).",
        ),
        click.option(
            "--backoff-base",
            default=1.0,
            show_default=True,
            type=click.FloatRange(min=0.0),
            callback=_finite,
            help="Seconds before the first re-delivery after a failed webhook; doubles each time.",
        ),
        click.option(
            "--backoff-max",
            default=30.0,
            show_default=True,
            type=click.FloatRange(min=0.0),
            callback=_finite,
            help="Longest wait between delivery attempts (plus up to 25% jitter).",
        ),
        click.option(
            "--synchronous",
            type=click.Choice(["FULL", "NORMAL"], case_sensitive=False),
            default="FULL",
            show_default=True,
            help="SQLite durability: FULL survives power loss; "
            "NORMAL may lose the last commits on power loss.",
        ),
        click.option(
            "--log-level",
            type=click.Choice(["debug", "info", "warning", "error"]),
            default="info",
            show_default=True,
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _run(config: KernelConfig, log_level: str, *, banner: str) -> None:
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            running = await tg.start(serve_kernel, config)
            click.echo(f"{banner} listening on http://{config.host}:{running.port}", err=True)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    click.echo("shutting down (requests in flight may finish)...", err=True)
                    running.server.shutdown()
                    break

    try:
        anyio.run(main)
    except Exception as err:
        # Task groups wrap what fails inside them in exception groups: look at
        # what they hold. Expected failures (the database cannot be used, the
        # port cannot be bound) are one line; anything else keeps its traceback.
        leaves = list(_leaves(err))
        if not all(isinstance(e, StoreError | OSError) for e in leaves):
            raise
        first = leaves[0]
        if isinstance(first, StoreError):
            raise click.ClickException(str(first)) from None
        assert isinstance(first, OSError)
        raise click.ClickException(
            f"cannot listen on {config.host}:{config.port}: {first.strerror or first}"
        ) from None


def _leaves(err: BaseException) -> Iterator[BaseException]:
    """The exceptions inside (nested) exception groups, or `err` itself."""
    if isinstance(err, BaseExceptionGroup):
        for inner in err.exceptions:
            yield from _leaves(inner)
    else:
        yield err


def _config(
    *,
    db: str,
    config: str | None,
    host: str,
    port: int,
    lease_timeout: float,
    max_attempts: int,
    claim_interval: float,
    backoff_base: float,
    backoff_max: float,
    synchronous: str,
    **extra: Any,
) -> KernelConfig:
    if "://" in db and db != "memory://":
        raise click.BadParameter(
            f"must be a SQLite file path, ':memory:' or 'memory://' "
            f"(this build has no PostgreSQL), got {db!r}",
            param_hint="--db",
        )
    if backoff_max < backoff_base:
        raise click.UsageError(
            f"--backoff-max ({backoff_max}) must be at least --backoff-base ({backoff_base})"
        )
    try:
        agents = tuple(load_manifest(config)) if config else ()
    except ManifestError as err:
        raise click.ClickException(str(err)) from None
    from ..policy import compile_bundle_text

    for agent in agents:
        if agent.policy is not None:
            try:
                compile_bundle_text(agent.policy)
            except ValueError as err:
                raise click.ClickException(f"agent {agent.id!r}: invalid policy: {err}") from None
    return KernelConfig(
        db=db,
        host=host,
        port=port,
        synchronous=synchronous.upper(),
        agents=agents,
        settings=DispatchSettings(
            lease_timeout_s=lease_timeout,
            max_attempts=max_attempts,
            backoff_base_s=backoff_base,
            backoff_max_s=backoff_max,
        ),
        poll_interval_s=claim_interval,
        **extra,
    )


@cli.command()
@_kernel_options
@click.option(
    "--db",
    default="./rebuno.db",
    show_default=True,
    help="SQLite file (created if missing), or :memory: for a throwaway kernel.",
)
def dev(db: str, log_level: str, **options: Any) -> None:
    """Run an embedded kernel for development: SQLite, no auth."""
    _run(_config(db=db, **options), log_level, banner="rebuno dev kernel")


@cli.command()
@_kernel_options
@click.option("--db", required=True, help="SQLite file path for the kernel's data.")
@click.option(
    "--bearer-token",
    envvar="REBUNO_BEARER_TOKEN",
    default=None,
    help="Token client and admin calls must send (Authorization: Bearer ...). "
    "Env: REBUNO_BEARER_TOKEN.",
)
@click.option(
    "--principal",
    "principals",
    multiple=True,
    metavar="NAME=TOKEN",
    help="A named caller: a bearer token whose approvals are recorded as decided by NAME. "
    "Repeatable.",
)
@click.option(
    "--v1-only", is_flag=True, help="Refuse agent requests signed in the replayable body-only form."
)
def server(
    db: str,
    log_level: str,
    bearer_token: str | None,
    principals: tuple[str, ...],
    v1_only: bool,
    **options: Any,
) -> None:
    """Run a production kernel: bearer token required."""
    if not bearer_token:
        raise click.UsageError("rebuno server needs --bearer-token (or REBUNO_BEARER_TOKEN)")
    named: dict[str, str] = {}
    for item in principals:
        name, sep, token = item.partition("=")
        if not sep or not name or not token:
            raise click.UsageError(f"--principal must be NAME=TOKEN, got {item!r}")
        if token == bearer_token or token in named:
            raise click.UsageError(f"--principal {name}: each token must be distinct")
        named[token] = name
    config = _config(
        db=db,
        bearer_token=bearer_token,
        principals=named,
        allow_body_form=not v1_only,
        **options,
    )
    _run(config, log_level, banner="rebuno server")


cli.add_command(execs)
cli.add_command(agents)
cli.add_command(approvals)
cli.add_command(policy)


def main() -> None:
    """Console entry point."""
    if os.environ.get("REBUNO_CLI_TRACEBACK"):
        cli()
        return
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:  # pragma: no cover - interactive
        sys.exit(130)

"""Assemble and run a kernel: store, service, dispatcher, HTTP API, server.

`serve_kernel` is what `rebuno dev` and `rebuno server` run, and what tests and
benchmarks start in-process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskStatus

from rebuno_proto import Agent, DispatchSettings

from .._server import HttpServer, ServerLimits
from ..policy import PolicyHook, compile_bundle_text, policy_hook
from ..store import open_store
from ._api import KernelAPI, PolicyLoader
from ._dispatcher import Dispatcher
from ._manifest import ManifestAgent
from ._service import Kernel

__all__ = ["KernelConfig", "RunningKernel", "serve_kernel"]

log = logging.getLogger("rebuno.kernel")


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelConfig:
    """Everything a kernel process needs.

    Attributes:
        db: `--db`: a SQLite file path, `:memory:` or `memory://`.
        synchronous: SQLite durability, `FULL` (default) or `NORMAL`.
        bearer_token: required on client/admin routes; `None` is dev mode.
        principals: more bearer tokens, each mapped to a named principal.
        allow_body_form: accept agent requests signed in the seeds' body form.
        agents: agents from the manifest, registered (upserted) at start.
        settings: lease timeout, delivery attempts, backoff.
        poll_interval_s: the longest the dispatcher sleeps without looking.
    """

    db: str = "./rebuno.db"
    host: str = "127.0.0.1"
    port: int = 8080
    synchronous: str = "FULL"
    bearer_token: str | None = None
    principals: Mapping[str, str] = field(default_factory=dict)
    allow_body_form: bool = True
    agents: tuple[ManifestAgent, ...] = ()
    settings: DispatchSettings = field(default_factory=DispatchSettings)
    poll_interval_s: float = 2.0
    limits: ServerLimits = field(default_factory=ServerLimits)
    policy_loader: PolicyLoader | None = None
    policy_hook: PolicyHook | None = None


@dataclass(slots=True)
class RunningKernel:
    """Handles to a started kernel (what `serve_kernel` reports when ready)."""

    port: int
    kernel: Kernel
    api: KernelAPI
    server: HttpServer


async def _register(kernel: Kernel, agents: tuple[ManifestAgent, ...]) -> None:
    for entry in agents:
        existing = await kernel.agent(entry.id)
        # The manifest is the record for what it states; a policy it does not
        # state (one loaded through the API or CLI) survives a restart.
        agent = Agent(
            id=entry.id,
            webhook_url=entry.webhook_url,
            secret=entry.secret,
            registered_at=kernel.clock() if existing is None else existing.registered_at,
            policy=entry.policy
            if entry.policy is not None or existing is None
            else existing.policy,
        )
        if existing is not None:
            agent = dataclasses.replace(
                agent,
                description=existing.description,
                input_schema=existing.input_schema,
                output_schema=existing.output_schema,
            )
        await kernel.put_agent(agent)


async def serve_kernel(
    config: KernelConfig,
    *,
    task_status: TaskStatus[RunningKernel] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a kernel until cancelled or until its server is shut down.

    Reports a `RunningKernel` (with the bound port) through `task_status` once
    the store is open, the manifest is registered and the server listens.
    """
    store = await open_store(config.db, synchronous=config.synchronous)
    try:
        dev_mode = config.bearer_token is None and not config.principals
        kernel = Kernel(
            store,
            settings=config.settings,
            policy=config.policy_hook or policy_hook(dev_mode=dev_mode),
        )
        await _register(kernel, config.agents)
        if store.resumed_cleanly:
            log.info("resumed after a clean shutdown: leases stay in force")
        else:
            retired = await kernel.retire_leases()
            if retired:
                log.info("retired %d lease(s) granted before a crash; re-delivering", retired)
        api = KernelAPI(
            kernel,
            bearer_token=config.bearer_token,
            principals=config.principals,
            allow_body_form=config.allow_body_form,
            policy_loader=config.policy_loader or compile_bundle_text,
        )
        server = HttpServer(api, limits=config.limits)
        dispatcher = Dispatcher(kernel, poll_interval_s=config.poll_interval_s)
        async with anyio.create_task_group() as tg:

            async def serve(*, task_status: TaskStatus[int]) -> None:
                await server.serve(config.host, config.port, task_status=task_status)
                tg.cancel_scope.cancel()  # shut down: stop the dispatcher too

            await tg.start(dispatcher.run)
            port = await tg.start(serve)
            log.info("kernel listening on http://%s:%d (%s)", config.host, port, store.description)
            task_status.started(RunningKernel(port=port, kernel=kernel, api=api, server=server))
    finally:
        with anyio.CancelScope(shield=True):
            await store.close()

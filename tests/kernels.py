"""An in-process kernel for adapter tests: the real service, API and server on
a loopback port, inside the test's own event loop (asyncio or trio)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

from rebuno_anyio.kernel import KernelConfig, RunningKernel, serve_kernel
from rebuno_proto import Agent, DispatchSettings


@dataclass
class InProcessKernel:
    url: str
    running: RunningKernel

    async def register(
        self, agent_id: str, webhook_url: str, secret: str, *, policy: str | None = None
    ) -> None:
        kernel = self.running.kernel
        await kernel.put_agent(
            Agent(
                id=agent_id,
                webhook_url=webhook_url,
                secret=secret,
                registered_at=kernel.clock(),
                policy=policy,
            )
        )


@asynccontextmanager
async def inprocess_kernel(
    *,
    db: str = "memory://",
    lease_timeout_s: float = 120.0,
    max_attempts: int = 5,
    poll_interval_s: float = 0.5,
    **config: object,
) -> AsyncIterator[InProcessKernel]:
    """Run a kernel until the block exits (then shut it down)."""
    settings = DispatchSettings(
        lease_timeout_s=lease_timeout_s,
        max_attempts=max_attempts,
        backoff_base_s=0.05,
        backoff_max_s=0.5,
    )
    cfg = KernelConfig(db=db, port=0, settings=settings, poll_interval_s=poll_interval_s, **config)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        running = await tg.start(serve_kernel, cfg)
        try:
            yield InProcessKernel(url=f"http://127.0.0.1:{running.port}", running=running)
        finally:
            running.server.shutdown()
            tg.cancel_scope.cancel()

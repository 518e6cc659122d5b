"""The dispatcher's background work, and the service wake-ups it relies on.

The kernel service on a store, the `Dispatcher` in the test's event loop
(asyncio and trio), and agents that are either an httpx mock transport or a raw
TCP server (for answers that trickle or stall). Nothing waits on a timer: tests
wait on events (long polls of the event log, a log record, a request arriving),
with `anyio.fail_after` as the safety net.

What is checked: an error in any loop -- a URL httpx refuses, a store that
fails, a locked SQLite file -- is logged and backed off, never the end of the
kernel; a delivery has a total deadline and does not read the answer's body;
claims never exceed free delivery slots; long polls leave nothing behind; the
wake-ups after a commit happen even when the caller is cancelled.
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
from anyio.abc import ByteStream, SocketAttribute

from rebuno_anyio.kernel import Kernel
from rebuno_anyio.kernel._dispatcher import Dispatcher
from rebuno_anyio.policy import policy_hook
from rebuno_anyio.store import MemoryStore, SQLiteStore, Store, StoreError
from rebuno_proto import (
    Agent,
    DeliveryResult,
    DispatchSettings,
    DispatchStatus,
    Event,
    Refusal,
    parse_create_execution,
    parse_step_submission,
)

pytestmark = pytest.mark.anyio

SECRET = "s"
POLL_S = 0.05
SETTINGS = DispatchSettings(
    lease_timeout_s=60.0, max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.05
)

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


async def answer_200(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200)


@dataclass
class Rig:
    kernel: Kernel
    dispatcher: Dispatcher
    webhooks: list[dict[str, Any]] = field(default_factory=list)  # bodies the agents got

    async def agent(self, agent_id: str, url: str = "", policy: str | None = None) -> None:
        await self.kernel.put_agent(
            Agent(
                id=agent_id,
                webhook_url=url or f"http://{agent_id}.test/webhook",
                secret=SECRET,
                registered_at=self.kernel.clock(),
                policy=policy,
            )
        )

    async def create(self, agent_id: str) -> str:
        created = await self.kernel.create(
            parse_create_execution(json.dumps({"agent_id": agent_id}).encode())
        )
        assert not isinstance(created, Refusal), created
        return created.execution.id


@asynccontextmanager
async def rig(
    handler: Handler | None = answer_200,
    *,
    store: Store | None = None,
    settings: DispatchSettings = SETTINGS,
    start: bool = True,
    **options: Any,
) -> AsyncIterator[Rig]:
    """A kernel and its dispatcher; agents answer through `handler` (a mock
    transport), or over real sockets if `handler` is None."""
    kernel = Kernel(store or MemoryStore(), settings=settings, policy=policy_hook(dev_mode=True))
    webhooks: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> httpx.Response:
        webhooks.append(json.loads(request.content))
        assert handler is not None
        return await handler(request)

    http = None if handler is None else httpx.AsyncClient(transport=httpx.MockTransport(record))
    dispatcher = Dispatcher(kernel, poll_interval_s=POLL_S, http=http, **options)
    try:
        async with anyio.create_task_group() as tg:
            if start:
                await tg.start(dispatcher.run)
            yield Rig(kernel, dispatcher, webhooks)
            tg.cancel_scope.cancel()
    finally:
        if http is not None:
            await http.aclose()


async def wait_for(kernel: Kernel, execution_id: str, kind: str, count: int = 1) -> list[Event]:
    """Long-poll the event log until `count` events of type `kind` are in it."""
    seen: list[Event] = []
    while sum(e.type == kind for e in seen) < count:
        after = seen[-1].seq if seen else 0
        page = await kernel.events(execution_id, after_seq=after, limit=1000, wait_s=30)
        assert isinstance(page, list), page
        seen += page
    return seen


def payload(event: Event) -> dict[str, Any]:
    return json.loads(event.payload)  # type: ignore[no-any-return]


class LogWatch(logging.Handler):
    """Sets an event when a dispatcher record containing `needle` is logged."""

    def __init__(self, needle: str) -> None:
        super().__init__(logging.DEBUG)
        self.needle = needle
        self.seen = anyio.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.needle in message:
            self.seen.set()


@asynccontextmanager
async def watch_log(needle: str) -> AsyncIterator[LogWatch]:
    logger = logging.getLogger("rebuno.kernel.dispatcher")
    watch = LogWatch(needle)
    level = logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.DEBUG)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)


# -- 1. an error in a loop is logged and backed off; the kernel goes on ---------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://h:abc/",  # passes the wire parser; httpx.InvalidURL (not an HTTPError)
        "http://x\x00y/",
        "http://[::1/",
        "http://127.0.0.1:99999/",  # an OverflowError inside the connect, in a group
    ],
)
async def test_a_url_httpx_refuses_fails_the_delivery_not_the_kernel(
    anyio_backend: str, url: str
) -> None:
    with anyio.fail_after(20):
        async with rig(None) as r:  # the dispatcher's own httpx client
            await r.agent("bad", url)
            first = await r.create("bad")
            events = await wait_for(r.kernel, first, "execution.failed")
            assert [e.type for e in events].count("dispatch.failed") == SETTINGS.max_attempts
            execution = await r.kernel.execution(first)
            assert not isinstance(execution, Refusal)
            assert execution.failure_reason == "dispatch_exhausted"
            # Still delivering (and refusing): the loops are alive.
            second = await r.create("bad")
            await wait_for(r.kernel, second, "dispatch.failed")


class Flaky:
    """Replaces a kernel method: the first `times` calls raise StoreError."""

    def __init__(self, kernel: Kernel, name: str, times: int) -> None:
        self.real = getattr(kernel, name)
        self.name = name
        self.left = times
        setattr(kernel, name, self)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.left > 0:
            self.left -= 1
            raise StoreError(f"{self.name}: database is locked")
        return await self.real(*args, **kwargs)


@pytest.mark.parametrize(
    ("method", "times"),
    [
        ("read", 6),  # every loop's query, more than once
        ("claim", 2),
        ("agent", 2),  # inside the POST: a failed delivery, retried
        ("delivered", 1),  # the slot is freed; the lease lapse re-queues it
    ],
)
async def test_store_errors_in_the_delivery_path_are_survived(
    anyio_backend: str, method: str, times: int
) -> None:
    settings = DispatchSettings(
        lease_timeout_s=0.3, max_attempts=5, backoff_base_s=0.01, backoff_max_s=0.05
    )
    with anyio.fail_after(20):
        async with rig(settings=settings, start=False, concurrency=1) as r:
            await r.agent("a")
            execution_id = await r.create("a")
            flaky = Flaky(r.kernel, method, times)
            async with (
                watch_log(f"{method}: database is locked") as log,
                anyio.create_task_group() as tg,
            ):
                await tg.start(r.dispatcher.run)
                await wait_for(r.kernel, execution_id, "dispatch.acked")
                assert flaky.left == 0
                await log.seen.wait()
                # A second execution is delivered too: no slot was lost.
                other = await r.create("a")
                await wait_for(r.kernel, other, "dispatch.acked")
                tg.cancel_scope.cancel()
    assert any(execution_id in m for m in log.messages) or method == "read"


async def test_a_failing_lease_reaper_and_approval_timer_retry(anyio_backend: str) -> None:
    policy = (
        "default_action: allow\n"
        "rules:\n"
        "  - id: hold\n"
        "    priority: 1\n"
        "    when: {step_kind: tool_call, target: wire}\n"
        "    then:\n"
        "      decision: require_approval\n"
        "      approval_config: {message: m, timeout: 1s}\n"
    )
    settings = DispatchSettings(
        lease_timeout_s=0.2, max_attempts=5, backoff_base_s=0.01, backoff_max_s=0.05
    )
    with anyio.fail_after(20):
        async with rig(settings=settings, start=False) as r:
            await r.agent("a", policy=policy)
            # Set up by hand, before the dispatcher runs: `held` waits for an
            # approval that times out in 1 s; `lapsing` holds a lease it never
            # renews.
            held, lapsing = await r.create("a"), await r.create("a")
            leases = {}
            for execution_id in (held, lapsing):
                delivery = await r.kernel.claim(execution_id)
                assert delivery is not None
                await r.kernel.delivered(delivery, DeliveryResult.ACKED)
                leases[execution_id] = delivery.lease()
            decision = await r.kernel.submit(
                held,
                "a",
                leases[held],
                parse_step_submission(b'{"kind": "tool_call", "target": "wire", "args": {}}'),
            )
            assert not isinstance(decision, Refusal)
            assert decision.approval_id, decision
            Flaky(r.kernel, "reclaim", 1)
            Flaky(r.kernel, "expire", 1)
            async with watch_log("database is locked") as log, anyio.create_task_group() as tg:
                await tg.start(r.dispatcher.run)
                # The reaper fails once, then re-queues: attempt 2 is delivered.
                events = await wait_for(r.kernel, lapsing, "dispatch.acked", count=2)
                acked = [payload(e)["attempt"] for e in events if e.type == "dispatch.acked"]
                assert acked == [1, 2]
                # The timer fails once, then expires the approval.
                await wait_for(r.kernel, held, "approval.expired")
                tg.cancel_scope.cancel()
    assert any(f"lapsed lease of execution {lapsing}" in m for m in log.messages), log.messages
    assert any("expiring approval" in m for m in log.messages), log.messages


async def test_a_locked_sqlite_file_is_waited_out(anyio_backend: str, tmp_path: Path) -> None:
    """Another process holds the write lock past busy_timeout: the store call
    raises StoreError; the dispatcher logs it, backs off and delivers later."""
    path = str(tmp_path / "k.db")
    store = await SQLiteStore.open(path, synchronous="NORMAL")
    try:
        with anyio.fail_after(60):
            async with rig(store=store, start=False) as r:
                await r.agent("a")
                execution_id = await r.create("a")
                other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
                try:
                    other.execute("BEGIN IMMEDIATE")  # held until the dispatcher has failed
                    async with watch_log("failed") as log, anyio.create_task_group() as tg:
                        await tg.start(r.dispatcher.run)
                        await log.seen.wait()
                        other.execute("ROLLBACK")
                        await wait_for(r.kernel, execution_id, "dispatch.acked")
                        tg.cancel_scope.cancel()
                finally:
                    other.close()
    finally:
        await store.close()
    assert any("locked" in m for m in log.messages), log.messages


# -- 2. a delivery has a total deadline, and the answer's body is not read --------------------


@asynccontextmanager
async def raw_agent(
    behaviour: Callable[[ByteStream, anyio.Event], Awaitable[None]],
) -> AsyncIterator[tuple[str, anyio.Event]]:
    """A TCP server on a loopback port: reads a request head, then runs
    `behaviour`; the event is set when a request has arrived."""
    arrived = anyio.Event()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

    async def serve(stream: ByteStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive()
                data += chunk
            arrived.set()
            await behaviour(stream, arrived)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        port = listener.extra(SocketAttribute.local_port)
        yield f"http://127.0.0.1:{port}/webhook", arrived
        tg.cancel_scope.cancel()


async def trickle(stream: ByteStream, arrived: anyio.Event) -> None:
    # A peer that is never silent for long, and never done: each read of a
    # per-read timeout succeeds. (The pause is the peer's slowness, not a wait.)
    for byte in b"HTTP/1.1 200 OK\r\n" * 1000:
        await stream.send(bytes([byte]))
        await anyio.sleep(0.02)


async def headers_then_stall(stream: ByteStream, arrived: anyio.Event) -> None:
    await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
    await anyio.sleep_forever()


async def quick(stream: ByteStream, arrived: anyio.Event) -> None:
    await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")


async def test_a_trickling_agent_is_cut_off_at_the_delivery_timeout(anyio_backend: str) -> None:
    with anyio.fail_after(20):
        async with (
            raw_agent(trickle) as (slow_url, slow_arrived),
            raw_agent(quick) as (fast_url, _),
            rig(None, concurrency=1, delivery_timeout_s=0.5) as r,
        ):
            await r.agent("slow", slow_url)
            await r.agent("fast", fast_url)
            slow = await r.create("slow")
            await slow_arrived.wait()  # the only slot is taken
            fast = await r.create("fast")
            # The slow delivery fails at its deadline, freeing the slot.
            await wait_for(r.kernel, slow, "dispatch.failed")
            await wait_for(r.kernel, fast, "dispatch.acked")


async def test_the_status_is_enough_the_body_is_not_read(anyio_backend: str) -> None:
    with anyio.fail_after(20):
        async with (
            raw_agent(headers_then_stall) as (url, _),
            rig(None, delivery_timeout_s=5.0) as r,
        ):
            await r.agent("a", url)
            execution_id = await r.create("a")
            start = anyio.current_time()
            events = await wait_for(r.kernel, execution_id, "dispatch.acked")
            assert anyio.current_time() - start < 4  # not after the 5 s deadline
            assert "dispatch.failed" not in [e.type for e in events]


# -- 3. claims never exceed free delivery slots -------------------------------------------------


async def test_claims_wait_for_a_free_delivery_slot(anyio_backend: str) -> None:
    release = anyio.Event()
    inside = 0
    two_inside = anyio.Event()

    async def hold(request: httpx.Request) -> httpx.Response:
        nonlocal inside
        inside += 1
        if inside == 2:
            two_inside.set()
        await release.wait()
        return httpx.Response(200)

    with anyio.fail_after(20):
        async with rig(hold, concurrency=2, claim_batch=10) as r:
            await r.agent("a")
            ids = [await r.create("a") for _ in range(5)]
            await two_inside.wait()
            await anyio.wait_all_tasks_blocked()

            def statuses(tx: Any) -> list[str]:
                return [tx.execution(i).dispatch.status.value for i in ids]

            # Only what is being delivered is claimed; the rest waits unclaimed
            # (the lease clock starts at the claim).
            found = await r.kernel.read(statuses)
            assert sorted(found) == ["in_flight", "in_flight", "pending", "pending", "pending"]
            release.set()
            for execution_id in ids:
                events = await wait_for(r.kernel, execution_id, "dispatch.acked")
                assert [payload(e)["attempt"] for e in events if e.type == "dispatch.acked"] == [1]
            assert sorted(w["execution_id"] for w in r.webhooks) == sorted(ids)
            assert {w["dispatch_attempt"] for w in r.webhooks} == {1}


# -- 6. long polls leave nothing behind ------------------------------------------------------


async def service() -> tuple[Kernel, str]:
    kernel = Kernel(MemoryStore(), settings=SETTINGS)
    await kernel.put_agent(
        Agent(id="a", webhook_url="http://a.test/", secret=SECRET, registered_at=0.0)
    )
    created = await kernel.create(parse_create_execution(b'{"agent_id": "a"}'))
    assert not isinstance(created, Refusal)
    return kernel, created.execution.id


async def test_a_long_poll_that_times_out_or_is_cancelled_leaves_no_waiter(
    anyio_backend: str,
) -> None:
    kernel, execution_id = await service()
    last = (await kernel.events(execution_id, after_seq=0, limit=1000))[-1].seq  # type: ignore[union-attr]
    with anyio.fail_after(10):
        for _ in range(20):
            assert await kernel.events(execution_id, after_seq=last, limit=10, wait_s=0.01) == []
        assert kernel._event_waiters == {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                functools.partial(
                    kernel.events, execution_id, after_seq=last, limit=10, wait_s=30.0
                )
            )
            await anyio.wait_all_tasks_blocked()
            assert list(kernel._event_waiters) == [execution_id]
            tg.cancel_scope.cancel()
        assert kernel._event_waiters == {}


async def test_a_poll_that_leaves_does_not_strand_another_still_waiting(
    anyio_backend: str,
) -> None:
    kernel, execution_id = await service()
    last = (await kernel.events(execution_id, after_seq=0, limit=1000))[-1].seq  # type: ignore[union-attr]
    got: list[Any] = []

    async def poll(wait_s: float) -> None:
        got.append(await kernel.events(execution_id, after_seq=last, limit=10, wait_s=wait_s))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll, 30.0)
            await anyio.wait_all_tasks_blocked()
            await poll(0.01)  # a short poll comes and goes
            assert got == [[]]
            assert kernel._event_waiters[execution_id].count == 1  # the long one stays
            assert await kernel.cancel(execution_id) is None
        assert got[1][0].type == "execution.cancelled"
        assert kernel._event_waiters == {}


# -- 7. the wake-ups after a commit happen even if the caller is cancelled ---------------------


class CancelAfterCommit:
    """A store wrapper: when armed with a cancel scope, the next command
    cancels that scope right after it has committed (before its caller
    resumes) -- as when a request is cancelled while the SQLite store's batch
    that holds its command commits."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.scope: anyio.CancelScope | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def run(self, fn: Callable[[Any], Any]) -> Any:
        result = await self.inner.run(fn)
        scope, self.scope = self.scope, None
        if scope is not None:
            scope.cancel()
            await anyio.lowlevel.checkpoint()
        return result


@pytest.fixture(params=["memory", "sqlite"])
async def cancelling(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Any]:
    inner: Any = MemoryStore() if request.param == "memory" else await SQLiteStore.open(":memory:")
    try:
        yield CancelAfterCommit(inner)
    finally:
        await inner.close()


async def test_a_cancelled_command_still_wakes_the_dispatcher_and_long_polls(
    cancelling: CancelAfterCommit,
) -> None:
    kernel = Kernel(cancelling, settings=SETTINGS)
    due: list[float] = []
    kernel.on_dispatch_due = due.append
    await kernel.put_agent(
        Agent(id="a", webhook_url="http://a.test/", secret=SECRET, registered_at=0)
    )
    with anyio.CancelScope() as scope:
        cancelling.scope = scope
        await kernel.create(parse_create_execution(b'{"agent_id": "a"}'))
    assert scope.cancel_called
    assert len(due) == 1  # the dispatcher was told about the new dispatch
    (execution_id,) = await kernel.read(
        lambda tx: [e.id for e in tx.executions(agent_id="a", status="", before_id="", limit=5)]
    )
    got: list[Any] = []

    async def poll() -> None:
        got.append(await kernel.events(execution_id, after_seq=3, limit=10, wait_s=30))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            await anyio.wait_all_tasks_blocked()
            with anyio.CancelScope() as scope:
                cancelling.scope = scope
                await kernel.cancel(execution_id)
            assert scope.cancel_called
        # The long poll was woken by the cancelled command's events.
        assert "execution.cancelled" in [e.type for e in got[0]]


async def test_a_cancelled_agent_write_still_drops_the_cached_agent(
    cancelling: CancelAfterCommit,
) -> None:
    kernel = Kernel(cancelling, settings=SETTINGS)
    await kernel.register_agent("a", webhook_url="http://a.test/", secret="old")
    assert (await kernel.agent("a")).secret == "old"  # type: ignore[union-attr]  # now cached
    with anyio.CancelScope() as scope:
        cancelling.scope = scope
        await kernel.register_agent("a", webhook_url="http://a.test/", secret="new")
    assert scope.cancel_called
    assert (await kernel.agent("a")).secret == "new"  # type: ignore[union-attr]


# -- a webhook that may have arrived waits out its lease before a retry -----------------


async def _raise_read_timeout(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("no answer", request=request)


async def _raise_connect_error(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def answer_503(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503)


async def _raise_connect_timeout(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectTimeout("no connection", request=request)


async def _raise_pool_timeout(request: httpx.Request) -> httpx.Response:
    raise httpx.PoolTimeout("no free connection", request=request)


async def answer_502(request: httpx.Request) -> httpx.Response:
    return httpx.Response(502)


async def answer_504(request: httpx.Request) -> httpx.Response:
    return httpx.Response(504)


@pytest.mark.parametrize(
    ("handler", "waits_out_the_lease"),
    [
        (_raise_read_timeout, True),
        (_raise_connect_error, False),
        (answer_503, False),
        (_raise_connect_timeout, False),
        (_raise_pool_timeout, False),
        (answer_502, True),  # a proxy: the agent behind it may have got it
        (answer_504, True),
    ],
    ids=["sent-no-answer", "refused", "503", "connect-timeout", "pool-timeout", "502", "504"],
)
async def test_a_retry_waits_out_the_lease_only_if_the_webhook_may_have_arrived(
    anyio_backend: str, handler: Handler, waits_out_the_lease: bool
) -> None:
    """A POST that got no answer may have started a handler, which may act on
    a `proceed` until its lease would lapse: the retry waits until then
    (simulator, webhook-loss probe seed 693). A refused connection or a
    non-2xx answer never started one: the backoff alone applies."""
    with anyio.fail_after(10):
        async with rig(handler) as r:
            await r.agent("a")
            execution_id = await r.create("a")
            events = await wait_for(r.kernel, execution_id, "dispatch.failed")
            failed = payload(next(e for e in events if e.type == "dispatch.failed"))
            assert failed["attempt"] == 1
            record = await r.kernel.execution(execution_id)
            assert not isinstance(record, Refusal)
            assert record.dispatch is not None
            wait = record.dispatch.next_attempt_at - record.created_at
            if waits_out_the_lease:
                assert wait >= SETTINGS.lease_timeout_s
            else:
                assert wait < 1.0


async def test_our_deadline_before_anything_was_sent_retries_after_the_backoff(
    anyio_backend: str,
) -> None:
    """A mock agent that never answers sends no trace of a request going out:
    the deadline alone does not make it `may have arrived`."""
    never = anyio.Event()

    async def hang(request: httpx.Request) -> httpx.Response:
        await never.wait()
        raise AssertionError("unreachable")

    with anyio.fail_after(10):
        async with rig(hang, delivery_timeout_s=0.05) as r:
            await r.agent("a")
            execution_id = await r.create("a")
            await wait_for(r.kernel, execution_id, "dispatch.failed")
            record = await r.kernel.execution(execution_id)
            assert not isinstance(record, Refusal)
            assert record.dispatch is not None
            assert record.dispatch.next_attempt_at - record.created_at < 1.0


async def test_a_silent_agent_that_got_the_request_waits_out_the_lease(
    anyio_backend: str,
) -> None:
    """Over a real socket: the request went out, no answer came in time."""
    got_request = anyio.Event()

    async def silent(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.receive()
            got_request.set()
            await anyio.sleep_forever()

    with anyio.fail_after(10):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as server:
            server.start_soon(listener.serve, silent)
            async with rig(None, delivery_timeout_s=0.5) as r:
                await r.agent("a", f"http://127.0.0.1:{port}/webhook")
                execution_id = await r.create("a")
                await wait_for(r.kernel, execution_id, "dispatch.failed")
                assert got_request.is_set()
                record = await r.kernel.execution(execution_id)
                assert not isinstance(record, Refusal)
                assert record.dispatch is not None
                assert record.dispatch.next_attempt_at - record.created_at >= (
                    SETTINGS.lease_timeout_s
                )
            server.cancel_scope.cancel()


async def test_a_shutdown_mid_post_leaves_the_lease_in_flight(anyio_backend: str) -> None:
    """The webhook may have arrived: a handler that got it carries on across
    a clean restart, and the reaper re-queues the dispatch if none did."""
    posted = anyio.Event()

    async def hang(request: httpx.Request) -> httpx.Response:
        posted.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    with anyio.fail_after(10):
        async with rig(hang) as r:
            await r.agent("a")
            execution_id = await r.create("a")
            await posted.wait()
        # The rig (the dispatcher with it) has stopped mid-POST.
        record = await r.kernel.execution(execution_id)
        assert not isinstance(record, Refusal)
        assert record.dispatch is not None
        assert record.dispatch.status is DispatchStatus.IN_FLIGHT
        events = await r.kernel.events(execution_id, after_seq=0, limit=100)
        assert isinstance(events, list)
        assert "dispatch.failed" not in [e.type for e in events]

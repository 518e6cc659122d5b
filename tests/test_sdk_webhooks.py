"""The webhook and the lease (PROTOCOL.md §3, §6.3; SEED 004 "Dispatch and
resume"; SEED 000 "Heartbeats and leases", "Signing").

The kernel delivers to a `Sink` here, and the test hands each delivery to the
agent itself: unsigned, twice, late or out of order. A `KernelSpy` on the
agent shows what reached the kernel.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from kernels import inprocess_kernel
from sdk_support import (
    AGENT_ID,
    SECRET,
    Delivery,
    KernelSpy,
    Sink,
    attempts,
    events,
    post,
    served,
    set_webhook,
    signed,
    steps,
    webhook_body,
)

from rebuno_anyio import Agent, Client, execution, tool
from rebuno_proto import sign_webhook

pytestmark = pytest.mark.anyio

bodies: list[str] = []


@pytest.fixture(autouse=True)
def fresh_bodies() -> None:
    bodies.clear()


@tool
async def before() -> str:
    bodies.append("before")
    return "before done"


@tool
async def after() -> str:
    bodies.append("after")
    return "after done"


# -- verification and parsing ------------------------------------------------------------------


async def test_bad_or_missing_signature_gets_401_and_nothing_happens() -> None:
    runs: list[str] = []

    async def process(input: Any) -> str:
        runs.append(execution().id)
        return "ran"

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            Sink().serving() as sink,
        ):
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent, deliver=False) as running:
                await spy.wait_for("set_metadata")
                await set_webhook(k, AGENT_ID, sink.url)
                created = await client.create(AGENT_ID, {})
                delivery = await sink.next()
                body = delivery.body
                forged = [
                    {},
                    {"Rebuno-Signature": sign_webhook(b"not-the-secret", body)},
                    {"Rebuno-Signature": sign_webhook(SECRET.encode(), body + b" ")},
                    {"Rebuno-Signature": delivery.signature.upper()},
                    {"Rebuno-Signature": delivery.signature.removeprefix("sha256=")},
                    {"Rebuno-Signature": "v1=" + delivery.signature.removeprefix("sha256=")},
                ]
                answers = [await post(running.webhook_url, body, headers) for headers in forged]
                await agent.join()
                calls_before = list(spy.calls)
                log_before = await events(client, created.id)
                # The genuine delivery still works: the payload itself was fine.
                genuine = await post(running.webhook_url, body, signed(body))
                final = await client.wait(created.id)

    assert [(a.status_code, a.content) for a in answers] == [(401, b"")] * len(forged)
    assert calls_before == [("set_metadata", "ok")]  # nothing fetched, nothing written
    assert not [
        e for e in log_before if e.type.startswith("step.") or e.type == "execution.completed"
    ]
    assert genuine.status_code == 200
    assert (final.status, runs) == ("completed", [created.id])


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b"{}",
        b'{"execution_id": "e", "dispatch_id": "d", "dispatch_attempt": 1, '
        b'"lease_timeout_seconds": 30}',
        b'{"execution_id": "0192f1a0-0000-7000-8000-00000000000a", '
        b'"dispatch_id": "0192f1a0-1111-7000-8000-000000000001", "dispatch_attempt": "1", '
        b'"lease_timeout_seconds": 30}',
        b'{"execution_id": "0192f1a0-0000-7000-8000-00000000000a", '
        b'"dispatch_id": "0192f1a0-1111-7000-8000-000000000001", "dispatch_attempt": 0, '
        b'"lease_timeout_seconds": 30}',
        b'{"execution_id": "0192f1a0-0000-7000-8000-00000000000a", '
        b'"dispatch_id": "0192f1a0-1111-7000-8000-000000000001", "dispatch_attempt": 1}',
    ],
    ids=["not-json", "array", "empty", "bad-ids", "attempt-string", "attempt-0", "no-lease"],
)
async def test_malformed_signed_body_gets_400(body: bytes) -> None:
    async def process(input: Any) -> None:
        raise AssertionError("never runs")

    agent = Agent(AGENT_ID, secret=SECRET, base_url="http://127.0.0.1:9")
    spy = KernelSpy(agent)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            port = await tg.start(
                lambda task_status: agent.serve(process, port=0, task_status=task_status)
            )
            url = f"http://127.0.0.1:{port}/webhook"
            answer = await post(url, body, signed(body))
            elsewhere = await post(f"http://127.0.0.1:{port}/other", body, signed(body))
            async with httpx.AsyncClient() as http:
                get = await http.get(url)
            tg.cancel_scope.cancel()

    assert answer.status_code == 400
    assert answer.json()["code"] == "validation_error"
    assert (elsewhere.status_code, get.status_code) == (404, 405)
    assert spy.count("get_execution") == 0


# -- duplicates, supersession, stale and terminal deliveries -------------------------------------


def with_lease(delivery: Delivery, lease_s: float) -> bytes:
    """The delivery's body with another `lease_timeout_seconds` (re-signed by the caller)."""
    return webhook_body({**delivery.payload, "lease_timeout_seconds": lease_s})


async def test_duplicate_delivery_while_running_is_ignored() -> None:
    runs: list[int] = []
    reached, gate = anyio.Event(), anyio.Event()

    async def process(input: Any) -> str:
        runs.append(execution().dispatch_attempt)
        reached.set()
        await gate.wait()
        return await before()

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            Sink().serving() as sink,
        ):
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent, deliver=False) as running:
                await set_webhook(k, AGENT_ID, sink.url)
                created = await client.create(AGENT_ID, {})
                delivery = await sink.next()
                headers = {"Rebuno-Signature": delivery.signature}
                first = await post(running.webhook_url, delivery.body, headers)
                await reached.wait()
                repeats = [
                    await post(running.webhook_url, delivery.body, headers) for _ in range(3)
                ]
                gate.set()
                final = await client.wait(created.id)

    assert first.status_code == 200
    assert [r.status_code for r in repeats] == [200, 200, 200]
    assert runs == [1]
    assert bodies == ["before"]
    assert spy.count("get_execution") == 1
    assert (final.status, final.output) == ("completed", "before done")


async def test_newer_attempt_supersedes_then_stale_and_terminal_ones_are_ignored() -> None:
    """Attempt 1 runs a tool, then waits. Its lease lapses (the test gave the
    agent a long lease, so it did not heartbeat) and the kernel re-delivers
    attempt 2: the agent cancels attempt 1's handler, which writes nothing
    more, and runs attempt 2. Attempt 1 arriving again is ignored; after the
    execution completed, any delivery is skipped without running the handler."""
    runs: list[int] = []
    cancelled: list[int] = []
    reached = {1: anyio.Event(), 2: anyio.Event()}
    gate = anyio.Event()

    async def process(input: Any) -> dict[str, str]:
        attempt = execution().dispatch_attempt
        runs.append(attempt)
        try:
            first = await before()
            reached[attempt].set()
            await gate.wait()
            return {"first": first, "second": await after()}
        except anyio.get_cancelled_exc_class():
            cancelled.append(attempt)
            raise

    with anyio.fail_after(20):
        async with (
            inprocess_kernel(lease_timeout_s=1.0, poll_interval_s=0.1) as k,
            Client(k.url) as client,
            Sink().serving() as sink,
        ):
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent, deliver=False) as running:
                url = running.webhook_url
                await set_webhook(k, AGENT_ID, sink.url)
                created = await client.create(AGENT_ID, {})
                d1 = await sink.next()
                quiet = with_lease(d1, 1000.0)  # heartbeats every 30 s: effectively none
                assert (await post(url, quiet, signed(quiet))).status_code == 200
                await reached[1].wait()

                d2 = await sink.next()  # the lease lapsed: the kernel re-delivers
                assert (d2.payload["dispatch_id"], d2.payload["dispatch_attempt"]) == (
                    d1.payload["dispatch_id"],
                    2,
                )
                assert (
                    await post(url, d2.body, {"Rebuno-Signature": d2.signature})
                ).status_code == 200
                await reached[2].wait()
                fetched = spy.count("get_execution")

                stale = await post(url, d1.body, {"Rebuno-Signature": d1.signature})
                await post(url, quiet, signed(quiet))
                assert spy.count("get_execution") == fetched  # ignored before any fetch

                gate.set()
                final = await client.wait(created.id)
                await agent.join()
                log_done = await events(client, created.id)

                late = await post(url, d2.body, {"Rebuno-Signature": d2.signature})
                await agent.join()
                log_late = await events(client, created.id)
            recorded = await steps(client, created.id)

    assert final.status == "completed", final.failure_reason
    assert final.output == {"first": "before done", "second": "after done"}
    assert runs == [1, 2]  # the stale delivery started nothing
    assert cancelled == [1]  # attempt 1's scope was cancelled...
    assert bodies == ["before", "after"]  # ...so it never reached `after`
    assert [name for name, outcome in spy.calls if outcome == "LeaseSuperseded"] == []
    assert spy.count("complete_execution") == 1
    assert stale.status_code == 200
    assert sorted((s.target, s.status) for s in recorded) == [
        ("after", "succeeded"),
        ("before", "succeeded"),
    ]
    # The terminal execution was fetched and skipped: nothing ran, nothing was written.
    assert late.status_code == 200
    assert runs == [1, 2]
    assert spy.names()[-1] == "get_execution"
    assert log_late == log_done


# -- heartbeats ---------------------------------------------------------------------------------


async def test_heartbeats_keep_a_handler_three_times_the_lease() -> None:
    """Lease 1 s; the handler takes about 3 s, half awaiting, half in a blocking
    sync tool (which runs in a worker thread, so the heartbeat goes on)."""

    @tool
    def crunch(seconds: float) -> str:
        time.sleep(seconds)  # blocking work, off the event loop
        return "crunched"

    async def process(input: Any) -> str:
        await anyio.sleep(1.5)  # the elapsed time is the point of this test
        return await crunch(1.5)

    with anyio.fail_after(20):
        async with (
            inprocess_kernel(lease_timeout_s=1.0, poll_interval_s=0.1) as k,
            Client(k.url) as client,
        ):
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent):
                started = anyio.current_time()
                created = await client.create(AGENT_ID, {})
                final = await client.wait(created.id)
                elapsed = anyio.current_time() - started
            log = await events(client, created.id)

    assert (final.status, final.output) == ("completed", "crunched")
    assert elapsed >= 3.0
    assert attempts(log, "dispatch.acked") == [1]  # never re-delivered
    assert attempts(log, "dispatch.queued") == [0]
    beats = [outcome for name, outcome in spy.calls if name == "heartbeat"]
    assert len(beats) >= 6  # every lease / 3
    # All renewed the lease; only one racing the completion may be cut short.
    assert set(beats[:-1]) == {"ok"}


# -- signing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("signing", ["v1", "body"])
async def test_agent_works_with_each_signing_form(signing: str) -> None:
    async def process(n: int) -> int:
        return int(await before() == "before done") + n

    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url, signing=signing)  # type: ignore[arg-type]
            async with served(k, process, agent=agent):
                final = await client.wait((await client.create(AGENT_ID, {"n": 41})).id)
    assert (final.status, final.output) == ("completed", 42)


async def test_body_signing_really_sends_the_body_form() -> None:
    """A kernel that refuses the body form refuses every call of a `body` agent."""

    async def process(input: Any) -> None:
        raise AssertionError("never runs: the execution cannot even be fetched")

    with anyio.fail_after(15):
        async with inprocess_kernel(allow_body_form=False) as k, Client(k.url) as client:
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url, signing="body")
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent):
                created = await client.create(AGENT_ID, {})
                await spy.wait_for("get_execution")
                await agent.join()
                current = await client.get(created.id)

    assert spy.calls[0] == ("set_metadata", "UnauthorizedError")
    assert ("get_execution", "UnauthorizedError") in spy.calls
    assert current.status == "running"


# -- a closed agent, and one mounted in a host app ----------------------------------------------


async def test_a_closed_agent_answers_503() -> None:
    """After `close()` a webhook is refused with 503, not acknowledged and
    dropped, so the kernel counts the delivery as failed and tries again."""
    runs: list[str] = []

    async def process(input: Any) -> str:
        runs.append(execution().id)
        return "ran"

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            Sink().serving() as sink,
        ):
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent, deliver=False) as running:
                await set_webhook(k, AGENT_ID, sink.url)
                await client.create(AGENT_ID, {})
                delivery = await sink.next()
                await agent.close()
                refused = await post(
                    running.webhook_url, delivery.body, {"Rebuno-Signature": delivery.signature}
                )
                unsigned = await post(running.webhook_url, delivery.body)

    assert refused.status_code == 503
    assert refused.json() == {"code": "internal_error", "message": "agent is closed"}
    assert unsigned.status_code == 401  # the signature is still checked first
    assert runs == []
    assert spy.count("get_execution") == 0


@asynccontextmanager
async def lifespan_of(app: Any) -> AsyncIterator[None]:
    """Run an ASGI app's lifespan, as a server would, for the block's duration."""
    to_app, app_inbox = anyio.create_memory_object_stream[dict[str, Any]](4)
    app_outbox, from_app = anyio.create_memory_object_stream[dict[str, Any]](4)
    async with anyio.create_task_group() as tg:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        tg.start_soon(app, scope, app_inbox.receive, app_outbox.send)
        await to_app.send({"type": "lifespan.startup"})
        assert (await from_app.receive())["type"] == "lifespan.startup.complete"
        yield
        await to_app.send({"type": "lifespan.shutdown"})
        assert (await from_app.receive())["type"] == "lifespan.shutdown.complete"
    for stream in (to_app, app_inbox, app_outbox, from_app):
        stream.close()


async def test_agent_app_mounted_in_a_starlette_host() -> None:
    """`Mount("/agent", app=agent.app)`: the webhook answers at
    /agent/webhook (matched below the ASGI root_path), and the agent runs from
    the host's lifespan, which enters `agent.running()` (a host does not pass
    lifespan events on to mounted apps)."""
    pytest.importorskip("starlette")
    from starlette.applications import Starlette
    from starlette.requests import Request as StarletteRequest
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    async def process(word: str) -> str:
        return (await before()) + " " + word.upper()

    async def health(request: StarletteRequest) -> PlainTextResponse:
        return PlainTextResponse("ok")

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            Sink().serving() as sink,
        ):
            await k.register(AGENT_ID, sink.url, SECRET)
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            agent.bind(process)

            @asynccontextmanager
            async def host_lifespan(app: Starlette) -> AsyncIterator[None]:
                async with agent.running():
                    yield

            host = Starlette(
                routes=[Route("/health", health), Mount("/agent", app=agent.app)],
                lifespan=host_lifespan,
            )
            transport = httpx.ASGITransport(app=host)
            async with (
                lifespan_of(host),
                httpx.AsyncClient(transport=transport, base_url="http://host.test") as http,
            ):
                created = await client.create(AGENT_ID, {"word": "hi"})
                delivery = await sink.next()
                headers = {"Rebuno-Signature": delivery.signature}
                unmounted = await http.post("/webhook", content=delivery.body, headers=headers)
                wrong = await http.post("/agent/other", content=delivery.body, headers=headers)
                accepted = await http.post("/agent/webhook", content=delivery.body, headers=headers)
                final = await client.wait(created.id)
                assert (await http.get("/health")).text == "ok"
            assert agent._kernel._http._is_closed  # the host's lifespan closed the agent

    assert (unmounted.status_code, wrong.status_code, accepted.status_code) == (404, 404, 200)
    assert wrong.json()["message"] == "no route for /agent/other"
    assert (final.status, final.output) == ("completed", "before done HI")

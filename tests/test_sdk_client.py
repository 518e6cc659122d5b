"""`Client`: create, get, list, events, cancel and wait against the real kernel
(in process), and the errors it raises, chosen by the envelope's code. The
bearer-token case runs against a real `rebuno server` process.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from kernels import inprocess_kernel
from procs import Kernel, reap
from sdk_support import AGENT_ID, served

from rebuno_anyio import (
    Client,
    ConflictError,
    NetworkError,
    NotFoundError,
    Terminated,
    UnauthorizedError,
    ValidationError,
    tool,
)

pytestmark = pytest.mark.anyio

UNKNOWN = "0192f1a0-0000-7000-8000-00000000000a"


async def echo(input: Any) -> Any:
    return {"echo": input}


async def test_create_get_list_events() -> None:
    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, echo),
        ):
            first = await client.create(AGENT_ID, {"n": 1}, idempotency_key="order-17")
            again = await client.create(AGENT_ID, {"n": 1}, idempotency_key="order-17")
            with pytest.raises(ConflictError, match="order-17"):
                await client.create(AGENT_ID, {"n": 2}, idempotency_key="order-17")
            second = await client.create(AGENT_ID, [1, 2], session="chat-9")
            bare = await client.create(AGENT_ID)
            done = [await client.wait(e.id) for e in (first, second, bare)]
            fetched = await client.get(first.id)
            everything = await client.list(agent_id=AGENT_ID)
            completed = await client.list(status="completed")
            page1 = await client.list(limit=2)
            page2 = await client.list(limit=2, cursor=page1.next_cursor)
            nobody = await client.list(agent_id="someone-else")
            log = await client.events(first.id)
            tail = await client.events(first.id, after_seq=log[2].event_seq)

    assert (first.agent_id, first.input, first.idempotency_key) == (AGENT_ID, {"n": 1}, "order-17")
    assert first.status in ("pending", "running")
    assert again.id == first.id  # the key deduplicates: the first execution comes back
    assert again.input == {"n": 1}
    assert second.session == "chat-9"
    assert bare.input is None
    assert [d.output for d in done] == [{"echo": {"n": 1}}, {"echo": [1, 2]}, {"echo": None}]
    assert (fetched.id, fetched.status, fetched.output) == (
        first.id,
        "completed",
        {"echo": {"n": 1}},
    )
    assert fetched.is_terminal
    newest_first = [bare.id, second.id, first.id]
    assert [e.id for e in everything.executions] == newest_first
    assert [e.id for e in completed.executions] == newest_first
    assert [e.id for e in page1.executions + page2.executions] == newest_first
    assert page1.next_cursor
    assert page2.next_cursor == ""
    assert nobody.executions == []
    types = [e.type for e in log]
    assert types[:3] == ["execution.created", "execution.started", "dispatch.queued"]
    assert types[-1] == "execution.completed"
    assert [e.event_seq for e in log] == list(range(1, len(log) + 1))
    assert {e.execution_id for e in log} == {first.id}
    assert tail == log[3:]


async def test_steps_of_an_execution() -> None:
    gate = anyio.Event()
    reached = anyio.Event()

    @tool
    async def shout(text: str) -> str:
        return text.upper()

    async def process(text: str) -> str:
        loud = await shout(text)
        reached.set()
        await gate.wait()
        return await shout(loud + "!")

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, process),
        ):
            created = await client.create(AGENT_ID, {"text": "hi"})
            await reached.wait()
            midway = await client.list_steps(created.id, status="terminal")
            gate.set()
            final = await client.wait(created.id)
            every = await client.list_steps(created.id)
            one = await client.get_step(created.id, midway[0].step_id)
            with pytest.raises(NotFoundError):
                await client.get_step(created.id, "0" * 64)

    assert final.output == "HI!"
    assert [(s.target, s.args, s.result, s.status) for s in midway] == [
        ("shout", {"text": "hi"}, "HI", "succeeded")
    ]
    assert sorted(s.result for s in every) == ["HI", "HI!"]
    assert one == midway[0]


async def test_events_long_poll_waits_for_the_next_event() -> None:
    gate = anyio.Event()
    polled: list[Any] = []

    async def process(input: Any) -> str:
        await gate.wait()
        return "late"

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, process),
        ):
            created = await client.create(AGENT_ID, {})
            log = await client.events(created.id)
            while "dispatch.acked" not in [e.type for e in log]:  # the handler is waiting now
                log += await client.events(created.id, after_seq=log[-1].event_seq, wait=5)
            last = log[-1].event_seq

            async def poll() -> None:
                polled.extend(await client.events(created.id, after_seq=last, wait=10))

            async with anyio.create_task_group() as tg:
                tg.start_soon(poll)
                gate.set()

    # Nothing was new until the handler finished: the poll waited for that.
    assert [(e.event_seq, e.type) for e in polled] == [(last + 1, "execution.completed")]


async def test_cancel_and_wait() -> None:
    reached = anyio.Event()

    async def process(input: Any) -> None:
        reached.set()
        await anyio.sleep_forever()

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, process),
        ):
            created = await client.create(AGENT_ID, {})
            await reached.wait()
            with pytest.raises(TimeoutError):
                await client.wait(created.id, timeout=0.3)
            await client.cancel(created.id)
            final = await client.wait(created.id)
            with pytest.raises(Terminated, match="execution is cancelled"):
                await client.cancel(created.id)

    assert (final.status, final.failure_reason) == ("cancelled", "client_cancelled")


async def test_cancelling_a_finished_execution_raises_terminated() -> None:
    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, echo),
        ):
            done = await client.wait((await client.create(AGENT_ID, {})).id)
            with pytest.raises(Terminated):
                await client.cancel(done.id)
            after = await client.get(done.id)
    assert (done.status, after.status) == ("completed", "completed")


async def test_errors_by_code() -> None:
    async with inprocess_kernel() as k, Client(k.url) as client:
        with pytest.raises(NotFoundError) as missing:
            await client.get(UNKNOWN)
        with pytest.raises(ValidationError) as invalid:
            await client.get("not-a-uuid")
        with pytest.raises(NotFoundError):
            await client.events(UNKNOWN)
        with pytest.raises(NotFoundError):
            await client.cancel(UNKNOWN)
        with pytest.raises(NotFoundError, match="agent 'nobody' is not registered"):
            await client.create("nobody", {})
        with pytest.raises(ValidationError, match="unknown status"):
            await client.list(status="bogus")
    assert (missing.value.code, missing.value.status_code) == ("not_found", 404)
    assert (invalid.value.code, invalid.value.status_code) == ("validation_error", 400)
    assert "must be a UUID" in invalid.value.message


async def test_unreachable_kernel_is_a_network_error() -> None:
    async with Client("http://127.0.0.1:9") as client:
        with pytest.raises(NetworkError, match=r"127\.0\.0\.1:9"):
            await client.get(UNKNOWN)


async def test_timeout_is_a_network_error_that_names_itself() -> None:
    with socket.socket() as sock:  # listens, never answers
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        async with Client(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=0.2) as client:
            with pytest.raises(NetworkError, match=r"events: ReadTimeout$"):
                await client.events(UNKNOWN)


@pytest.mark.parametrize("client_timeout", [0.5, 5.0])
async def test_wait_long_polls_whatever_the_client_timeout(client_timeout: float) -> None:
    """A handler slower than the client's request timeout: `wait` neither times
    out its long polls nor spins (a handful of requests, not hundreds)."""

    async def slow(input: Any) -> str:
        await anyio.sleep(0.8)  # longer than a 0.5 s request timeout: the point of the test
        return "slow"

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url, timeout=client_timeout) as client,
            served(k, slow),
        ):
            polls: list[float] = []
            follow = client.events

            async def counted(*args: Any, **kwargs: Any) -> Any:
                polls.append(kwargs.get("wait", 0))
                return await follow(*args, **kwargs)

            client.events = counted  # type: ignore[method-assign]
            created = await client.create(AGENT_ID, {})
            final = await client.wait(created.id)

    assert (final.status, final.output) == ("completed", "slow")
    assert 1 <= len(polls) <= 5
    assert all(wait >= 1 for wait in polls)


async def test_url_and_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REBUNO_URL", "http://env.example:1/")
    monkeypatch.setenv("REBUNO_API_KEY", "env-key")
    async with Client() as client:
        assert (client.base_url, client.api_key) == ("http://env.example:1", "env-key")
    async with Client("http://explicit:2", api_key="mine") as client:
        assert (client.base_url, client.api_key) == ("http://explicit:2", "mine")
    monkeypatch.delenv("REBUNO_URL")
    with pytest.raises(ValueError, match="REBUNO_URL"):
        Client()


# -- a real `rebuno server`: bearer tokens ------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    db: Path = tmp_path_factory.mktemp("server") / "kernel.db"
    kernel = Kernel(db, server_token="right-token")
    try:
        yield kernel
    finally:
        reap(kernel)


async def test_wrong_or_missing_token_is_unauthorized(server: Kernel) -> None:
    for key in ("wrong-token", ""):
        async with Client(server.url, api_key=key) as client:
            with pytest.raises(UnauthorizedError) as refused:
                await client.list()
            assert refused.value.status_code == 401
            with pytest.raises(UnauthorizedError):
                await client.create(AGENT_ID, {})
    async with Client(server.url, api_key="right-token") as client:
        assert (await client.list()).executions == []
        with pytest.raises(NotFoundError):
            await client.create(AGENT_ID, {})  # authorized now: the agent is just unknown

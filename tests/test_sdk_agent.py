"""`Agent`: construction, the handler's three input shapes, what a return value
must be, and the metadata the agent publishes (SEED 004, PROTOCOL.md §4.2, §5.3).

End-to-end tests run the real kernel in process and the agent on the SDK's own
server, on asyncio and on trio.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.tls import TLSListener
from kernels import InProcessKernel, inprocess_kernel
from pydantic import BaseModel
from sdk_support import AGENT_ID, SECRET, KernelSpy, served, set_webhook
from tls_support import self_signed

from rebuno_anyio import Agent, Client, Result, execution, tool
from rebuno_anyio.kernel import KernelConfig, serve_kernel
from rebuno_anyio.types import Execution

pytestmark = pytest.mark.anyio


class Question(BaseModel):
    prompt: str
    limit: int = 10


class Answer(BaseModel):
    text: str


async def run_once(process: Any, input: Any, *, agent: Agent | None = None) -> Execution:
    """Serve `process`, create one execution with `input`, return it once it ended."""
    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            served(k, process, agent=agent),
        ):
            created = await client.create(AGENT_ID, input)
            return await client.wait(created.id)


# -- construction -------------------------------------------------------------------


def test_explicit_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REBUNO_AGENT_SECRET", "from-env")
    monkeypatch.setenv("REBUNO_URL", "http://env.example:1")
    agent = Agent("a", secret="s3cret", base_url="http://kernel.example:8080/")
    assert (agent.agent_id, agent.secret) == ("a", "s3cret")
    assert agent.base_url == "http://kernel.example:8080"  # the trailing slash goes
    assert agent.webhook_path == "/webhook"
    assert (agent.description, agent.output_schema) == (None, None)


def test_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REBUNO_AGENT_SECRET", "from-env")
    monkeypatch.setenv("REBUNO_URL", "http://env.example:1234")
    agent = Agent("a")
    assert agent.secret == "from-env"
    assert agent.base_url == "http://env.example:1234"


def test_empty_id_is_refused() -> None:
    with pytest.raises(ValueError, match="agent_id must not be empty"):
        Agent("", secret="s", base_url="http://k:1")


def test_missing_secret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REBUNO_AGENT_SECRET", raising=False)
    with pytest.raises(ValueError, match="REBUNO_AGENT_SECRET"):
        Agent("a", base_url="http://k:1")
    with pytest.raises(ValueError, match="secret"):
        Agent("a", secret="", base_url="http://k:1")


def test_missing_url_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REBUNO_URL", raising=False)
    with pytest.raises(ValueError, match="REBUNO_URL"):
        Agent("a", secret="s")


def test_output_schema_as_dict_or_model() -> None:
    schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    assert Agent("a", secret="s", base_url="http://k:1", output_schema=schema).output_schema == (
        schema
    )
    from_model = Agent("a", secret="s", base_url="http://k:1", output_schema=Answer)
    assert from_model.output_schema == Answer.model_json_schema()
    assert from_model.output_schema["properties"]["text"]["type"] == "string"
    with pytest.raises(TypeError, match="output_schema"):
        Agent("a", secret="s", base_url="http://k:1", output_schema="text")  # type: ignore[arg-type]


def test_bad_webhook_path_and_signing_are_refused() -> None:
    with pytest.raises(ValueError, match="webhook_path"):
        Agent("a", secret="s", base_url="http://k:1", webhook_path="hook")
    with pytest.raises(ValueError, match="signing"):
        Agent("a", secret="s", base_url="http://k:1", signing="v2")  # type: ignore[arg-type]


async def test_serve_without_a_handler_is_refused() -> None:
    agent = Agent("a", secret="s", base_url="http://127.0.0.1:9")
    with pytest.raises(RuntimeError, match="bind a handler first"):
        await agent.serve()


# -- the handler's three input shapes ---------------------------------------------------


async def test_keyword_fields_with_defaults() -> None:
    calls: list[dict[str, Any]] = []

    async def process(prompt: str, limit: int = 10, *, style: str = "plain") -> dict[str, Any]:
        calls.append({"prompt": prompt, "limit": limit, "style": style})
        return {"echo": prompt * limit}

    done = await run_once(process, {"prompt": "ab", "limit": 2, "unrelated": True})
    assert done.status == "completed", done.failure_reason
    assert done.output == {"echo": "abab"}
    assert calls == [{"prompt": "ab", "limit": 2, "style": "plain"}]

    calls.clear()
    done = await run_once(process, {"prompt": "x", "style": "loud"})
    assert done.output == {"echo": "x" * 10}  # the default filled in
    assert calls == [{"prompt": "x", "limit": 10, "style": "loud"}]


async def test_single_pydantic_model() -> None:
    seen: list[Any] = []

    async def process(data: Question) -> str:
        seen.append(data)
        return f"{data.prompt}/{data.limit}"

    done = await run_once(process, {"prompt": "hi", "limit": "3"})  # pydantic coerces "3"
    assert done.status == "completed", done.failure_reason
    assert done.output == "hi/3"
    assert seen == [Question(prompt="hi", limit=3)]
    assert isinstance(seen[0], Question)


@pytest.mark.parametrize("shape", ["dict", "dict[str, Any]", "Any", "unannotated"])
async def test_raw_passthrough(shape: str) -> None:
    seen: list[Any] = []

    async def as_dict(input: dict) -> Any:  # type: ignore[type-arg]
        seen.append(input)
        return input

    async def as_typed_dict(input: dict[str, Any]) -> Any:
        seen.append(input)
        return input

    async def as_any(input: Any) -> Any:
        seen.append(input)
        return input

    async def unannotated(input):  # type: ignore[no-untyped-def]
        seen.append(input)
        return input

    process = {
        "dict": as_dict,
        "dict[str, Any]": as_typed_dict,
        "Any": as_any,
        "unannotated": unannotated,
    }[shape]
    value = {"anything": [1, {"nested": None}], "prompt": 5}
    done = await run_once(process, value)
    assert done.status == "completed", done.failure_reason
    assert seen == [value]
    assert done.output == value


async def test_raw_passthrough_gets_non_object_input_unchanged() -> None:
    seen: list[Any] = []

    async def process(input: Any) -> int:
        seen.append(input)
        return len(input)

    done = await run_once(process, ["a", "b", "c"])
    assert (done.status, done.output, seen) == ("completed", 3, [["a", "b", "c"]])


async def test_missing_required_fields_fail_before_the_handler_runs() -> None:
    calls: list[object] = []

    async def process(a: int, b: str, c: int = 0) -> None:
        calls.append((a, b, c))

    done = await run_once(process, {"c": 1})
    assert done.status == "failed"
    assert done.failure_reason == "input_invalid: missing required input fields: a, b"
    assert calls == []

    done = await run_once(process, None)  # no input at all: every required field is missing
    assert done.failure_reason == "input_invalid: missing required input fields: a, b"
    assert calls == []


async def test_pydantic_validation_error_fails_before_the_handler_runs() -> None:
    calls: list[object] = []

    async def process(data: Question) -> None:
        calls.append(data)

    done = await run_once(process, {"prompt": "hi", "limit": "lots"})
    assert done.status == "failed"
    assert done.failure_reason.startswith("input_invalid: input validation failed: ")
    assert "limit" in done.failure_reason
    assert calls == []


class Opaque:
    pass


@pytest.mark.parametrize(
    ("returned", "what"),
    [
        ({"when": Opaque()}, "the handler's return value"),
        (float("nan"), "the handler's return value"),
        (Result(output="fine", state={"set": {1, 2}}), "Result.state"),
    ],
)
async def test_non_json_return_value_fails_the_execution(returned: Any, what: str) -> None:
    async def process(input: Any) -> Any:
        return returned

    done = await run_once(process, {})
    assert done.status == "failed"
    assert done.failure_reason.startswith(
        f"agent_error: TypeError: {what} must be JSON-serializable"
    )


async def test_sync_handler_runs_in_a_worker_thread() -> None:
    import threading

    threads: list[int] = []

    def process(n: int) -> int:
        threads.append(threading.get_ident())
        return n * 2

    done = await run_once(process, {"n": 21})
    assert (done.status, done.output) == ("completed", 42)
    assert threads != [threading.get_ident()]


# -- metadata ---------------------------------------------------------------------------


async def test_metadata_is_published_at_start_and_not_again() -> None:
    async def process(prompt: str, limit: int = 10) -> dict[str, str]:
        return {"text": prompt}

    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = Agent(
                AGENT_ID,
                secret=SECRET,
                base_url=k.url,
                description="Answers prompts.",
                output_schema=Answer,
            )
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent):
                await spy.wait_for("set_metadata")
                record = await client.get_agent(AGENT_ID)
                created = await client.create(AGENT_ID, {"prompt": "hi"})
                done = await client.wait(created.id)

    assert agent._kernel._http._is_closed  # serve() cancelled: its client is closed
    assert spy.calls[0] == ("set_metadata", "ok")  # at start, before any dispatch
    assert record.description == "Answers prompts."
    assert record.output_schema == Answer.model_json_schema()
    assert record.input_schema["required"] == ["prompt"]
    assert record.input_schema["properties"]["prompt"]["type"] == "string"
    assert record.input_schema["properties"]["limit"] == {
        "default": 10,
        "title": "Limit",
        "type": "integer",
    }
    assert done.status == "completed"
    assert spy.count("set_metadata") == 1  # published: the dispatch did not repeat it


async def test_model_and_raw_handlers_publish_their_input_schema() -> None:
    async def modelled(data: Question) -> None:
        return None

    async def raw(input: dict[str, Any]) -> None:
        return None

    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client:
            found = []
            for process in (modelled, raw):
                agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
                spy = KernelSpy(agent)
                async with served(k, process, agent=agent):
                    await spy.wait_for("set_metadata")
                    found.append(await client.get_agent(AGENT_ID))

    assert found[0].input_schema == Question.model_json_schema()
    assert found[1].input_schema is None  # raw passthrough has no schema
    assert found[1].description is None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def kernel_on(port: int) -> AsyncIterator[InProcessKernel]:
    """The real kernel in process, on a port chosen in advance."""
    async with anyio.create_task_group() as tg:
        running = await tg.start(serve_kernel, KernelConfig(db="memory://", port=port))
        yield InProcessKernel(url=f"http://127.0.0.1:{port}", running=running)
        running.server.shutdown()
        tg.cancel_scope.cancel()


async def test_metadata_is_retried_on_first_dispatch_after_a_network_failure() -> None:
    """The agent starts before its kernel is reachable: publishing fails with a
    network error (`KernelUnreachable`, once the refused connection has been
    retried for min(kernel_timeout, 30) s), and the first webhook (once the
    kernel is up) publishes it."""

    async def process(prompt: str) -> str:
        return prompt.upper()

    port = free_port()
    agent = Agent(
        AGENT_ID,
        secret=SECRET,
        base_url=f"http://127.0.0.1:{port}",
        description="up",
        kernel_timeout=1.0,  # the retry budget for a refused connection
    )
    spy = KernelSpy(agent)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            agent_port = await tg.start(
                lambda task_status: agent.serve(
                    process, host="127.0.0.1", port=0, task_status=task_status
                )
            )
            await spy.wait_for("set_metadata", outcome="KernelUnreachable")
            async with kernel_on(port) as k, Client(k.url) as client:
                await k.register(AGENT_ID, "http://127.0.0.1:9/webhook", SECRET)
                assert (await client.get_agent(AGENT_ID)).description is None
                await set_webhook(k, AGENT_ID, f"http://127.0.0.1:{agent_port}/webhook")
                created = await client.create(AGENT_ID, {"prompt": "hi"})
                done = await client.wait(created.id)
                await spy.wait_for("set_metadata", outcome="ok")
                record = await client.get_agent(AGENT_ID)
            tg.cancel_scope.cancel()

    assert (done.status, done.output) == ("completed", "HI")
    assert spy.count("set_metadata") == 2
    assert record.description == "up"
    assert record.input_schema["required"] == ["prompt"]


# -- lifecycle --------------------------------------------------------------------------


async def test_join_waits_for_overlapping_handlers() -> None:
    """join() started while one handler runs returns once it and a handler
    that started later have both finished."""
    gates = {"a": anyio.Event(), "b": anyio.Event()}
    reached = {"a": anyio.Event(), "b": anyio.Event()}
    joined = anyio.Event()

    async def process(name: str) -> str:
        reached[name].set()
        await gates[name].wait()
        return name

    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            async with served(k, process, agent=agent):
                first = await client.create(AGENT_ID, {"name": "a"})
                await reached["a"].wait()

                async def join() -> None:
                    await agent.join()
                    joined.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(join)
                    second = await client.create(AGENT_ID, {"name": "b"})
                    await reached["b"].wait()
                    gates["a"].set()
                    await client.wait(first.id)
                    assert not joined.is_set()  # b still runs
                    gates["b"].set()
                    await joined.wait()
                assert (await client.get(second.id)).status == "completed"


async def test_close_cancels_running_handlers_and_closes_the_kernel_client() -> None:
    reached = anyio.Event()
    cancelled: list[str] = []

    async def process(input: Any) -> None:
        reached.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(execution().id)
            raise

    with anyio.fail_after(15):
        async with inprocess_kernel() as k, Client(k.url) as client:
            agent = Agent(AGENT_ID, secret=SECRET, base_url=k.url)
            async with served(k, process, agent=agent):
                created = await client.create(AGENT_ID, {})
                await reached.wait()
                await agent.close()
                assert agent._kernel._http._is_closed
                current = await client.get(created.id)

    assert cancelled == [created.id]
    assert current.status == "running"  # nothing reported: the kernel re-delivers later


# -- a kernel behind TLS ------------------------------------------------------------------


@asynccontextmanager
async def tls_proxy(upstream_port: int, context: ssl.SSLContext) -> AsyncIterator[int]:
    """Terminate TLS on a loopback port and relay to `upstream_port` (as a
    reverse proxy in front of the kernel would); yields the TLS port."""

    async def relay(source: ByteStream, sink: ByteStream) -> None:
        with suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in source:
                await sink.send(chunk)

    async def handle(client: ByteStream) -> None:
        async with (
            client,
            await anyio.connect_tcp("127.0.0.1", upstream_port) as upstream,
            anyio.create_task_group() as pair,
        ):

            async def one_way(source: ByteStream, sink: ByteStream) -> None:
                await relay(source, sink)
                pair.cancel_scope.cancel()  # either side done: the connection is

            pair.start_soon(one_way, client, upstream)
            pair.start_soon(one_way, upstream, client)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as tcp:
        listener = TLSListener(tcp, context, standard_compatible=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handle, tg)
            yield tcp.extra(SocketAttribute.local_port)
            tg.cancel_scope.cancel()


@tool
async def shout(word: str) -> str:
    return word.upper()


async def test_agent_talks_to_an_https_kernel_with_a_private_ca(tmp_path: Path) -> None:
    """`Agent(base_url="https://...", ssl_context=...)`: every kernel call goes
    over TLS, verified against the CA the context trusts."""
    certificate = self_signed(tmp_path)

    async def process(word: str) -> str:
        return await shout(word)

    with anyio.fail_after(15):
        async with (
            inprocess_kernel() as k,
            Client(k.url) as client,
            tls_proxy(k.running.port, certificate.server_context()) as tls_port,
        ):
            agent = Agent(
                AGENT_ID,
                secret=SECRET,
                base_url=f"https://127.0.0.1:{tls_port}",
                ssl_context=certificate.client_context(),
            )
            spy = KernelSpy(agent)
            async with served(k, process, agent=agent):
                final = await client.wait((await client.create(AGENT_ID, {"word": "hi"})).id)

    assert (final.status, final.output) == ("completed", "HI"), final.failure_reason
    assert ("complete_execution", "ok") in spy.calls
    assert agent._kernel._http._is_tls

"""Real processes for end-to-end tests: a kernel (`rebuno dev`) and agents,
each on a loopback port it picks itself (port 0) and announces on stderr.

Tests wait on the announcement line itself, never on a timer; every wait has a
deadline so a broken process fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
STARTUP_S = 30.0

P = TypeVar("P", bound="Proc")


class Proc:
    """A child process whose stderr is read line by line in a thread."""

    def __init__(
        self, args: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.args = list(args)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=str(cwd or ROOT),
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._pumps = [
            threading.Thread(target=self._pump, args=(stream,), daemon=True)
            for stream in (self.popen.stderr, self.popen.stdout)
        ]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = STARTUP_S) -> re.Match[str]:
        """Block until an output line matches `pattern` (or fail with the output)."""
        regex = re.compile(pattern)
        closed = 0
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"{self.args[:4]}: no line matching {pattern!r} within {timeout}s:\n"
                    + "\n".join(self.lines[-40:])
                ) from None
            if line is None:
                closed += 1
                if closed == 2:
                    raise AssertionError(
                        f"{self.args[:4]} exited ({self.popen.wait()}) before {pattern!r}:\n"
                        + "\n".join(self.lines[-40:])
                    )
                continue
            self.lines.append(line)
            match = regex.search(line)
            if match:
                return match

    def _close_pipes(self) -> None:
        # The readers end at EOF once the process group is gone; only then may
        # the pipes close (an unclosed pipe is a ResourceWarning, an error here).
        for pump in self._pumps:
            pump.join(timeout=10)
        if any(p.is_alive() for p in self._pumps):
            return
        while True:  # keep what the process said last
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)
        self._close_pipes()

    def stop(self) -> int:
        """SIGTERM, then wait for a clean exit."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()
        return self.popen.returncode

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class Kernel(Proc):
    """`rebuno dev` on a free loopback port."""

    def __init__(
        self,
        db: Path | str,
        *,
        lease_timeout: float = 120,
        extra: Sequence[str] = (),
        server_token: str | None = None,
    ) -> None:
        args = [PYTHON, "-m", "rebuno_anyio.cli"]
        if server_token is None:
            args += ["dev"]
        else:
            args += ["server", "--bearer-token", server_token]
        args += [
            "--db",
            str(db),
            "--port",
            "0",
            "--lease-timeout",
            str(lease_timeout),
            "--log-level",
            "warning",
            *extra,
        ]
        super().__init__(args)
        match = self.wait_for(r"listening on (http://127\.0\.0\.1:(\d+))")
        self.url = match.group(1)
        self.port = int(match.group(2))
        self.token = server_token

    def call(
        self, method: str, path: str, body: Any = None, *, token: str | None = None
    ) -> tuple[int, Any]:
        """A plain HTTP call (bearer auth if a token is set); returns (status, JSON or None)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        bearer = token if token is not None else self.token
        if bearer:
            request.add_header("Authorization", f"Bearer {bearer}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                raw = response.read()
                return response.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as err:
            raw = err.read()
            return err.code, json.loads(raw) if raw else None

    def register(self, agent_id: str, webhook_url: str, secret: str) -> None:
        status, body = self.call(
            "POST", "/v0/agents", {"id": agent_id, "webhook_url": webhook_url, "secret": secret}
        )
        assert status == 201, body

    def wait_terminal(self, execution_id: str, timeout: float = 60) -> dict[str, Any]:
        """Follow the event log with long polls until the execution ends."""
        import time

        deadline = time.monotonic() + timeout
        after = 0
        while True:
            status, execution = self.call("GET", f"/v0/executions/{execution_id}")
            assert status == 200, execution
            if execution["status"] in ("completed", "failed", "cancelled"):
                return execution
            remaining = deadline - time.monotonic()
            assert remaining > 0, (
                f"execution {execution_id} still {execution['status']} after {timeout}s"
            )
            _, events = self.call(
                "GET",
                f"/v0/executions/{execution_id}/events"
                f"?after_seq={after}&wait={max(1, min(int(remaining), 10))}",
            )
            if events:
                after = events[-1]["event_seq"]

    def events(self, execution_id: str) -> list[dict[str, Any]]:
        status, events = self.call("GET", f"/v0/executions/{execution_id}/events?limit=1000")
        assert status == 200, events
        return events


class AgentProc(Proc):
    """A Python agent script that announces `listening on http://host:port/...`."""

    def __init__(self, script: Path | str, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__([PYTHON, str(script), *args], env=env)
        match = self.wait_for(r"listening on (http://127\.0\.0\.1:(\d+))(/\S*)?")
        self.base = match.group(1)
        self.port = int(match.group(2))
        self.webhook_url = self.base + (match.group(3) or "/webhook")


def reap(proc: Proc, *, graceful: bool = False) -> int:
    """Stop (SIGTERM, if `graceful`) or kill `proc`, wait, close its pipes.

    Returns:
        The exit status; everything the process printed is in `proc.lines`.
    """
    if graceful:
        return proc.stop()
    proc.kill()
    return proc.popen.returncode


@contextmanager
def running(proc: P) -> Iterator[P]:
    """`with running(AgentProc(...)) as agent:` -- killed and reaped on exit."""
    try:
        yield proc
    finally:
        reap(proc)


def free_port() -> int:
    """A loopback port nobody listens on right now (bound to 0, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

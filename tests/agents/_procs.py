"""Helpers the kernel's process tests share (beside `tests/procs.py`).

`procs.Proc` reads a child's output in threads and never closes the pipes; with
warnings as errors, an unclosed pipe found by the garbage collector fails some
later test. `reap` ends the child and closes its pipes once both reader threads
have seen the end of them.
"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from procs import Proc

P = TypeVar("P", bound=Proc)


def reap(proc: Proc, *, graceful: bool = False) -> int:
    """Stop (SIGTERM, `graceful`) or kill the process, wait, close its pipes.

    Returns:
        The exit status.
    """
    if graceful:
        status = proc.stop()
    else:
        proc.kill()
        status = proc.popen.returncode
    ends, deadline = 0, time.monotonic() + 10
    while ends < 2:
        try:
            line = proc._queue.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            ends += 1
        else:
            proc.lines.append(line)
    for stream in (proc.popen.stdout, proc.popen.stderr):
        if stream is not None:
            stream.close()
    return int(status)


@contextmanager
def running(proc: P) -> Iterator[P]:
    """`with running(AgentProc(...)) as agent:` -- killed and reaped on exit."""
    try:
        yield proc
    finally:
        reap(proc)


def free_port() -> int:
    """A loopback port nobody listens on right now (bind to 0, then close)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

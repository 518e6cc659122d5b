"""The one gate the test agents wait at: a file the test creates.

The gate stands for an outside condition a long tool body waits on. It is a
file written by another process (the test), which no event in the agent's
process can announce, so this -- and only this -- polls; the tests themselves
wait on the agents' output lines and the kernel's long polls, never on time.
Call it in a worker thread (`anyio.to_thread.run_sync(..., abandon_on_cancel=True)`)
so a superseded handler is not held up by it.
"""

from __future__ import annotations

import os
import time

__all__ = ["wait_for_gate"]

_POLL_S = 0.02


def wait_for_gate(path: str) -> None:
    """Block until the file at `path` exists."""
    while not os.path.exists(path):
        time.sleep(_POLL_S)

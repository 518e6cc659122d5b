"""`FakeClock`: the test kernel's wall clock, which moves only when told to."""

from __future__ import annotations

import time

__all__ = ["FakeClock"]


class FakeClock:
    """Unix seconds that stand still until `advance` moves them.

    The kernel reads it for lease timeouts, approval deadlines, delivery backoff
    and event times; the agent signs its requests with it, so both sides agree
    however far it has been moved.

    Args:
        start: the first reading; default: the real time now.
    """

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else float(start)

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward.

        Raises:
            ValueError: `seconds` is negative (time never goes back).
        """
        if not seconds >= 0:
            raise ValueError(f"the clock only moves forward, got {seconds!r} s")
        self._now += seconds

"""Test your agent offline: its real handler, tools and steps against an
in-process kernel, on asyncio or trio, with faults you ask for.

```python
async with AgentHarness(agent, process, crash_after_steps=2) as h:
    run = await h.run({"order": 42})
    assert run.status == "completed"
```

* `AgentHarness` runs a kernel on the memory store and your agent in memory
  (no ports, no sockets), joined by the real HTTP handlers, wire encoding and
  signatures; time in the kernel is a `FakeClock` that moves only when you
  `advance` it.
* Faults: `crash_next_delivery` (or `crash_after_steps=`), `duplicate_next_webhook`,
  `resend_last_webhook`, `expire_lease`, `deny=` and `require_approval=` with
  `grant_approval` / `deny_approval` and `advance` for expiry.
* What you assert on: `wait`, `execution`, `steps`, `events`, `approvals`,
  `deliveries` (`Delivery`) and `runs` (`HandlerRun`).

It needs no test framework; docs/testing.md shows it under pytest's anyio plugin.
"""

from ._clock import FakeClock
from ._harness import TERMINAL, AgentHarness
from ._policy import DENY_RULE, HOLD_RULE
from ._records import Delivery, HandlerRun, HarnessError, HarnessTimeout

__all__ = [
    "DENY_RULE",
    "HOLD_RULE",
    "TERMINAL",
    "AgentHarness",
    "Delivery",
    "FakeClock",
    "HandlerRun",
    "HarnessError",
    "HarnessTimeout",
]

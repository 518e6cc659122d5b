"""The kernel's Prometheus metrics (`GET /metrics`, PROTOCOL.md §4.5).

Each kernel has its own registry, so several kernels in one process (tests,
embedding) never mix their figures. What is counted:

* `rebuno_events_total{type}`: every event committed, by type -- so step
  decisions (`step.allowed`, `step.denied`...), executions created and ended,
  deliveries acked and failed, approvals, all from the one source of truth;
* `rebuno_http_requests_total{route, status}` and
  `rebuno_http_request_seconds{route}`: the API's traffic, by route pattern;
* `rebuno_store_commands_total{outcome}`: kernel commands run against the store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rebuno_proto import Event

__all__ = ["CONTENT_TYPE", "KernelMetrics"]

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST
_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class KernelMetrics:
    """Counters and histograms for one kernel."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._events = Counter(
            "rebuno_events", "Events committed to execution logs.", ["type"], registry=self.registry
        )
        self._requests = Counter(
            "rebuno_http_requests",
            "HTTP requests answered, by route pattern and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "rebuno_http_request_seconds",
            "Time to answer an HTTP request, by route pattern.",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._commands = Counter(
            "rebuno_store_commands",
            "Kernel commands run in a store transaction.",
            ["outcome"],
            registry=self.registry,
        )
        # Label lookups cost more than increments: keep the children.
        self._event_children: dict[str, Counter] = {}
        self._ok = self._commands.labels("ok")
        self._error = self._commands.labels("error")

    def committed(self, events: Iterable[Event]) -> None:
        for event in events:
            child = self._event_children.get(event.type)
            if child is None:
                child = self._event_children[event.type] = self._events.labels(event.type)
            child.inc()

    def command(self, *, ok: bool) -> None:
        (self._ok if ok else self._error).inc()

    def request(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route, str(status)).inc()
        self._latency.labels(route).observe(seconds)

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        return generate_latest(self.registry)

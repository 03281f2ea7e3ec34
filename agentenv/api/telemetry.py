"""A node's Prometheus metrics (served at ``/metrics`` by ``agentenv.observability``):

- ``aenv_http_request_duration_seconds``: every request, by route template (sandbox
  traffic the node proxies is ``route="sandbox-traffic"``);
- ``aenv_sandbox_operation_seconds{operation, outcome}``: create, pause, resume (a
  connect that resumed or adopted), fork, as the API called them;
- ``aenv_sandboxes{state}``, ``aenv_vmms``, ``aenv_cache_used_bytes``,
  ``aenv_cache_limit_bytes``, ``aenv_cache_entries``, ``aenv_allocated_vcpus``,
  ``aenv_allocated_memory_bytes``, ``aenv_disk_free_bytes``: read from the node's status
  when scraped, so they are never stale.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agentenv.api.nodes import NodeBook
from agentenv.observability import LATENCY_BUCKETS
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.states import SandboxState

T = TypeVar("T")


class _StatusCollector(Collector):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self.orchestrator.node_status()
        by_state = GaugeMetricFamily(
            "aenv_sandboxes", "Sandboxes on this node by state", labels=["state"]
        )
        for state in SandboxState:
            by_state.add_metric([state.value], status.sandboxes_by_state.get(state.value, 0))
        yield by_state
        yield GaugeMetricFamily("aenv_vmms", "VMM processes this node drives", value=status.vmms)
        yield GaugeMetricFamily(
            "aenv_cache_used_bytes",
            "Bytes of the node cache (what it fetched from the repository) in use",
            value=status.cache_used_bytes,
        )
        yield GaugeMetricFamily(
            "aenv_cache_limit_bytes", "The node cache's limit", value=status.cache_limit_bytes
        )
        yield GaugeMetricFamily(
            "aenv_cache_entries", "Snapshots in the node cache", value=status.cache_entries
        )
        yield GaugeMetricFamily(
            "aenv_allocated_vcpus",
            "vCPUs of sandboxes holding a VM (paused ones excluded)",
            value=status.allocated_vcpus,
        )
        yield GaugeMetricFamily(
            "aenv_allocated_memory_bytes",
            "Memory of sandboxes holding a VM (paused ones excluded)",
            value=status.allocated_memory_mib << 20,
        )
        yield GaugeMetricFamily(
            "aenv_disk_free_bytes",
            "Free bytes on the data directory's filesystem",
            value=status.disk.free_bytes,
        )


class NodeTelemetry:
    """The node's registry and what the API records into it."""

    def __init__(self, orchestrator: Orchestrator, book: NodeBook) -> None:
        self.registry = CollectorRegistry()
        self.book = book
        self.operations = Histogram(
            "aenv_sandbox_operation_seconds",
            "Time a sandbox lifecycle operation took, by outcome (ok or error)",
            ["operation", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.creates = Counter(
            "aenv_sandbox_creates",
            "Sandbox creates by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(_StatusCollector(orchestrator))

    async def timed(self, operation: str, work: Awaitable[T]) -> T:
        """``work``'s result, its duration recorded under ``operation``."""
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await work
            outcome = "ok"
            return result
        finally:
            self.operations.labels(operation, outcome).observe(time.perf_counter() - started)
            if operation == "create":
                self.creates.labels(outcome).inc()
                self.book.count_create(outcome == "ok")

"""Choosing a node for a new sandbox. A strategy sees the up nodes with their load
(reported allocation plus reservations the scheduler made since) and the request;
:class:`LeastLoaded` is the default, and any object with ``choose`` can replace it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agentenv.cluster.models import NodeInfo


@dataclass(frozen=True)
class Candidate:
    """An up node and what is allocated on it, reservations included."""

    node: NodeInfo
    vcpus: int
    memory_mib: int

    @property
    def node_id(self) -> str:
        return self.node.node_id


@dataclass(frozen=True)
class Demand:
    template_id: str
    vcpus: int | None = None
    memory_mib: int | None = None
    #: Nodes not to place on: ones that refused this create already (another mode, or
    #: no room on their host).
    exclude_nodes: frozenset[str] = frozenset()


class PlacementStrategy(Protocol):
    def choose(self, candidates: Sequence[Candidate], demand: Demand) -> Candidate | None:
        """The node to place ``demand`` on, or None when none can take it."""
        ...


@dataclass(frozen=True)
class LeastLoaded:
    """The node with the most room left, among those where the sandbox fits under the
    overcommit ratio (allocated + requested ≤ capacity x ratio, for vCPUs and memory
    both). Nodes that already hold the template (or snapshot) come first: a sandbox
    starts there without fetching anything. Ties go to fewer sandboxes, then the id, so
    the choice is deterministic."""

    overcommit: float = 1.0

    def fits(self, candidate: Candidate, demand: Demand) -> bool:
        report = candidate.node.report
        if report.problem is not None:
            return False
        vcpus = demand.vcpus or report.sandbox_vcpus
        memory = demand.memory_mib or report.sandbox_memory_mib
        return (
            candidate.vcpus + vcpus <= report.cpu_count * self.overcommit
            and candidate.memory_mib + memory <= report.memory_mib * self.overcommit
        )

    @staticmethod
    def load(candidate: Candidate) -> float:
        report = candidate.node.report
        return max(candidate.vcpus / report.cpu_count, candidate.memory_mib / report.memory_mib)

    def choose(self, candidates: Sequence[Candidate], demand: Demand) -> Candidate | None:
        fitting = [c for c in candidates if self.fits(c, demand)]
        if not fitting:
            return None
        holding = [c for c in fitting if demand.template_id in c.node.report.templates]
        pool = holding or fitting
        return min(
            pool,
            key=lambda c: (self.load(c), len(c.node.report.sandboxes), c.node_id),
        )

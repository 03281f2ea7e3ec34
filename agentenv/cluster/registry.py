"""The scheduler's node registry: nodes fed by heartbeats, marked down when they stop,
reservations for placements not yet visible in a report, and the sandbox→node bindings
(kept in a :class:`~agentenv.cluster.bindings.BindingStore`).

A node's roster is the truth about which sandboxes it holds: each heartbeat binds every
sandbox on it to it, and unbinds sandboxes bound to it that it no longer reports, unless
they were bound within ``binding_grace`` seconds (a create that finished after the node
collected its report). So a scheduler that lost its bindings relearns them within one
heartbeat interval.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from agentenv.cluster.bindings import BindingStore, BoundEntry
from agentenv.cluster.models import Binding, NodeInfo, NodeReport, NodeState
from agentenv.cluster.placement import Candidate, Demand, PlacementStrategy

log = logging.getLogger("agentenv.cluster.registry")


class NoCapacity(Exception):
    """No up node can take the sandbox."""

    def __init__(self, demand: Demand, nodes_up: int) -> None:
        super().__init__(
            f"no node can take a sandbox of template {demand.template_id!r} ({nodes_up} node(s) up)"
        )
        self.demand = demand
        self.nodes_up = nodes_up


class UnknownNode(Exception):
    def __init__(self, node_id: str) -> None:
        super().__init__(f"node {node_id!r} is not known to the scheduler")
        self.node_id = node_id


@dataclass
class _Reservation:
    node_id: str
    vcpus: int
    memory_mib: int
    made_at: float
    sandbox_id: str | None = None


@dataclass
class _Node:
    report: NodeReport
    state: NodeState
    last_seen: float
    reservations: dict[str, _Reservation] = field(default_factory=dict)

    def info(self) -> NodeInfo:
        return NodeInfo(
            report=self.report,
            state=self.state,
            lastSeen=datetime.fromtimestamp(self.last_seen, UTC),
        )


class NodeRegistry:
    def __init__(
        self,
        store: BindingStore,
        strategy: PlacementStrategy,
        *,
        node_timeout: float = 10.0,
        binding_grace: float = 30.0,
        reservation_ttl: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.strategy = strategy
        self.node_timeout = node_timeout
        self.binding_grace = binding_grace
        self.reservation_ttl = reservation_ttl
        self.clock = clock
        self._nodes: dict[str, _Node] = {}
        # Node URLs discovery listed at its last look.
        self._discovered: set[str] = set()

    async def load(self) -> None:
        """The nodes the store remembers, up until they miss ``node_timeout`` from now:
        a restarted scheduler can route to them before their next heartbeat."""
        now = self.clock()
        for report in await self.store.nodes():
            self._nodes.setdefault(report.node_id, _Node(report, NodeState.UP, now))

    # -- node state ----------------------------------------------------------------------
    def _set_state(self, node: _Node, state: NodeState) -> None:
        """The one place a node's state changes."""
        if node.state is not state:
            log.info("node %s is %s", node.report.node_id, state.value)
            node.state = state

    async def heartbeat(self, report: NodeReport) -> NodeInfo:
        now = self.clock()
        node = self._nodes.get(report.node_id)
        if node is None:
            node = self._nodes[report.node_id] = _Node(report, NodeState.UP, now)
            log.info("node %s joined at %s", report.node_id, report.url)
        node.report = report
        node.last_seen = now
        self._set_state(node, NodeState.UP)
        await self.store.save_node(report)
        await self._follow_roster(node, now)
        return node.info()

    async def _follow_roster(self, node: _Node, now: float) -> None:
        roster = set(node.report.sandboxes)
        node_id = node.report.node_id
        bindings = await self.store.all()
        for sandbox_id in roster:
            entry = bindings.get(sandbox_id)
            if entry is None or entry.node_id != node_id:
                await self.store.put(sandbox_id, BoundEntry(node_id, now))
        gone = [
            sandbox_id
            for sandbox_id, entry in bindings.items()
            if entry.node_id == node_id
            and sandbox_id not in roster
            and entry.bound_at < now - self.binding_grace
        ]
        await self.store.delete(*gone)
        for key, reservation in list(node.reservations.items()):
            stale = reservation.made_at < now - self.reservation_ttl
            if stale or (reservation.sandbox_id is not None and reservation.sandbox_id in roster):
                del node.reservations[key]

    def mark_silent_down(self) -> list[str]:
        """Nodes whose last heartbeat is older than ``node_timeout`` become down; returns
        the ids of those that just did."""
        now = self.clock()
        downed = []
        for node in self._nodes.values():
            if node.state is NodeState.UP and node.last_seen < now - self.node_timeout:
                self._set_state(node, NodeState.DOWN)
                downed.append(node.report.node_id)
        return downed

    def follow_discovery(self, urls: set[str]) -> list[str]:
        """Discovery (``discovery``) listed ``urls`` now: up nodes whose URL it listed
        before and lists no more become down; returns their ids. (Nodes never listed
        are left to their heartbeats: a list that lags must not down a new node.)"""
        vanished = self._discovered - urls
        self._discovered = set(urls)
        downed = []
        for node in self._nodes.values():
            if node.state is NodeState.UP and node.report.url.rstrip("/") in vanished:
                self._set_state(node, NodeState.DOWN)
                downed.append(node.report.node_id)
        return downed

    def discovered(self) -> set[str]:
        return set(self._discovered)

    async def forget(self, node_id: str) -> None:
        """A node that left for good (it said so): its record goes, its bindings stay
        until another node reports those sandboxes."""
        self._nodes.pop(node_id, None)
        await self.store.delete_node(node_id)

    def nodes(self) -> list[NodeInfo]:
        return [self._nodes[key].info() for key in sorted(self._nodes)]

    def node(self, node_id: str) -> NodeInfo | None:
        node = self._nodes.get(node_id)
        return node.info() if node else None

    # -- placement -----------------------------------------------------------------------
    def candidates(self) -> list[Candidate]:
        out = []
        for node in self._nodes.values():
            if node.state is not NodeState.UP:
                continue
            report = node.report
            out.append(
                Candidate(
                    node=node.info(),
                    vcpus=report.allocated_vcpus + sum(r.vcpus for r in node.reservations.values()),
                    memory_mib=report.allocated_memory_mib
                    + sum(r.memory_mib for r in node.reservations.values()),
                )
            )
        return out

    def place(self, demand: Demand) -> tuple[str, NodeInfo]:
        """A node for ``demand`` and the id of the reservation made on it (ended by
        :meth:`bind` or :meth:`release`). Raises :class:`NoCapacity`."""
        candidates = self.candidates()
        chosen = self.strategy.choose(candidates, demand)
        if chosen is None:
            raise NoCapacity(demand, len(candidates))
        node = self._nodes[chosen.node_id]
        placement_id = secrets.token_hex(8)
        node.reservations[placement_id] = _Reservation(
            node_id=chosen.node_id,
            vcpus=demand.vcpus or node.report.sandbox_vcpus,
            memory_mib=demand.memory_mib or node.report.sandbox_memory_mib,
            made_at=self.clock(),
        )
        return placement_id, node.info()

    def release(self, placement_id: str) -> None:
        for node in self._nodes.values():
            node.reservations.pop(placement_id, None)

    # -- bindings ------------------------------------------------------------------------
    async def bind(self, sandbox_id: str, node_id: str, placement_id: str | None = None) -> Binding:
        node = self._nodes.get(node_id)
        if node is None:
            raise UnknownNode(node_id)
        await self.store.put(sandbox_id, BoundEntry(node_id, self.clock()))
        if placement_id is not None and placement_id in node.reservations:
            # Kept until the node's roster shows the sandbox (its allocation then does).
            node.reservations[placement_id].sandbox_id = sandbox_id
        return Binding(sandboxID=sandbox_id, nodeID=node_id, node=node.info())

    async def lookup(self, sandbox_id: str) -> Binding | None:
        entry = await self.store.get(sandbox_id)
        if entry is None:
            return None
        node = self._nodes.get(entry.node_id)
        return Binding(
            sandboxID=sandbox_id, nodeID=entry.node_id, node=node.info() if node else None
        )

    async def unbind(self, sandbox_id: str) -> None:
        await self.store.delete(sandbox_id)

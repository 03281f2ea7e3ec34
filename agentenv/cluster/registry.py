"""The scheduler's node registry: nodes fed by heartbeats, down when they stop,
reservations for placements not yet visible in a report, and the sandbox→node bindings.
All of it is kept in a :class:`~agentenv.cluster.store.SchedulerStore` (see there why),
so any number of scheduler replicas can serve one cluster from one Redis: this object
holds nothing another replica would need, only what it last saw of each node's state, to
log changes and count nodes in ``/metrics``.

A node's roster is the truth about which sandboxes it holds: each heartbeat binds every
sandbox on it to it, and unbinds sandboxes bound to it that it no longer reports, unless
they were bound within ``binding_grace`` seconds (a create that finished after the node
collected its report). So a scheduler that lost its bindings relearns them within one
heartbeat interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import urlsplit

from agentenv.cluster.models import Binding, NodeInfo, NodeReport, NodeState
from agentenv.cluster.placement import Candidate, Demand, PlacementStrategy
from agentenv.cluster.store import (
    BoundEntry,
    NodeRecord,
    Reservation,
    SchedulerStore,
    with_sandbox,
)

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


def _info(record: NodeRecord) -> NodeInfo:
    return NodeInfo(
        report=record.report,
        state=NodeState.UP if record.up else NodeState.DOWN,
        lastSeen=datetime.fromtimestamp(record.seen_at, UTC),
    )


def _address(url: str) -> str:
    """A node URL's host and port: discovery lists ``http://`` URLs whatever the nodes
    serve, so a TLS node's ``https://`` report is compared by address."""
    parts = urlsplit(url)
    return parts.netloc or url.rstrip("/")


class NodeRegistry:
    def __init__(
        self,
        store: SchedulerStore,
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
        # Each node's state as this replica last saw it (for logs and metrics only).
        self._seen_states: dict[str, NodeState] = {}
        # Node addresses discovery listed at this replica's last look.
        self._discovered: set[str] = set()
        # One placement at a time in this replica: a burst then races only the other
        # replicas' placements in the store's optimistic transaction, not itself.
        self._placing = asyncio.Lock()

    # -- node state ----------------------------------------------------------------------
    async def heartbeat(self, report: NodeReport) -> NodeInfo:
        now = self.clock()
        if report.node_id not in self._seen_states:
            log.info("node %s heartbeats from %s", report.node_id, report.url)
        await self.store.save_node(report, now, self.node_timeout)
        self._note(report.node_id, NodeState.UP)
        await self._follow_roster(report, now)
        return _info(NodeRecord(report, now, up=True))

    def _note(self, node_id: str, state: NodeState) -> bool:
        """Remember ``state`` as this replica's view; True if it changed from what this
        replica saw before (not when it sees the node for the first time)."""
        before = self._seen_states.get(node_id)
        self._seen_states[node_id] = state
        changed = before is not None and before is not state
        if changed:
            log.info("node %s is %s", node_id, state.value)
        return changed

    async def _follow_roster(self, report: NodeReport, now: float) -> None:
        roster = set(report.sandboxes)
        node_id = report.node_id
        bindings = await self.store.all()
        for sandbox_id in roster:
            entry = bindings.get(sandbox_id)
            if entry is None or entry.node_id != node_id:
                await self.store.put(sandbox_id, BoundEntry(node_id, now))
        gone = {
            sandbox_id: entry
            for sandbox_id, entry in bindings.items()
            if entry.node_id == node_id
            and sandbox_id not in roster
            and entry.bound_at < now - self.binding_grace
        }
        # Only if unchanged: another replica may have bound one elsewhere meanwhile.
        await self.store.delete_unchanged(gone)
        ended = [
            placement_id
            for placement_id, reservation in (await self.store.reservations()).items()
            if reservation.node_id == node_id
            and (
                reservation.made_at < now - self.reservation_ttl
                or (reservation.sandbox_id is not None and reservation.sandbox_id in roster)
            )
        ]
        await self.store.end_reservations(*ended)

    async def newly_down(self) -> list[str]:
        """Refresh this replica's view of every node's state (its log and metrics; the
        store decides what is down) and return the nodes it saw up and now sees down
        (silent for ``node_timeout``, or gone from discovery)."""
        nodes = await self.nodes()
        downed = [
            node.node_id
            for node in nodes
            if self._note(node.node_id, node.state) and node.state is NodeState.DOWN
        ]
        for node_id in set(self._seen_states) - {node.node_id for node in nodes}:
            del self._seen_states[node_id]  # forgotten, through another replica
        return downed

    async def follow_discovery(self, urls: set[str]) -> list[str]:
        """Discovery (``discovery``) listed ``urls`` now: up nodes whose address it listed
        before and lists no more become down; returns their ids. (Nodes never listed
        are left to their heartbeats: a list that lags must not down a new node.)"""
        addresses = {_address(url) for url in urls}
        vanished = self._discovered - addresses
        self._discovered = addresses
        downed = []
        for node in await self.nodes():
            if node.state is NodeState.UP and _address(node.report.url) in vanished:
                await self.store.mark_down(node.node_id)
                self._note(node.node_id, NodeState.DOWN)
                downed.append(node.node_id)
        return downed

    def discovered(self) -> set[str]:
        return set(self._discovered)

    def states_seen(self) -> dict[str, NodeState]:
        """Each node's state as this replica last saw it (for metrics)."""
        return dict(self._seen_states)

    async def forget(self, node_id: str) -> None:
        """A node that left for good (it said so): its record goes, its bindings stay
        until another node reports those sandboxes."""
        self._seen_states.pop(node_id, None)
        await self.store.delete_node(node_id)

    async def nodes(self) -> list[NodeInfo]:
        records = await self.store.nodes(self.clock())
        return sorted((_info(r) for r in records), key=lambda n: n.node_id)

    async def node(self, node_id: str) -> NodeInfo | None:
        record = await self.store.node(node_id, self.clock())
        return _info(record) if record else None

    # -- placement -----------------------------------------------------------------------
    @staticmethod
    def _candidates(records: list[NodeRecord], reservations: list[Reservation]) -> list[Candidate]:
        out = []
        for record in records:
            if not record.up:
                continue
            report = record.report
            held = [r for r in reservations if r.node_id == report.node_id]
            out.append(
                Candidate(
                    node=_info(record),
                    vcpus=report.allocated_vcpus + sum(r.vcpus for r in held),
                    memory_mib=report.allocated_memory_mib + sum(r.memory_mib for r in held),
                )
            )
        return out

    async def candidates(self) -> list[Candidate]:
        records = await self.store.nodes(self.clock())
        return self._candidates(records, list((await self.store.reservations()).values()))

    async def place(self, demand: Demand) -> tuple[str, NodeInfo]:
        """A node for ``demand`` and the id of the reservation made on it (ended by
        :meth:`bind` or :meth:`release`). Atomic across replicas: a reservation another
        replica makes meanwhile is counted. Raises :class:`NoCapacity`."""
        now = self.clock()
        seen: list[Candidate] = []
        chosen_node: list[NodeInfo] = []

        def choose(records: list[NodeRecord], held: list[Reservation]) -> Reservation | None:
            candidates = [
                c for c in self._candidates(records, held) if c.node_id not in demand.exclude_nodes
            ]
            seen[:] = candidates
            chosen = self.strategy.choose(candidates, demand)
            if chosen is None:
                return None
            report = chosen.node.report
            chosen_node[:] = [chosen.node]
            return Reservation(
                node_id=chosen.node_id,
                vcpus=demand.vcpus or report.sandbox_vcpus,
                memory_mib=demand.memory_mib or report.sandbox_memory_mib,
                made_at=now,
            )

        async with self._placing:
            made = await self.store.reserve(choose, now)
        if made is None:
            raise NoCapacity(demand, len(seen))
        return made[0], chosen_node[0]

    async def release(self, placement_id: str) -> None:
        await self.store.end_reservations(placement_id)

    # -- bindings ------------------------------------------------------------------------
    async def bind(self, sandbox_id: str, node_id: str, placement_id: str | None = None) -> Binding:
        record = await self.store.node(node_id, self.clock())
        if record is None:
            raise UnknownNode(node_id)
        await self.store.put(sandbox_id, BoundEntry(node_id, self.clock()))
        if placement_id is not None:
            reservation = (await self.store.reservations()).get(placement_id)
            if reservation is not None and reservation.node_id == node_id:
                # Kept until the node's roster shows the sandbox (its allocation then does).
                await self.store.set_reservation(
                    placement_id, with_sandbox(reservation, sandbox_id)
                )
        return Binding(sandboxID=sandbox_id, nodeID=node_id, node=_info(record))

    async def lookup(self, sandbox_id: str) -> Binding | None:
        entry = await self.store.get(sandbox_id)
        if entry is None:
            return None
        record = await self.store.node(entry.node_id, self.clock())
        return Binding(
            sandboxID=sandbox_id, nodeID=entry.node_id, node=_info(record) if record else None
        )

    async def unbind(self, sandbox_id: str) -> None:
        await self.store.delete(sandbox_id)

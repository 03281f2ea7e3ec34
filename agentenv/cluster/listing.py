"""Listings across nodes: every node's page merged into the cluster's page, and the
nodes themselves as E2B lists them (``e2b_node``).

A node pages ``GET /v2/sandboxes`` by the position (startedAt, sandboxID) in the
requested order (``agentenv.api.listing``; its ``X-Next-Token`` encodes the position).
The gateway asks every node for the same page (same token, order and limit): the
cluster's next ``limit`` sandboxes are among the union of the nodes' next ``limit``, so
merging those by the same position and cutting at ``limit`` gives the page one node
holding everything would have given, and a token every node understands.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from agentenv.api.listing import Order, Position, encode_token, position
from agentenv.api.nodes import MachineInfo, Node, NodeDetail, NodeMetrics
from agentenv.cluster.models import NodeInfo, NodeState

NEXT_TOKEN_HEADER = "x-next-token"


def sandbox_key(item: dict[str, Any]) -> Position:
    """The node's page position of a sandbox detail (``api.listing.sandbox_key`` over
    JSON)."""
    return position(datetime.fromisoformat(str(item["startedAt"])), str(item["sandboxID"]))


def merge_pages(
    pages: Iterable[Sequence[dict[str, Any]]], order: Order, limit: int, more_on_a_node: bool
) -> tuple[list[dict[str, Any]], str | None]:
    """The cluster's page from the nodes' ``pages`` (each sorted or not), and the token
    of the next page, if there is one. ``more_on_a_node``: some node said it has more
    than it sent."""
    every = (item for page in pages for item in page)
    items = sorted(every, key=sandbox_key, reverse=order == "desc")
    if len(items) > limit or (more_on_a_node and items):
        items = items[:limit]
        return items, encode_token(order, sandbox_key(items[-1]))
    return items, None


def e2b_node(info: NodeInfo) -> Node:
    """A node as E2B's ``GET /nodes`` lists it, from what the scheduler knows: the
    description its last heartbeat carried, ``unhealthy`` since it was last seen if
    the scheduler marked it down. A node too old to send one is described from its
    report alone."""
    report = info.report
    node = report.e2b_node
    if node is None:
        node = Node(
            id=report.node_id,
            serviceInstanceID=report.node_id,
            clusterID="default",
            status="unhealthy" if report.problem else "ready",
            statusChangedAt=info.last_seen,
            sandboxCount=len(report.sandboxes),
            metrics=NodeMetrics(
                allocatedCPU=report.allocated_vcpus,
                allocatedMemoryBytes=report.allocated_memory_mib << 20,
                cpuPercent=0,
                memoryUsedBytes=0,
                cpuCount=report.cpu_count,
                memoryTotalBytes=report.memory_mib << 20,
                disks=[],
            ),
            createSuccesses=0,
            createFails=0,
            sandboxStartingCount=0,
            version=report.version,
            commit="",
            machineInfo=MachineInfo(cpuFamily="", cpuModel="", cpuModelName="", cpuArchitecture=""),
        )
    if info.state is NodeState.DOWN:
        node = node.model_copy(update={"status": "unhealthy", "status_changed_at": info.last_seen})
    return node


def e2b_node_detail(info: NodeInfo) -> NodeDetail:
    """``GET /nodes/{id}`` of a node that cannot be asked (down, or not answering):
    its last heartbeat's description, roster and ready templates."""
    return NodeDetail.of(e2b_node(info), info.report.sandboxes, info.report.templates)

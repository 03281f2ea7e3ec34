"""The cluster's wire contract: what nodes report to the scheduler, and what the scheduler
answers the gateway (placements, bindings, the node list). Pydantic models, JSON with
camelCase names like the E2B API's."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from agentenv.api.nodes import Node


class _Wire(BaseModel):
    model_config = ConfigDict(populate_by_name=True, frozen=True)


class NodeReport(_Wire):
    """One heartbeat: a node's capacity, what it has allocated, its roster and what it
    holds. The roster is the truth about which sandboxes a node has; the scheduler's
    bindings follow it."""

    node_id: str = Field(alias="nodeID", min_length=1, max_length=200)
    # Where the gateway reaches the node's API and proxy.
    url: str = Field(min_length=1, max_length=2000)
    version: str = ""
    cpu_count: int = Field(alias="cpuCount", ge=1)
    memory_mib: int = Field(alias="memoryMib", ge=1)
    # Of sandboxes holding a VM (or about to); paused ones are counted apart.
    allocated_vcpus: int = Field(alias="allocatedVcpus", ge=0)
    allocated_memory_mib: int = Field(alias="allocatedMemoryMib", ge=0)
    paused_vcpus: int = Field(default=0, alias="pausedVcpus", ge=0)
    paused_memory_mib: int = Field(default=0, alias="pausedMemoryMib", ge=0)
    # What one sandbox of the default size takes, for reservations between heartbeats.
    sandbox_vcpus: int = Field(default=2, alias="sandboxVcpus", ge=1)
    sandbox_memory_mib: int = Field(default=512, alias="sandboxMemoryMib", ge=1)
    # Sandboxes callers see on the node (running or paused).
    sandboxes: list[str] = Field(default_factory=list)
    # Templates (and snapshots) the node can start sandboxes from without fetching.
    templates: list[str] = Field(default_factory=list)
    # Why the node cannot take sandboxes (its base template failed), if it cannot.
    problem: str | None = None
    # The node as its GET /nodes describes it (E2B's Node), for the gateway's /nodes.
    e2b_node: Node | None = Field(default=None, alias="e2bNode")


class NodeState(StrEnum):
    UP = "up"
    DOWN = "down"


class NodeInfo(_Wire):
    """A node as the scheduler knows it: its last report, and whether it is up."""

    report: NodeReport
    state: NodeState
    last_seen: datetime = Field(alias="lastSeen")

    @property
    def node_id(self) -> str:
        return self.report.node_id


class PlacementRequest(_Wire):
    template_id: str = Field(alias="templateID", min_length=1, max_length=400)
    vcpus: int | None = Field(default=None, ge=1)
    memory_mib: int | None = Field(default=None, alias="memoryMib", ge=1)
    #: Nodes the gateway already tried for this create, which refused it because the
    #: template was saved under another VMM or accelerator than theirs.
    exclude_nodes: list[str] = Field(default_factory=list, alias="excludeNodes", max_length=1000)


class Placement(_Wire):
    """Where a new sandbox goes; ``placementID`` is given back when it is bound (or
    released if the create fails), so the reservation it holds ends."""

    placement_id: str = Field(alias="placementID")
    node: NodeInfo


class BindRequest(_Wire):
    node_id: str = Field(alias="nodeID", min_length=1, max_length=200)
    placement_id: str | None = Field(default=None, alias="placementID")


class Binding(_Wire):
    """Which node holds a sandbox; ``node`` is None when that node is not known (yet)."""

    sandbox_id: str = Field(alias="sandboxID")
    node_id: str = Field(alias="nodeID")
    node: NodeInfo | None = None


class ClusterError(_Wire):
    code: int
    message: str

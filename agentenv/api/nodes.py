"""``GET /nodes`` and ``GET /nodes/{nodeID}``: a node as E2B's API describes its nodes
(``Node``, ``NodeDetail`` and their ``NodeMetrics``, ``MachineInfo``, ``DiskMetrics`` in
E2B's ``spec/openapi.yml``), with E2B's field names.

A node on its own is a one-node cluster: ``/nodes`` lists itself. Through the gateway
``/nodes`` lists every node the scheduler knows (each node sends this description with
its heartbeats, see ``agentenv.cluster.heartbeat``) and ``/nodes/{id}`` asks that node.

What agentenv fills in its own way: ``status`` is ``ready``, or ``unhealthy`` while the
node reports a problem (and, through the gateway, while it is down); ``clusterID`` is
the ``cluster_id`` setting (``AENV_CLUSTER_ID``, ``default``); ``cpuPercent`` is the
one-minute load average over the CPU count; ``commit`` is empty (no build commit is
recorded). ``NodeDetail`` adds ``sandboxes`` (ids of those callers see) and
``cachedBuilds`` (ready templates), as E2B's detail once did.
"""

from __future__ import annotations

import os
import platform
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field

from agentenv import __version__
from agentenv.api.errors import ApiError

if TYPE_CHECKING:  # the gateway reads these models without loading the orchestrator
    from agentenv.orchestrator.orchestrator import Orchestrator
    from agentenv.orchestrator.views import NodeStatus

NodeState = Literal["ready", "draining", "connecting", "unhealthy", "standby"]


class _E2B(BaseModel):
    model_config = ConfigDict(populate_by_name=True, frozen=True)


class DiskMetrics(_E2B):
    mount_point: str = Field(alias="mountPoint")
    device: str
    filesystem_type: str = Field(alias="filesystemType")
    used_bytes: int = Field(alias="usedBytes")
    total_bytes: int = Field(alias="totalBytes")


class NodeMetrics(_E2B):
    allocated_cpu: int = Field(alias="allocatedCPU")
    allocated_memory_bytes: int = Field(alias="allocatedMemoryBytes")
    cpu_percent: int = Field(alias="cpuPercent")
    memory_used_bytes: int = Field(alias="memoryUsedBytes")
    cpu_count: int = Field(alias="cpuCount")
    memory_total_bytes: int = Field(alias="memoryTotalBytes")
    disks: list[DiskMetrics]
    huge_pages_total: int = Field(default=0, alias="hugePagesTotal")
    huge_pages_used: int = Field(default=0, alias="hugePagesUsed")
    huge_pages_reserved: int = Field(default=0, alias="hugePagesReserved")
    huge_page_size_bytes: int = Field(default=0, alias="hugePageSizeBytes")


class MachineInfo(_E2B):
    cpu_family: str = Field(alias="cpuFamily")
    cpu_model: str = Field(alias="cpuModel")
    cpu_model_name: str = Field(alias="cpuModelName")
    cpu_architecture: str = Field(alias="cpuArchitecture")


class _NodeFields(_E2B):
    """What E2B's ``Node`` and ``NodeDetail`` both carry."""

    id: str
    service_instance_id: str = Field(alias="serviceInstanceID")
    cluster_id: str = Field(alias="clusterID")
    status: NodeState
    status_changed_at: datetime = Field(alias="statusChangedAt")
    # Running sandboxes, as E2B counts them.
    sandbox_count: int = Field(alias="sandboxCount")
    metrics: NodeMetrics
    create_successes: int = Field(alias="createSuccesses")
    create_fails: int = Field(alias="createFails")
    version: str
    commit: str
    machine_info: MachineInfo = Field(alias="machineInfo")


class Node(_NodeFields):
    sandbox_starting_count: int = Field(alias="sandboxStartingCount")


class NodeDetail(_NodeFields):
    sandboxes: list[str] = Field(default_factory=list)
    cached_builds: list[str] = Field(default_factory=list, alias="cachedBuilds")

    @classmethod
    def of(cls, node: Node, sandboxes: list[str], cached_builds: list[str]) -> NodeDetail:
        fields = node.model_dump(by_alias=False, exclude={"sandbox_starting_count"})
        return cls.model_validate(
            {**fields, "sandboxes": sandboxes, "cached_builds": cached_builds}
        )


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (its page counts as they are)."""
    values: dict[str, int] = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def machine_info() -> MachineInfo:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block tells
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    return MachineInfo(
        cpuFamily=fields.get("cpu family", ""),
        cpuModel=fields.get("model", ""),
        cpuModelName=fields.get("model name", ""),
        cpuArchitecture=platform.machine(),
    )


def _filesystem_of(path: Path) -> tuple[str, str, str]:
    """(mount point, device, type) of the filesystem holding ``path``."""
    best = ("/", "", "")
    try:
        target = str(path.resolve())
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount_point, fs_type, *_ = line.split()
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best[0]):
                    best = (mount_point, device, fs_type)
    except OSError:
        pass
    return best


class NodeBook:
    """What ``/nodes`` tells of this node: its status as E2B shapes it, the creates it
    counted, and when its status last changed."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        self.cluster_id = orchestrator.config.cluster_id
        # This process: E2B's service instance is one run of the node's service.
        self.instance_id = str(uuid.uuid4())
        self.machine = machine_info()
        self.create_successes = 0
        self.create_fails = 0
        self._status: NodeState = "ready"
        self._changed_at = datetime.now(UTC)

    def count_create(self, ok: bool) -> None:
        if ok:
            self.create_successes += 1
        else:
            self.create_fails += 1

    def node(self, status: NodeStatus | None = None) -> Node:
        status = status or self.orchestrator.node_status()
        state: NodeState = "unhealthy" if status.problem else "ready"
        if state != self._status:
            self._status, self._changed_at = state, datetime.now(UTC)
        memory = _meminfo()
        cpus = os.cpu_count() or 1
        mount_point, device, fs_type = _filesystem_of(self.orchestrator.config.home)
        huge_total = memory.get("HugePages_Total", 0)
        return Node(
            id=status.node,
            serviceInstanceID=self.instance_id,
            clusterID=self.cluster_id,
            status=state,
            statusChangedAt=self._changed_at,
            sandboxCount=status.sandboxes_by_state.get("running", 0),
            metrics=NodeMetrics(
                allocatedCPU=status.allocated_vcpus,
                allocatedMemoryBytes=status.allocated_memory_mib << 20,
                cpuPercent=min(100, round(os.getloadavg()[0] / cpus * 100)),
                memoryUsedBytes=memory.get("MemTotal", 0) - memory.get("MemAvailable", 0),
                cpuCount=cpus,
                memoryTotalBytes=memory.get("MemTotal", 0),
                disks=[
                    DiskMetrics(
                        mountPoint=mount_point,
                        device=device,
                        filesystemType=fs_type,
                        usedBytes=status.disk.total_bytes - status.disk.free_bytes,
                        totalBytes=status.disk.total_bytes,
                    )
                ],
                hugePagesTotal=huge_total,
                hugePagesUsed=huge_total - memory.get("HugePages_Free", 0),
                hugePagesReserved=memory.get("HugePages_Rsvd", 0),
                hugePageSizeBytes=memory.get("Hugepagesize", 0),
            ),
            createSuccesses=self.create_successes,
            createFails=self.create_fails,
            sandboxStartingCount=status.sandboxes_by_state.get("creating", 0),
            version=__version__,
            commit="",
            machineInfo=self.machine,
        )

    def detail(self) -> NodeDetail:
        status = self.orchestrator.node_status()
        sandboxes = [view.sandbox_id for view in self.orchestrator.list_sandboxes()]
        ready = sorted(t for t, state in status.templates.items() if state == "ready")
        return NodeDetail.of(self.node(status), sandboxes, ready)


def node_routes(book: NodeBook, authed: list[Depends]) -> APIRouter:
    router = APIRouter(tags=["nodes"], dependencies=authed)

    @router.get("/nodes", response_model=list[Node], response_model_by_alias=True)
    async def list_nodes() -> list[Node]:
        """This node (a node on its own is a one-node cluster)."""
        return [book.node()]

    @router.get("/nodes/{node_id}", response_model=NodeDetail, response_model_by_alias=True)
    async def get_node(node_id: str) -> NodeDetail:
        if node_id != book.orchestrator.node_status().node:
            raise ApiError(404, f"node {node_id!r} not found")
        return book.detail()

    return router

"""What callers (the API, the proxy, template builds, a scheduler) see of sandboxes,
snapshots and the node: read-only views over store records, in the states the E2B API
knows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentenv.orchestrator.diskspace import DiskSpace
from agentenv.orchestrator.records import SnapshotEntry
from agentenv.orchestrator.states import PUBLIC_STATE
from agentenv.orchestrator.store import SandboxRecord, SnapshotRecord


@dataclass(frozen=True)
class SandboxView:
    """What callers see of a sandbox."""

    record: SandboxRecord
    guest_address: str
    children: tuple[str, ...] = ()

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    @property
    def state(self) -> str:
        """``running`` or ``paused``: a change in progress shows the state the sandbox
        is leaving, which is what it still is until the change completes."""
        return PUBLIC_STATE.get(self.record.state, self.record.state)


@dataclass(frozen=True)
class SnapshotView:
    record: SnapshotRecord

    @property
    def snapshot_id(self) -> str:
        return self.record.snapshot_id

    @property
    def names(self) -> list[str]:
        return [self.record.name] if self.record.name else []

    @classmethod
    def of_entry(cls, entry: SnapshotEntry) -> SnapshotView:
        """A committed snapshot as the local record type (it has no directory here)."""
        return cls(
            SnapshotRecord(
                snapshot_id=entry.id,
                name=entry.names[0] if entry.names else None,
                kind=entry.type,
                state="ready",
                sandbox_id=entry.sandbox_id,
                template_id=entry.template_id,
                parent_id=entry.parent_id,
                snapshot_dir=Path(),
                metadata=dict(entry.metadata),
                created_at=entry.created_at,
            )
        )


@dataclass(frozen=True)
class NodeStatus:
    """What a node reports of itself: to ``/health`` and to a scheduler's heartbeats."""

    node: str
    vmm: str
    accel: str
    # "shared": sandboxes' RAM is a file of their own; "private": a copy-on-write mapping.
    memory_mode: str
    sandboxes_by_state: dict[str, int]
    # Of sandboxes holding a VM or about to (not paused ones).
    allocated_vcpus: int
    allocated_memory_mib: int
    cache_used_bytes: int
    cache_limit_bytes: int
    cache_entries: int
    repository: str
    # Sandboxes callers see (running or paused, including those changing between them).
    sandboxes: int
    # Built templates: "ready"; the built-in base also "building", "pending" or "failed".
    templates: dict[str, str]
    # The data directory's filesystem and its free-space floor.
    disk: DiskSpace
    # Why the node is degraded (the base template failed to build, the disk is below its
    # floor, commits stopped for want of space), if it is.
    problem: str | None
    # VMM processes this node drives now.
    vmms: int = 0
    # Why the node runs this VMM and accelerator (what ``auto`` found, or "set").
    mode_reason: str = ""

"""What nodes agree on with each other and with the API, without VMs: repository records
(typed, versioned, readable across versions), error codes and their HTTP statuses, the
marker files of sandbox directories, and the background-task supervisor."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agentenv.api.errors import HTTP_STATUS, http_status
from agentenv.orchestrator.errors import (
    ErrorCode,
    ModeMismatch,
    NodeCacheFull,
    OrchestratorError,
)
from agentenv.orchestrator.layout import SandboxDir, UploadState
from agentenv.orchestrator.records import MalformedRecord, PausedEntry, SnapshotEntry
from agentenv.orchestrator.states import SandboxState, StateChanged
from agentenv.orchestrator.supervisor import Supervisor

# A snapshot record as servers before typed records wrote it (no "version").
OLD_SNAPSHOT_RECORD: dict[str, Any] = {
    "id": "snap-abc",
    "type": "template",
    "names": ["py"],
    "sandbox_id": "iabc",
    "template_id": "base",
    "parent_id": None,
    "metadata": {"k": "v"},
    "created_at": "2026-11-30T10:00:00.123456+00:00",
    "node": "node-a",
    "vcpus": 2,
    "memory_mib": 512,
    "disk_size_mib": 4096,
    "envd_version": "0.6.4",
    "manifest": {"format": 1},
    "blobs": {"disk": "sha256:00"},
}


def test_a_record_without_a_version_is_version_1_and_keeps_every_key() -> None:
    entry = SnapshotEntry.from_wire(OLD_SNAPSHOT_RECORD)
    assert entry.version == 1
    assert entry.created_at == datetime(2026, 11, 30, 10, 0, 0, 123456, tzinfo=UTC)
    wire = entry.to_wire()
    # Older readers look keys up by name: every key they know is still written.
    assert set(OLD_SNAPSHOT_RECORD) <= set(wire)
    assert datetime.fromisoformat(wire["created_at"]) == entry.created_at
    assert SnapshotEntry.from_wire(wire) == entry


def test_fields_a_newer_server_added_are_ignored() -> None:
    entry = SnapshotEntry.from_wire({**OLD_SNAPSHOT_RECORD, "version": 2, "future": [1]})
    assert entry.version == 2 and "future" not in entry.to_wire()


def test_a_malformed_record_is_refused_with_what_it_is() -> None:
    with pytest.raises(MalformedRecord, match="SnapshotEntry snap-abc"):
        SnapshotEntry.from_wire({**OLD_SNAPSHOT_RECORD, "vcpus": "two"})
    with pytest.raises(MalformedRecord, match="PausedEntry"):
        PausedEntry.from_wire({"sandbox_id": "iabc"})


def test_every_error_code_has_an_http_status() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)
    assert http_status(NodeCacheFull("full")) == 507
    assert http_status(ModeMismatch("snapshot s", "firecracker/kvm", "qemu/tcg")) == 409
    assert http_status(StateChanged("iabc", SandboxState.RUNNING, None)) == 409
    assert http_status(OrchestratorError("x")) == 500
    assert http_status(ValueError("x")) == 500


def test_upload_markers_round_trip_and_tolerate_garbage(tmp_path: Path) -> None:
    directory = SandboxDir(tmp_path)
    directory.paused.mkdir()
    assert directory.upload_state() is None and directory.generation() == 0
    directory.set_generation(3)
    directory.set_upload_state(UploadState("uploading", 3))
    assert directory.upload_state() == UploadState("uploading", 3)
    assert not directory.upload_state().committed  # type: ignore[union-attr]
    (directory.paused / "upload.json").write_text('{"state": "weird", "generation": 1}')
    assert directory.upload_state() is None
    assert directory.generation() == 3
    directory.mark_disk_only()
    assert directory.saved() and directory.upload_state() is None


async def test_a_supervisor_runs_one_job_per_key_and_stops_everything() -> None:
    supervisor = Supervisor()
    started: list[str] = []
    ticks = 0

    async def job(name: str) -> None:
        started.append(name)
        await asyncio.sleep(3600)

    async def tick() -> None:
        nonlocal ticks
        ticks += 1

    first = supervisor.start_job("commit", "a", lambda: job("a1"))
    again = supervisor.start_job("commit", "a", lambda: job("a2"))
    other = supervisor.start_job("commit", "b", lambda: job("b"))
    supervisor.every("tick", 0.01, tick)
    await asyncio.sleep(0.1)
    assert first is again and started == ["a1", "b"] and ticks > 0
    await supervisor.cancel_job("commit", "a")
    assert first.cancelled() and supervisor.job("commit", "a") is None
    await supervisor.shutdown()
    assert other.cancelled()

"""Snapshots and forks of running sandboxes under a driver whose disks are raw files
that it captures by copying (:attr:`DiskCapture.COPY`, Firecracker's way), on the
fakes of :mod:`tests.fakes` (:class:`FakeRawDriver`): what the snapshot holds, what
its sandboxes start from (here and, through the repository, on another node), its
collection, a failed copy, and the memory mode of a resumed sandbox. The sealing path
(QEMU's) is tested in :mod:`tests.test_orchestrator_unit`."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.orchestrator.errors import OperationFailed
from agentenv.orchestrator.layout import SandboxDir, SnapshotDir
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxRecord
from agentenv.orchestrator.views import SandboxView
from agentenv.snapshots.layout import MachineSnapshot
from agentenv.vmm.base import DiskCapture, VMRunState
from tests.fakes import FAKE_TEMPLATE, RAM_IMAGE_FILE, FakeRawDriver, Node, start_node

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="the fake template's tooling needs qemu-img"
)

S = SandboxState


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "a", tmp_path / "repository", driver=FakeRawDriver())
    yield started
    await started.stop()


def record(node: Node, sandbox_id: str) -> SandboxRecord:
    rec = node.orchestrator.store.get_sandbox(sandbox_id)
    assert rec is not None
    return rec


def disk_of(rec: SandboxRecord) -> Path:
    assert rec.disk_path is not None
    return rec.disk_path


def write_at_start(disk: Path, data: bytes) -> None:
    """What a guest writing the first bytes of its disk leaves in the file."""
    with open(disk, "r+b") as f:
        f.write(data)


def start_of(disk: Path, size: int) -> bytes:
    with open(disk, "rb") as f:
        return f.read(size)


async def test_a_snapshot_holds_a_copy_of_the_raw_disk_and_the_saved_ram(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    disk = disk_of(view.record)
    assert disk.suffix == ".raw"
    write_at_start(disk, b"before")
    snap = await orch.snapshot(view.sandbox_id, "copied", wait_commit=True)
    # The sandbox runs on, writing its own disk, which nothing of it builds on.
    rec = record(node, view.sandbox_id)
    assert rec.state == S.RUNNING and rec.snapshot_id == snap.snapshot_id
    assert rec.disk_path == disk
    assert orch._machines.running_vm(rec).state is VMRunState.RUNNING
    write_at_start(disk, b"after!")

    directory = SnapshotDir(snap.record.snapshot_dir)
    assert directory.committed()
    assert directory.disk == directory.disk_file("raw") != directory.disk_file("qcow2")
    assert not directory.disk_file("qcow2").exists()
    assert start_of(directory.disk, 6) == b"before"
    assert not directory.disk.samefile(disk)
    loaded = MachineSnapshot.load(directory.path)
    assert (loaded.disk, loaded.disk_format, loaded.disk_chain_depth) == (directory.disk, "raw", 0)
    # The RAM image the save wrote is the snapshot's: no second copy beside it.
    assert loaded.files.memory_file == directory.path / RAM_IMAGE_FILE
    assert not directory.memory_file.exists()

    child = await orch.create("copied")
    assert child.record.source_dir == directory.path
    assert child.record.memory_mode == "private"
    child_disk = disk_of(child.record)
    assert child_disk.parent == child.record.workdir and child_disk.suffix == ".raw"
    assert start_of(child_disk, 6) == b"before"
    write_at_start(child_disk, b"child!")
    assert start_of(directory.disk, 6) == b"before"

    # Deleted, it stays while the sandbox started from it does, and no longer.
    await orch.delete_snapshot("copied")
    assert orch.collect_snapshots() == [] and directory.path.exists()
    await orch.kill(child.sandbox_id)
    assert not directory.path.exists()
    # The sandbox it was taken of never depended on it.
    assert start_of(disk, 6) == b"after!"
    await orch.kill(view.sandbox_id)


async def test_a_raw_snapshot_starts_sandboxes_on_another_node(node: Node, tmp_path: Path) -> None:
    view = await node.orchestrator.create(FAKE_TEMPLATE)
    write_at_start(disk_of(view.record), b"shared")
    snap = await node.orchestrator.snapshot(view.sandbox_id, "travels", wait_commit=True)
    other = await start_node(
        tmp_path / "b", tmp_path / "repository", node_id="node-b", driver=FakeRawDriver()
    )
    try:
        child = await other.orchestrator.create("travels")
        assert child.record.snapshot_id == snap.snapshot_id
        assert child.record.source_dir is not None
        fetched = MachineSnapshot.load(child.record.source_dir)
        assert fetched.disk_format == "raw" and fetched.files.memory_file is not None
        child_disk = disk_of(child.record)
        assert child_disk.suffix == ".raw" and not child_disk.samefile(fetched.disk)
        assert start_of(child_disk, 6) == b"shared"
        await other.orchestrator.kill(child.sandbox_id)
    finally:
        await other.stop()


async def test_fork_children_start_from_a_copy_and_it_goes_with_them(node: Node) -> None:
    orch = node.orchestrator
    parent = await orch.create(FAKE_TEMPLATE)
    write_at_start(disk_of(parent.record), b"parent")
    results = await orch.fork(parent.sandbox_id, count=2)
    children = [c for c in results if isinstance(c, SandboxView)]
    assert len(children) == 2
    image = children[0].record.snapshot_id
    assert image is not None
    image_rec = orch.store.get_snapshot(image)
    assert image_rec is not None and image_rec.state == "deleted"
    disks = [disk_of(c.record) for c in children]
    assert len({d.resolve() for d in [disk_of(record(node, parent.sandbox_id)), *disks]}) == 3
    for child, child_disk in zip(children, disks, strict=True):
        assert child.record.memory_mode == "private"
        assert start_of(child_disk, 6) == b"parent"
    write_at_start(disks[0], b"first!")
    assert start_of(disks[1], 6) == b"parent"
    # The parent's disk does not build on the fork image: the children alone keep it.
    for child in children:
        await orch.kill(child.sandbox_id)
    assert not image_rec.snapshot_dir.exists()
    assert orch.get(parent.sandbox_id).state == "running"


async def test_a_failed_copy_leaves_no_snapshot_and_the_sandbox_running(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)

    async def no_room(*args: object, **kwargs: object) -> bool:
        raise OSError("no space left on device")

    monkeypatch.setattr("agentenv.orchestrator.capture.clone_file", no_room)
    with pytest.raises(OperationFailed, match="no space"):
        await orch.snapshot(view.sandbox_id, "never")
    monkeypatch.undo()
    rec = record(node, view.sandbox_id)
    assert rec.state == S.RUNNING and rec.snapshot_id is None
    assert orch._machines.running_vm(rec).state is VMRunState.RUNNING
    assert orch.store.list_snapshots() == []
    assert list(node.config.snapshots_dir.iterdir()) == []
    await orch.snapshot(view.sandbox_id, "never")


async def test_a_resumed_sandbox_keeps_private_memory_and_snapshots(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    await orch.pause(view.sandbox_id)
    saved = json.loads(SandboxDir(view.record.workdir).paused_manifest.read_text())
    assert saved["memory_file"] is not None
    await orch.resume(view.sandbox_id)
    rec = record(node, view.sandbox_id)
    # Its RAM is mapped privately from the saved image, which is gone with the pause.
    assert rec.memory_mode == "private"
    spec = orch._machines.running_vm(rec).spec
    assert not spec.memory_shared
    snap = await orch.snapshot(view.sandbox_id, "after-resume")
    assert MachineSnapshot.load(snap.record.snapshot_dir).disk_format == "raw"


async def test_a_driver_that_cannot_capture_a_disk_is_refused(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    monkeypatch.setattr(FakeRawDriver, "disk_capture", DiskCapture.NONE)
    with pytest.raises(OperationFailed, match="capture a running disk; fake cannot"):
        await orch.snapshot(view.sandbox_id, "refused")
    with pytest.raises(OperationFailed, match="capture a running disk"):
        await orch.fork(view.sandbox_id, count=1)
    assert orch.store.list_snapshots() == []
    assert orch.get(view.sandbox_id).state == "running"

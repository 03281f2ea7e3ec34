"""Disk space as a resource (issue #12), on the fakes of :mod:`tests.fakes`: the floor's
arithmetic, resumes refused below it, ``/health`` saying why the node is degraded, a VMM
killed by SIGBUS on a full disk reported as such, and commits that stop on ENOSPC
instead of retrying forever. tests/test_disk_full.py does the same with real VMs on a
filesystem that really fills."""

from __future__ import annotations

import asyncio
import errno
import logging
import shutil
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agentenv.api.app import create_app
from agentenv.api.errors import http_status
from agentenv.config import Config
from agentenv.orchestrator.diskspace import DiskSpace, FreeSpaceFloor
from agentenv.orchestrator.errors import (
    BelowFreeSpaceFloor,
    Conflict,
    OutOfSpace,
    SandboxStartFailed,
)
from agentenv.orchestrator.layout import SnapshotDir
from agentenv.orchestrator.states import SandboxState
from agentenv.snapshots.objects import PosixObjectStore
from agentenv.vmm.base import VMMStartError
from tests.fakes import FAKE_TEMPLATE, Node, in_process_client, start_node, vm_dir

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)

GIB = 1 << 30


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "a", tmp_path / "repository")
    yield started
    await started.stop()


def set_floor(node: Node, floor: str | None) -> None:
    """Give the running node another floor ("1000T": always below it)."""
    node.orchestrator._free_space.config = node.config.with_overrides(free_space_floor=floor)


# -- the floor's arithmetic -----------------------------------------------------------------


def test_disk_space_against_a_size_or_a_percentage_floor() -> None:
    sized = DiskSpace.of(
        free_bytes=3 * GIB, total_bytes=100 * GIB, config=Config(free_space_floor="4G")
    )
    assert sized.floor_bytes == 4 * GIB and sized.below_floor
    problem = sized.problem()
    assert problem is not None and "3072 MiB free" in problem and "4096 MiB" in problem
    share = DiskSpace.of(5 * GIB, 100 * GIB, Config(free_space_floor="5%"))
    assert share.floor_bytes == 5 * GIB and not share.below_floor  # exactly at it: allowed
    assert DiskSpace.of(5 * GIB - 1, 100 * GIB, Config(free_space_floor="5%")).below_floor
    unset = DiskSpace.of(0, 100 * GIB, Config())
    assert unset.floor_bytes == 0 and not unset.below_floor and unset.problem() is None
    assert unset.describe() == "0 MiB free of 102400 MiB"
    assert sized.describe() == "3072 MiB free of 102400 MiB, free-space floor 4096 MiB"


def test_below_the_floor_is_a_507_that_says_what_was_refused() -> None:
    refused = BelowFreeSpaceFloor("resume", 10 << 20, 400 << 20)
    assert http_status(refused) == 507
    assert refused.operation == "resume" and refused.free_bytes == 10 << 20
    assert str(refused).startswith("resume refused") and "free-space floor of 400 MiB" in str(
        refused
    )
    assert http_status(OutOfSpace("committing x", "disk full")) == 507


async def test_crossing_the_floor_is_logged_once_each_way(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    floor = FreeSpaceFloor(Config(home=tmp_path, free_space_floor="1000T"))
    with caplog.at_level(logging.INFO, logger="agentenv.orchestrator"):
        await floor.watch()
        await floor.watch()
        floor.config = Config(home=tmp_path, free_space_floor="1K")
        await floor.watch()
        await floor.watch()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0][0] == logging.WARNING and "below its free-space floor" in messages[0][1]
    assert messages[1][0] == logging.INFO and "above its floor again" in messages[1][1]


# -- resumes and /health --------------------------------------------------------------------


async def test_below_the_floor_a_paused_sandbox_is_not_resumed(node: Node) -> None:
    orch = node.orchestrator
    paused = await orch.create(FAKE_TEMPLATE)
    await orch.pause(paused.sandbox_id)
    running = await orch.create(FAKE_TEMPLATE)
    set_floor(node, "1000T")
    with pytest.raises(BelowFreeSpaceFloor, match="resume refused"):
        await orch.resume(paused.sandbox_id)
    assert orch.get(paused.sandbox_id).state == "paused"
    # A running sandbox is answered as before: it needs no new space.
    with pytest.raises(Conflict):
        await orch.resume(running.sandbox_id)
    set_floor(node, None)
    assert (await orch.resume(paused.sandbox_id)).state == "running"


async def test_health_degrades_below_the_floor_and_says_why(node: Node) -> None:
    app = create_app(node.orchestrator, "key", manage_lifecycle=False)
    async with in_process_client(app, "key") as client:
        healthy = (await client.get("/health")).json()
        assert healthy["status"] == "ok" and healthy["disk"]["floorBytes"] == 0
        assert healthy["disk"]["freeBytes"] > 0
        set_floor(node, "1000T")
        degraded = await client.get("/health")
        assert degraded.status_code == 200  # the node answers; its status says degraded
        body = degraded.json()
        assert body["status"] == "degraded"
        assert body["disk"]["floorBytes"] == 1000 << 40
        assert "below its free-space floor" in body["detail"] and "507" in body["detail"]
        refused = await client.post("/v2/sandboxes", json={"templateID": FAKE_TEMPLATE})
        assert refused.status_code == 507 and refused.json()["code"] == 507
        paths = (await client.get("/openapi.json")).json()["paths"]
        for path in [
            "/sandboxes",
            "/v2/sandboxes",
            "/sandboxes/{sandbox_id}/connect",
            "/v2/sandboxes/{sandbox_id}/connect",
            "/sandboxes/{sandbox_id}/resume",
            "/sandboxes/{sandbox_id}/snapshots",
            "/sandboxes/{sandbox_id}/fork",
        ]:
            assert "507" in paths[path]["post"]["responses"], path


async def test_a_create_that_fails_on_a_full_disk_is_a_507(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no floor (or space just above it), a guest restored on a disk without room
    for its RAM file fails as whatever broke first; the caller is told it was the disk."""
    orch = node.orchestrator
    node.driver.fail_next("restore", VMMStartError("QEMU exited: signal 7"))
    full = DiskSpace(free_bytes=1 << 20, total_bytes=GIB, floor_bytes=0)
    monkeypatch.setattr(orch._free_space, "reading", lambda: full)
    with pytest.raises(OutOfSpace, match="starting a sandbox: out of space") as raised:
        await orch.create(FAKE_TEMPLATE)
    assert "1 MiB free" in str(raised.value) and "signal 7" in str(raised.value)
    assert http_status(raised.value) == 507
    assert orch.store.list_sandboxes() == []
    # With room, a failure is what it was.
    monkeypatch.undo()
    node.driver.fail_next("restore", VMMStartError("QEMU exited: signal 7"))
    with pytest.raises(SandboxStartFailed):
        await orch.create(FAKE_TEMPLATE)


# -- a VMM killed by SIGBUS -----------------------------------------------------------------


async def test_a_vmm_killed_by_sigbus_on_a_full_disk_is_reported(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    set_floor(node, "1000T")
    with caplog.at_level(logging.WARNING, logger="agentenv.orchestrator"):
        node.driver.crash(vm_dir(view), returncode=-signal.SIGBUS)
        await orch.get_settled(view.sandbox_id)
    rec = orch.store.get_sandbox(view.sandbox_id)
    assert rec is not None and rec.state == SandboxState.PAUSED
    assert rec.pause_mode == "filesystem"
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = error.getMessage()
    assert view.sandbox_id in message and "SIGBUS" in message
    assert "the data filesystem is full" in message and "filesystem-only pause" in message


async def test_a_sigbus_with_room_left_is_not_blamed_on_the_disk(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="agentenv.orchestrator"):
        node.driver.crash(vm_dir(view), returncode=-signal.SIGBUS)
        await orch.get_settled(view.sandbox_id)
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]
    (warning,) = [r for r in caplog.records if "SIGBUS" in r.getMessage()]
    assert "could not be backed" in warning.getMessage()


# -- commits that find no space -------------------------------------------------------------


def _no_space(*_: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_a_commit_that_finds_no_space_stops_and_is_reported(
    node: Node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)

    def committing() -> bool:
        return any(
            orch._supervisor.job("commit", s.snapshot_id) for s in orch.store.list_snapshots()
        )

    with monkeypatch.context() as patched:
        patched.setattr(PosixObjectStore, "_install", _no_space)
        patched.setattr(PosixObjectStore, "_install_if_absent", _no_space)
        # A commit the caller waits for answers 507 at once.
        with pytest.raises(OutOfSpace, match="out of space"):
            await orch.snapshot(view.sandbox_id, "waited", wait_commit=True)
        with caplog.at_level(logging.WARNING):
            later = await orch.snapshot(view.sandbox_id, "later")
            dropped = await orch.snapshot(view.sandbox_id, "dropped")
            await _until(lambda: not committing())
        stopped = [r for r in caplog.records if "stopped" in r.getMessage()]
        assert len(stopped) == 2 and {r.levelno for r in stopped} == {logging.ERROR}
        assert later.snapshot_id in stopped[0].getMessage()
        assert not [r for r in caplog.records if "retrying" in r.getMessage()]
        problem = orch.node_status().problem
        assert problem is not None and later.snapshot_id in problem and "space" in problem
        # Still usable on this node.
        child = await orch.create("later")
        assert child.state == "running"
        # Deleted, one is no longer reported.
        await orch.delete_snapshot(dropped.snapshot_id)
        problem = orch.node_status().problem
        assert problem is not None and dropped.snapshot_id not in problem
    # Room again: the next commit that succeeds takes the stopped one along.
    after = await orch.snapshot(view.sandbox_id, "after")
    await _until(lambda: not committing())
    for snap in (later, after):
        assert SnapshotDir(snap.record.snapshot_dir).committed()
    assert orch.node_status().problem is None
    assert (await orch.get_snapshot("later")).snapshot_id == later.snapshot_id

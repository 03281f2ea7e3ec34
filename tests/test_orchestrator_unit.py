"""The orchestrator without root or VMs: the state machine, the lifecycle through the
facade, rollbacks, recovery after a restart and handoff between nodes, on the fakes of
:mod:`tests.fakes` (a few seconds in all)."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from agentenv.config import Config
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.errors import (
    Conflict,
    OperationFailed,
    SandboxNotFound,
    SandboxStartFailed,
)
from agentenv.orchestrator.layout import SandboxDir, SnapshotDir
from agentenv.orchestrator.states import (
    TRANSITIONS,
    IllegalTransition,
    SandboxState,
    StateChanged,
)
from agentenv.orchestrator.store import SandboxEvent, SandboxRecord, Store, utcnow
from agentenv.orchestrator.views import SandboxView
from agentenv.storage.images import backing_chain
from agentenv.vmm.base import VMMCommandError, VMMStartError, VMRunState
from tests.fakes import FAKE_TEMPLATE, FakeDriver, Node, start_node, vm_dir

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)

S = SandboxState


class ServerCrash(BaseException):
    """Raised by a fake driver call to stop an operation dead where it is, as a server
    crash would: not an ``Exception``, so no rollback handler catches it."""


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "a", tmp_path / "repository")
    yield started
    await started.stop()


def record(node: Node, sandbox_id: str) -> SandboxRecord:
    rec = node.orchestrator.store.get_sandbox(sandbox_id)
    assert rec is not None
    return rec


async def restart(node: Node, **changes: object) -> Node:
    """The same host's next server: same data directory and network, a new driver
    (VMMs outlive their server)."""
    await node.stop()
    return await start_node(
        node.config.home,
        Path(node.config.repository_url.removeprefix("file://")),
        network=node.network,
        node_id=node.config.node_name,
        **changes,  # type: ignore[arg-type]
    )


# -- the state machine ---------------------------------------------------------------------
def _record(sandbox_id: str, state: SandboxState, slot: int = 0) -> SandboxRecord:
    now = utcnow()
    return SandboxRecord(
        sandbox_id=sandbox_id,
        template_id="t",
        template_build_id="b",
        state=state,
        slot=slot,
        workdir=Path("/nonexistent") / sandbox_id,
        started_at=now,
        end_at=now + timedelta(seconds=60),
        vcpus=1,
        memory_mib=128,
        disk_size_mib=1,
        envd_version="0",
    )


@pytest.fixture
def store() -> Iterator[Store]:
    opened = Store(None)
    opened.open()
    yield opened
    opened.close()


EDGES = [(old, new) for old, targets in TRANSITIONS.items() for new in sorted(targets)]
NON_EDGES = [(old, new) for old in S for new in S if new not in TRANSITIONS[old]]


@pytest.mark.parametrize(("old", "new"), EDGES, ids=[f"{o}->{n}" for o, n in EDGES])
def test_every_transition_is_allowed(store: Store, old: SandboxState, new: SandboxState) -> None:
    store.insert_sandbox(_record("s", old))
    events: list[SandboxEvent] = []
    store.listen(events.append)
    store.transition("s", old, new, pause_mode="full")
    rec = store.get_sandbox("s")
    assert rec is not None and rec.state == new and rec.pause_mode == "full"
    assert [(e.old, e.new) for e in events] == [(old, new)]


def test_every_other_change_is_refused(store: Store) -> None:
    assert len(NON_EDGES) > 40
    for i, (old, new) in enumerate(NON_EDGES):
        store.insert_sandbox(_record(f"s{i}", old, slot=i))
        with pytest.raises(IllegalTransition):
            store.transition(f"s{i}", old, new)
        rec = store.get_sandbox(f"s{i}")
        assert rec is not None and rec.state == old


def test_state_changes_only_through_transition(store: Store) -> None:
    store.insert_sandbox(_record("s", S.RUNNING))
    with pytest.raises(ValueError):
        store.update_sandbox("s", state="paused")


def test_losing_compare_and_set_writes_nothing(store: Store) -> None:
    store.insert_sandbox(_record("s", S.RUNNING))
    before = store.get_sandbox("s")
    events: list[SandboxEvent] = []
    store.listen(events.append)
    with pytest.raises(StateChanged) as lost:
        store.transition("s", S.PAUSED, S.RESUMING, end_at=utcnow() + timedelta(days=1))
    assert lost.value.actual == S.RUNNING and lost.value.expected == S.PAUSED
    assert store.get_sandbox("s") == before
    assert events == []
    with pytest.raises(StateChanged) as gone:
        store.transition("missing", S.RUNNING, S.PAUSING)
    assert gone.value.actual is None
    assert isinstance(gone.value, Conflict)


async def test_events_follow_the_lifecycle_in_order(tmp_path: Path) -> None:
    node = await start_node(tmp_path / "a", tmp_path / "repository", in_memory_store=True)
    events: list[SandboxEvent] = []
    node.orchestrator.store.listen(events.append)
    orch = node.orchestrator
    try:
        sandbox_id = (await orch.create(FAKE_TEMPLATE)).sandbox_id
        await orch.pause(sandbox_id)
        await orch.resume(sandbox_id)
        await orch.kill(sandbox_id)
    finally:
        await node.stop()
    assert [(e.old, e.new) for e in events if e.sandbox_id == sandbox_id] == [
        (None, S.CREATING),
        (S.CREATING, S.RUNNING),
        (S.RUNNING, S.PAUSING),
        (S.PAUSING, S.PAUSED),
        (S.PAUSED, S.RESUMING),
        (S.RESUMING, S.RUNNING),
        (S.RUNNING, S.KILLING),
        (S.KILLING, None),
    ]


# -- the lifecycle through the facade ---------------------------------------------------------
@pytest.mark.parametrize("sandbox_memory", ["file", "shared-image"])
async def test_create_pause_resume_kill(tmp_path: Path, sandbox_memory: str) -> None:
    node = await start_node(
        tmp_path / "a",
        tmp_path / "repository",
        sandbox_memory=sandbox_memory,  # type: ignore[arg-type]
    )
    orch = node.orchestrator
    try:
        view = await orch.create(
            FAKE_TEMPLATE, metadata={"k": "v"}, env_vars={"A": "1"}, secure=True
        )
        sandbox_id = view.sandbox_id
        assert orch.get(sandbox_id).state == "running"
        assert view.record.memory_mode == ("shared" if sandbox_memory == "file" else "private")
        assert node.driver.running(vm_dir(view))
        assert view.record.slot in node.network.live
        (init,) = node.envd.inits(view.guest_address)
        assert init.json()["envVars"] == {"A": "1"}
        assert init.json()["accessToken"] == view.record.envd_token

        paused = await orch.pause(sandbox_id)
        assert paused.state == "paused" and orch.get(sandbox_id).state == "paused"
        directory = SandboxDir(view.record.workdir)
        assert directory.paused_manifest.exists()
        assert not node.driver.running(vm_dir(view))
        with pytest.raises(Conflict):
            await orch.pause(sandbox_id)

        resumed = await orch.resume(sandbox_id)
        assert resumed.state == "running" and orch.get(sandbox_id).state == "running"
        # Resuming restores the saved machine (the RAM file is the sandbox's own after it).
        assert node.driver.calls[-1] == ("restore", vm_dir(view))
        assert resumed.record.memory_mode == "shared"
        assert not directory.paused.exists()
        settling = orch._lifecycle.inits.running(sandbox_id)
        if settling is not None:
            await settling
        assert len(node.envd.inits(view.guest_address)) == 2
        assert (await orch.ready_for_traffic(sandbox_id)).state == "running"

        await orch.kill(sandbox_id)
        with pytest.raises(SandboxNotFound):
            orch.get(sandbox_id)
        assert orch.store.get_sandbox(sandbox_id) is None
        assert not view.record.workdir.exists()
        assert node.network.live == set()
        with pytest.raises(SandboxNotFound):
            await orch.kill(sandbox_id)
    finally:
        await node.stop()


async def test_auto_memory_gives_every_sandbox_a_ram_file_of_its_own(tmp_path: Path) -> None:
    """``auto`` never maps a template's RAM file privately, even without reflinks (a
    guest can zero pages of such a file through the balloon): a copy of its own."""
    node = await start_node(tmp_path / "a", tmp_path / "repository", sandbox_memory="auto")
    try:
        view = await node.orchestrator.create(FAKE_TEMPLATE)
        assert view.record.memory_mode == "shared"
        assert SandboxDir(view.record.workdir).memory_file.exists()
    finally:
        await node.stop()


async def test_kill_keeps_the_slot_until_its_network_is_gone(node: Node) -> None:
    """A kill answers before the network's removal finishes (the kernel's veth deletion
    is slow), but no sandbox is given that slot until it has; then the slot is free."""
    orch = node.orchestrator
    first = await orch.create(FAKE_TEMPLATE)
    slot = first.record.slot
    removing = asyncio.Event()
    removed = asyncio.Event()
    real_destroy = node.network.destroy

    async def slow_destroy(s: int) -> None:
        removing.set()
        await removed.wait()
        await real_destroy(s)

    node.network.destroy = slow_destroy  # type: ignore[method-assign,assignment]
    await orch.kill(first.sandbox_id)
    await asyncio.wait_for(removing.wait(), 10)
    assert slot in node.network.live, "still being removed"
    second = await orch.create(FAKE_TEMPLATE)
    assert second.record.slot != slot
    removed.set()
    await orch._slots.drain()
    assert slot not in node.network.live
    third = await orch.create(FAKE_TEMPLATE)
    assert third.record.slot == slot
    for view in (second, third):
        await orch.kill(view.sandbox_id)


async def test_kill_stops_a_resumes_envd_init(node: Node) -> None:
    # A resumed guest whose envd never answers: its /init retries in the background
    # until the sandbox is killed, then stops at once instead of running out its time.
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    await orch.pause(view.sandbox_id)
    node.envd.unreachable.add(view.guest_address)
    await orch.resume(view.sandbox_id)
    settling = orch._lifecycle.inits.running(view.sandbox_id)
    assert settling is not None and not settling.done()
    await orch.kill(view.sandbox_id)
    await asyncio.wait_for(asyncio.gather(settling, return_exceptions=True), 1.0)
    assert settling.cancelled()


async def test_filesystem_only_pause_boots_on_resume(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    await orch.pause(view.sandbox_id, memory=False)
    rec = record(node, view.sandbox_id)
    assert rec.state == S.PAUSED and rec.pause_mode == "filesystem"
    # The guest was asked to write its page cache out first.
    assert any(r.path == "/process.Process/Start" for r in node.envd.requests)
    assert not SandboxDir(rec.workdir).memory_file.exists()
    assert rec.slot not in node.network.live
    await orch.resume(view.sandbox_id)
    assert node.driver.calls[-1] == ("boot", vm_dir(view))
    assert orch.get(view.sandbox_id).state == "running"


async def test_snapshot_starts_sandboxes_and_its_source_runs_on(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    old_disk = view.record.disk_path
    snap = await orch.snapshot(view.sandbox_id, "first", metadata={"m": "1"}, wait_commit=True)
    assert snap.names == ["first"] and snap.record.state == "ready"
    assert SnapshotDir(snap.record.snapshot_dir).committed()
    rec = record(node, view.sandbox_id)
    assert rec.state == S.RUNNING and rec.snapshot_id == snap.snapshot_id
    # Sealed: the sandbox writes on into a new top over the snapshot's disk.
    assert rec.disk_path != old_disk and rec.disk_path is not None
    assert SnapshotDir(snap.record.snapshot_dir).disk in backing_chain(rec.disk_path)
    with pytest.raises(Conflict):
        await orch.snapshot(view.sandbox_id, "first")

    child = await orch.create("first")
    assert child.record.snapshot_id == snap.snapshot_id
    assert child.record.source_dir == snap.record.snapshot_dir
    listed = await orch.list_snapshots(view.sandbox_id)
    assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
    # The source pauses and resumes as before.
    await orch.pause(view.sandbox_id)
    await orch.resume(view.sandbox_id)


async def test_fork_children_record_their_parent(node: Node) -> None:
    orch = node.orchestrator
    parent = await orch.create(FAKE_TEMPLATE, metadata={"role": "parent"}, secure=True)
    children = await orch.fork(parent.sandbox_id, count=2)
    views = [c for c in children if isinstance(c, SandboxView)]
    assert len(views) == 2
    assert orch.get(parent.sandbox_id).state == "running"
    assert set(orch.get(parent.sandbox_id).children) == {v.sandbox_id for v in views}
    image = views[0].record.snapshot_id
    assert image is not None
    for child in views:
        assert child.record.parent_id == parent.sandbox_id
        assert child.record.metadata == {"role": "parent"}
        assert child.record.memory_mode == "private"
        assert child.record.envd_token not in (None, parent.record.envd_token)
        assert child.record.snapshot_id == image
    assert len({v.record.slot for v in [parent, *views]}) == 3
    # The fork image is hidden, and kept while its children use it.
    image_rec = orch.store.get_snapshot(image)
    assert image_rec is not None and image_rec.state == "deleted"
    assert image_rec.snapshot_dir.exists()
    for child in views:
        await orch.kill(child.sandbox_id)
    await orch.kill(parent.sandbox_id)
    assert orch.store.get_snapshot(image) is None
    assert not image_rec.snapshot_dir.exists()


@pytest.mark.parametrize("reporting", [True, False])
async def test_fork_children_of_a_guest_that_reports_free_pages_get_ram_of_their_own(
    tmp_path: Path, reporting: bool
) -> None:
    # Its driver would punch the pages the guest frees out of a fork image the children
    # all mapped privately. With free_page_reporting off, children share the image.
    node = await start_node(
        tmp_path / "a",
        tmp_path / "repository",
        sandbox_memory="file",
        configure=lambda c: c.model_copy(update={"free_page_reporting": reporting}),
    )
    orch = node.orchestrator
    try:
        parent = await orch.create(FAKE_TEMPLATE)
        assert parent.record.memory_mode == "shared"
        # The fake template was made without the feature: its sandboxes do not report,
        # and their children map the fork image privately.
        (child,) = await orch.fork(parent.sandbox_id, count=1)
        assert isinstance(child, SandboxView) and child.record.memory_mode == "private"
        # A boot (the resume of a filesystem-only pause) of a sandbox with RAM of its own
        # has it.
        await orch.pause(parent.sandbox_id, memory=False)
        await orch.resume(parent.sandbox_id)
        (child,) = await orch.fork(parent.sandbox_id, count=1)
        mode = "shared" if reporting else "private"
        assert isinstance(child, SandboxView) and child.record.memory_mode == mode
        # Its children too: the child's own snapshots keep the balloon (a private
        # child's stream RAM, which lands in a file of the grandchild's own anyway).
        (grandchild,) = await orch.fork(child.sandbox_id, count=1)
        assert isinstance(grandchild, SandboxView)
        assert grandchild.record.memory_mode == "shared"
    finally:
        await node.stop()


async def test_envd_init_in_background(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A create with ``envd_in_background`` answers before envd's /init; traffic, pause,
    snapshot and fork wait for it; a sandbox whose first /init failed takes no traffic
    (its envd has no token yet) and can still be killed."""
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE, secure=True, envd_in_background=True)
    sandbox_id = view.sandbox_id
    assert orch.get(sandbox_id).state == "running"
    ready = await orch.ready_for_traffic(sandbox_id)
    (init,) = node.envd.inits(view.guest_address)
    assert init.json()["accessToken"] == ready.record.envd_token
    assert orch._lifecycle.inits.running(sandbox_id) is None
    paused = await orch.pause(sandbox_id)
    assert paused.state == "paused"
    await orch.kill(sandbox_id)

    # An operation right after the create waits for the /init, not beside it.
    gate = asyncio.Event()
    real_init = envd_client.init

    async def gated_init(*args: Any, **kwargs: Any) -> int:
        await gate.wait()
        return await real_init(*args, **kwargs)

    monkeypatch.setattr(envd_client, "init", gated_init)
    inits_before = len(node.envd.inits())
    second = await orch.create(FAKE_TEMPLATE, envd_in_background=True)
    assert orch._lifecycle.inits.running(second.sandbox_id) is not None
    snapshotting = asyncio.ensure_future(orch.snapshot(second.sandbox_id, "after-init"))
    await asyncio.sleep(0.2)
    assert not snapshotting.done() and len(node.envd.inits()) == inits_before
    gate.set()
    await snapshotting
    assert len(node.envd.inits()) == inits_before + 1
    assert orch._lifecycle.inits.running(second.sandbox_id) is None
    await orch.kill(second.sandbox_id)
    monkeypatch.setattr(envd_client, "init", real_init)

    # Traffic waiting for the /init of a sandbox that is killed meanwhile is told the
    # sandbox is gone (the kill cancels the /init; the waiter is not cancelled with it).
    gate.clear()
    monkeypatch.setattr(envd_client, "init", gated_init)
    doomed = await orch.create(FAKE_TEMPLATE, envd_in_background=True)
    waiting = asyncio.ensure_future(orch.ready_for_traffic(doomed.sandbox_id))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await orch.kill(doomed.sandbox_id)
    with pytest.raises(SandboxNotFound):
        await asyncio.wait_for(waiting, 10)
    monkeypatch.setattr(envd_client, "init", real_init)

    node.envd.init_status = 500
    broken = await orch.create(FAKE_TEMPLATE, secure=True, envd_in_background=True)
    with pytest.raises(OperationFailed, match="envd /init failed"):
        await orch.ready_for_traffic(broken.sandbox_id)
    await orch.kill(broken.sandbox_id)
    assert orch.store.get_sandbox(broken.sandbox_id) is None


# -- rollbacks --------------------------------------------------------------------------------
async def test_failed_restore_in_create_leaves_nothing(node: Node) -> None:
    orch = node.orchestrator
    node.driver.fail_next("restore", VMMStartError("no room"))
    with pytest.raises(SandboxStartFailed, match="no room"):
        await orch.create(FAKE_TEMPLATE)
    assert orch.store.list_sandboxes() == []
    assert list(node.config.sandboxes_dir.iterdir()) == []
    assert node.network.live == set()
    # The slot it reserved is free again.
    assert (await orch.create(FAKE_TEMPLATE)).record.slot == 0


async def test_failed_envd_init_in_create_kills_the_vm(node: Node) -> None:
    orch = node.orchestrator
    node.envd.init_status = 500
    with pytest.raises(SandboxStartFailed):
        await orch.create(FAKE_TEMPLATE)
    assert orch.store.list_sandboxes() == []
    assert list(node.config.sandboxes_dir.iterdir()) == []
    assert len(node.driver.killed) == 1
    assert node.network.live == set()


async def test_failed_network_in_create_leaves_nothing(node: Node) -> None:
    orch = node.orchestrator
    node.network.fail_next("create", OSError("no veth"))
    with pytest.raises(SandboxStartFailed):
        await orch.create(FAKE_TEMPLATE)
    assert orch.store.list_sandboxes() == []
    assert list(node.config.sandboxes_dir.iterdir()) == []


async def test_failed_save_in_pause_leaves_it_running(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    node.driver.fail_next("save_state", VMMCommandError("disk full"))
    with pytest.raises(OperationFailed, match="disk full"):
        await orch.pause(view.sandbox_id)
    rec = record(node, view.sandbox_id)
    assert rec.state == S.RUNNING and orch.get(view.sandbox_id).state == "running"
    assert not SandboxDir(rec.workdir).paused.exists()
    vm = orch._machines.running_vm(rec)
    assert vm.state is VMRunState.RUNNING
    assert rec.slot in node.network.live
    # And it pauses once the disk has room.
    await orch.pause(view.sandbox_id)
    assert orch.get(view.sandbox_id).state == "paused"


async def test_failed_restore_in_resume_leaves_it_paused(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    await orch.pause(view.sandbox_id)
    node.driver.fail_next("restore", VMMStartError("no memory"))
    with pytest.raises(OperationFailed, match="no memory"):
        await orch.resume(view.sandbox_id)
    rec = record(node, view.sandbox_id)
    assert rec.state == S.PAUSED and orch.get(view.sandbox_id).state == "paused"
    assert SandboxDir(rec.workdir).paused_manifest.exists()
    assert rec.slot not in node.network.live
    await orch.resume(view.sandbox_id)
    assert orch.get(view.sandbox_id).state == "running"


async def test_failed_capture_before_seal_leaves_no_snapshot(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    node.driver.fail_next("seal_drive", VMMCommandError("no qcow2"))
    with pytest.raises(OperationFailed, match="no qcow2"):
        await orch.snapshot(view.sandbox_id, "never")
    rec = record(node, view.sandbox_id)
    assert rec.state == S.RUNNING and rec.disk_path == view.record.disk_path
    assert orch._machines.running_vm(rec).state is VMRunState.RUNNING
    assert orch.store.list_snapshots() == []
    assert list(node.config.snapshots_dir.iterdir()) == []
    assert await orch.list_snapshots() == []
    await orch.snapshot(view.sandbox_id, "never")


async def test_failed_capture_after_seal_keeps_the_sealed_layer(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)

    async def no_room(*args: object, **kwargs: object) -> bool:
        raise OSError("no space left on device")

    # Copying the RAM file is the step after the seal.
    monkeypatch.setattr("agentenv.orchestrator.capture.clone_file", no_room)
    with pytest.raises(OperationFailed, match="no space"):
        await orch.snapshot(view.sandbox_id, "half")
    monkeypatch.undo()
    rec = record(node, view.sandbox_id)
    assert rec.state == S.RUNNING
    assert orch._machines.running_vm(rec).state is VMRunState.RUNNING
    (snap,) = orch.store.list_snapshots()
    assert snap.state == "deleted" and snap.name is None
    # The sandbox's disk builds on the sealed layer: kept while it does.
    assert rec.disk_path is not None
    assert SnapshotDir(snap.snapshot_dir).disk in backing_chain(rec.disk_path)
    assert orch.collect_snapshots() == []
    assert await orch.list_snapshots() == []
    await orch.pause(view.sandbox_id)
    await orch.resume(view.sandbox_id)
    await orch.kill(view.sandbox_id)
    assert orch.store.list_snapshots() == []
    assert not snap.snapshot_dir.exists()


# -- recovery after a restart -----------------------------------------------------------------
async def test_restart_re_adopts_running_sandboxes(node: Node) -> None:
    view = await node.orchestrator.create(FAKE_TEMPLATE)
    after = await restart(node)
    try:
        rec = record(after, view.sandbox_id)
        assert rec.state == S.RUNNING
        assert after.orchestrator.get(view.sandbox_id).state == "running"
        assert rec.slot in after.network.live
        assert ("attach", vm_dir(view)) in after.driver.calls
        await after.orchestrator.pause(view.sandbox_id)
        await after.orchestrator.resume(view.sandbox_id)
    finally:
        await after.stop()


async def test_restart_completes_an_interrupted_pause(node: Node) -> None:
    view = await node.orchestrator.create(FAKE_TEMPLATE)
    # The server dies after the save, while letting go of the VMM...
    node.driver.fail_next("kill", ServerCrash())
    with pytest.raises(ServerCrash):
        await node.orchestrator.pause(view.sandbox_id)
    assert record(node, view.sandbox_id).state == S.PAUSING
    FakeDriver.die(vm_dir(view))  # ...and the VMM with it.
    after = await restart(node)
    try:
        rec = record(after, view.sandbox_id)
        assert rec.state == S.PAUSED and rec.pause_mode != "filesystem"
        assert rec.slot not in after.network.live
        await after.orchestrator.resume(view.sandbox_id)
        assert after.driver.calls[-1] == ("restore", vm_dir(view))
    finally:
        await after.stop()


async def test_restart_resumes_a_vm_stopped_mid_pause(node: Node) -> None:
    view = await node.orchestrator.create(FAKE_TEMPLATE)
    node.driver.fail_next("kill", ServerCrash())
    with pytest.raises(ServerCrash):
        await node.orchestrator.pause(view.sandbox_id)
    after = await restart(node)  # the VMM survived: the running VM wins
    try:
        rec = record(after, view.sandbox_id)
        assert rec.state == S.RUNNING
        assert not SandboxDir(rec.workdir).paused.exists()
        assert after.orchestrator._machines.running_vm(rec).state is VMRunState.RUNNING
    finally:
        await after.stop()


async def test_restart_settles_an_interrupted_snapshot(node: Node) -> None:
    view = await node.orchestrator.create(FAKE_TEMPLATE)
    node.driver.fail_next("seal_drive", ServerCrash())
    with pytest.raises(ServerCrash):
        await node.orchestrator.snapshot(view.sandbox_id, "cut")
    assert record(node, view.sandbox_id).state == S.SNAPSHOTTING
    after = await restart(node)
    try:
        rec = record(after, view.sandbox_id)
        assert rec.state == S.RUNNING
        assert after.orchestrator._machines.running_vm(rec).state is VMRunState.RUNNING
        assert after.orchestrator.store.list_snapshots() == []
        assert list(after.config.snapshots_dir.iterdir()) == []
    finally:
        await after.stop()


async def test_restart_keeps_a_sandbox_whose_vmm_died_as_filesystem_pause(node: Node) -> None:
    view = await node.orchestrator.create(FAKE_TEMPLATE)
    FakeDriver.die(vm_dir(view))
    after = await restart(node)
    try:
        rec = record(after, view.sandbox_id)
        assert rec.state == S.PAUSED and rec.pause_mode == "filesystem"
        assert after.orchestrator.get(view.sandbox_id).state == "paused"
        assert not SandboxDir(rec.workdir).memory_file.exists()
        assert rec.slot not in after.network.live
        await after.orchestrator.resume(view.sandbox_id)
        assert after.driver.calls[-1] == ("boot", vm_dir(view))
    finally:
        await after.stop()


async def test_restart_discards_creating_killing_and_orphans(node: Node) -> None:
    orch = node.orchestrator
    kept, creating, killing, orphan = [await orch.create(FAKE_TEMPLATE) for _ in range(4)]
    node.driver.fail_next("kill", ServerCrash())
    with pytest.raises(ServerCrash):
        await orch.kill(killing.sandbox_id)
    assert record(node, killing.sandbox_id).state == S.KILLING
    # As a crash mid-create leaves it (no transition leads back to creating), and a
    # directory whose record never made it.
    orch.store.db.execute(
        "UPDATE sandboxes SET state = 'creating' WHERE sandbox_id = ?", (creating.sandbox_id,)
    )
    orch.store.db.execute("DELETE FROM sandboxes WHERE sandbox_id = ?", (orphan.sandbox_id,))
    after = await restart(node)
    try:
        remaining = after.orchestrator.store.list_sandboxes()
        assert [r.sandbox_id for r in remaining] == [kept.sandbox_id]
        assert after.network.live == {kept.record.slot}
        for gone in (creating, killing, orphan):
            assert not gone.record.workdir.exists()
            assert not FakeDriver.running(vm_dir(gone))
        assert FakeDriver.running(vm_dir(kept))
    finally:
        await after.stop()


# -- handoff between nodes --------------------------------------------------------------------
async def _two_nodes(tmp_path: Path, *, same_token_key: bool = True) -> tuple[Node, Node]:
    """Two nodes sharing one repository (and, with ``same_token_key``, the key envd
    tokens are derived from). Their background handoff checks are off, so the tests
    decide when a node checks (:meth:`RepositorySync.check_handoffs`)."""
    repository = tmp_path / "repository"

    def key(config: Config) -> Config:
        return config.with_overrides(envd_token_key="5e" * 32) if same_token_key else config

    a = await start_node(
        tmp_path / "a", repository, node_id="node-a", watch_handoffs=False, configure=key
    )
    b = await start_node(
        tmp_path / "b",
        repository,
        node_id="node-b",
        template=False,
        watch_handoffs=False,
        configure=key,
    )
    return a, b


async def _paused_and_committed(node: Node, sandbox_id: str) -> None:
    await node.orchestrator.pause(sandbox_id)
    upload = node.orchestrator.pending_upload(sandbox_id)
    if upload is not None:
        await asyncio.wait_for(upload, 30)
    assert node.orchestrator.pause_committed(record(node, sandbox_id))


async def test_a_connect_right_after_a_pause_on_another_node_waits_for_its_commit(
    tmp_path: Path,
) -> None:
    """B adopts a sandbox A paused a moment ago, its upload still running: B waits for
    the commit A announced rather than answering not found. Resumed on A before its
    commit, the announcement is withdrawn and B answers not found at once."""
    a, b = await _two_nodes(tmp_path)
    try:
        view = await a.orchestrator.create(FAKE_TEMPLATE, metadata={"k": "v"})
        await a.orchestrator.pause(view.sandbox_id)
        assert not a.orchestrator.pause_committed(record(a, view.sandbox_id))
        adopted = await b.orchestrator.adopt(view.sandbox_id)
        assert adopted.state == "running" and adopted.record.metadata == {"k": "v"}

        other = await a.orchestrator.create(FAKE_TEMPLATE)
        await a.orchestrator.pause(other.sandbox_id)
        await a.orchestrator.resume(other.sandbox_id)
        with pytest.raises(SandboxNotFound):
            await asyncio.wait_for(b.orchestrator.adopt(other.sandbox_id), 5)
    finally:
        await a.stop()
        await b.stop()


async def test_a_node_with_another_token_key_does_not_take_a_sandbox(tmp_path: Path) -> None:
    """The paused record carries no token, only its digest: a node whose key derives
    another token refuses the sandbox before claiming it, so its owner keeps it."""
    a, b = await _two_nodes(tmp_path, same_token_key=False)
    try:
        view = await a.orchestrator.create(FAKE_TEMPLATE, secure=True)
        token = view.record.envd_token
        assert token is not None
        await _paused_and_committed(a, view.sandbox_id)
        repository = tmp_path / "repository"
        assert not any(
            token.encode() in path.read_bytes() for path in repository.rglob("*") if path.is_file()
        )
        with pytest.raises(OperationFailed, match="another key"):
            await b.orchestrator.adopt(view.sandbox_id)
        resumed = await a.orchestrator.resume(view.sandbox_id)
        assert resumed.state == "running" and resumed.record.envd_token == token
    finally:
        await a.stop()
        await b.stop()


async def test_handoff_to_another_node(tmp_path: Path) -> None:
    a, b = await _two_nodes(tmp_path)
    try:
        view = await a.orchestrator.create(FAKE_TEMPLATE, metadata={"k": "v"}, secure=True)
        sandbox_id = view.sandbox_id
        await _paused_and_committed(a, sandbox_id)

        adopted = await b.orchestrator.adopt(sandbox_id)
        assert adopted.state == "running" and adopted.record.metadata == {"k": "v"}
        assert adopted.record.envd_token == view.record.envd_token
        assert b.driver.calls[-1][0] == "restore"
        # A still has its copy until it checks who holds the sandbox.
        assert a.orchestrator.get(sandbox_id).state == "paused"
        await a.orchestrator.check_handoffs()
        with pytest.raises(SandboxNotFound):
            a.orchestrator.get(sandbox_id)
        assert not view.record.workdir.exists()
        assert a.network.live == set()
        # B carries on with it, and can hand it back.
        await _paused_and_committed(b, sandbox_id)
        back = await a.orchestrator.adopt(sandbox_id)
        assert back.state == "running"
        await b.orchestrator.check_handoffs()
        with pytest.raises(SandboxNotFound):
            b.orchestrator.get(sandbox_id)
    finally:
        await a.stop()
        await b.stop()


async def test_resume_on_the_old_node_after_a_handoff_is_refused(tmp_path: Path) -> None:
    a, b = await _two_nodes(tmp_path)
    try:
        sandbox_id = (await a.orchestrator.create(FAKE_TEMPLATE)).sandbox_id
        await _paused_and_committed(a, sandbox_id)
        await b.orchestrator.adopt(sandbox_id)
        with pytest.raises(Conflict, match="node-b"):
            await a.orchestrator.resume(sandbox_id)
        assert a.orchestrator.store.get_sandbox(sandbox_id) is None
        with pytest.raises(Conflict):
            await a.orchestrator.adopt(sandbox_id)
    finally:
        await a.stop()
        await b.stop()


# -- more paths ---------------------------------------------------------------------------------
async def test_restart_returns_an_interrupted_resume_to_paused(node: Node) -> None:
    view = await node.orchestrator.create(FAKE_TEMPLATE)
    await node.orchestrator.pause(view.sandbox_id)
    node.driver.fail_next("restore", ServerCrash())
    with pytest.raises(ServerCrash):
        await node.orchestrator.resume(view.sandbox_id)
    assert record(node, view.sandbox_id).state == S.RESUMING
    assert node.orchestrator.get(view.sandbox_id).state == "paused"
    after = await restart(node)
    try:
        rec = record(after, view.sandbox_id)
        assert rec.state == S.PAUSED and rec.slot not in after.network.live
        await after.orchestrator.resume(view.sandbox_id)
        assert after.orchestrator.get(view.sandbox_id).state == "running"
    finally:
        await after.stop()


async def test_a_fork_child_that_fails_does_not_take_the_others(node: Node) -> None:
    orch = node.orchestrator
    parent = await orch.create(FAKE_TEMPLATE)
    node.driver.fail_next("restore", VMMStartError("no room"))
    results = await orch.fork(parent.sandbox_id, count=3)
    failed = [r for r in results if isinstance(r, Exception)]
    started = [r for r in results if isinstance(r, SandboxView)]
    assert len(failed) == 1 and isinstance(failed[0], SandboxStartFailed)
    assert len(started) == 2
    assert {r.sandbox_id for r in orch.list_sandboxes()} == {
        parent.sandbox_id,
        *(v.sandbox_id for v in started),
    }
    assert len(list(node.config.sandboxes_dir.iterdir())) == 3


async def test_failed_auto_pause_keeps_it_running_and_retries_later(node: Node) -> None:
    orch = node.orchestrator
    # A second to live: the background reaper must not reach it before this test does.
    view = await orch.create(FAKE_TEMPLATE, timeout=1, auto_pause=True)
    node.driver.fail_next("save_state", VMMCommandError("disk full"))
    now = utcnow() + timedelta(seconds=2)
    assert await orch.reap_expired(now) == [view.sandbox_id]
    rec = record(node, view.sandbox_id)
    assert rec.state == S.RUNNING and rec.end_at > now
    assert await orch.reap_expired(rec.end_at) == [view.sandbox_id]
    assert record(node, view.sandbox_id).state == S.PAUSED


async def test_auto_resume_on_traffic(node: Node) -> None:
    orch = node.orchestrator
    plain = await orch.create(FAKE_TEMPLATE)
    auto = await orch.create(FAKE_TEMPLATE, auto_resume=True)
    await orch.pause(plain.sandbox_id)
    await orch.pause(auto.sandbox_id)
    with pytest.raises(Conflict):
        await orch.ready_for_traffic(plain.sandbox_id)
    assert (await orch.ready_for_traffic(auto.sandbox_id)).state == "running"


async def test_failed_resume_after_capture_is_an_operation_failure(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    node.driver.fail_next("resume", VMMCommandError("vcpu stuck"))
    with pytest.raises(OperationFailed):
        await orch.snapshot(view.sandbox_id, "stuck")
    # The capture completed but was reported failed: nothing keeps it.
    assert [s.state for s in orch.store.list_snapshots()] in ([], ["deleted"])


async def test_restart_finishes_an_envd_init_the_last_server_did_not(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server stopped after a create answered but before envd's /init in the
    background finished (a kill -9 of the server during a fork, in the suite): the next
    server runs that /init when it re-adopts the sandbox, so its envd takes the token
    the record holds, and not its parent's (a fork child) or none (a new sandbox)."""
    never = asyncio.Event()
    real_init = envd_client.init

    async def stuck_init(*args: Any, **kwargs: Any) -> None:
        await never.wait()

    monkeypatch.setattr(envd_client, "init", stuck_init)
    stuck = await node.orchestrator.create(FAKE_TEMPLATE, secure=True, envd_in_background=True)
    monkeypatch.setattr(envd_client, "init", real_init)
    done = await node.orchestrator.create(FAKE_TEMPLATE, secure=True)
    assert record(node, stuck.sandbox_id).envd_pending == "start"
    assert record(node, done.sandbox_id).envd_pending is None
    inits_before = len(node.envd.inits(stuck.guest_address))
    after = await restart(node, envd=node.envd)
    try:
        ready = await after.orchestrator.ready_for_traffic(stuck.sandbox_id)
        inits = node.envd.inits(stuck.guest_address)
        assert len(inits) == inits_before + 1
        assert inits[-1].json()["accessToken"] == ready.record.envd_token
        assert record(after, stuck.sandbox_id).envd_pending is None
        # One that had its /init gets none again.
        assert len(node.envd.inits(done.guest_address)) == 1
    finally:
        await after.stop()


async def test_a_store_error_after_envd_init_does_not_refuse_the_sandbox(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording that envd's /init is done is bookkeeping: a store that fails then (a
    full disk) leaves the /init owed in the record, for a restart to run again, but the
    sandbox, whose envd has its token, serves."""
    store = node.orchestrator.store
    real_update = store.update_sandbox

    def failing_update(sandbox_id: str, **changes: Any) -> None:
        if "envd_pending" in changes and changes["envd_pending"] is None:
            raise sqlite3.OperationalError("database or disk is full")
        real_update(sandbox_id, **changes)

    monkeypatch.setattr(store, "update_sandbox", failing_update)
    view = await node.orchestrator.create(FAKE_TEMPLATE, secure=True, envd_in_background=True)
    ready = await node.orchestrator.ready_for_traffic(view.sandbox_id)
    assert ready.record.sandbox_id == view.sandbox_id
    assert record(node, view.sandbox_id).envd_pending == "start"

"""A VMM that exits on its own while the server runs, on the fakes of :mod:`tests.fakes`:
the sandbox is settled as a filesystem-only pause (or removed when its disk is gone),
exits the server causes are not mistaken for crashes, and operations racing the exit
answer 409 or 404, never an internal error. The same with real VMs:
tests/test_vmm_liveness.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from agentenv.orchestrator.errors import Conflict, SandboxNotFound
from agentenv.orchestrator.layout import SandboxDir
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxRecord, utcnow
from agentenv.vmm.base import VMMExit, VMMGone
from agentenv.vmm.launch import LaunchSpec, launch
from agentenv.vmm.process import VMMProcess
from tests.fakes import FAKE_TEMPLATE, FakeVM, Node, start_node, vm_dir

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)

S = SandboxState


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "a", tmp_path / "repository")
    yield started
    await started.stop()


def record(node: Node, sandbox_id: str) -> SandboxRecord | None:
    return node.orchestrator.store.get_sandbox(sandbox_id)


async def settled(node: Node, sandbox_id: str) -> SandboxRecord | None:
    """The record once no operation (the settling included) is queued on the sandbox."""
    for _ in range(100):
        await asyncio.sleep(0)
    await node.orchestrator._liveness.settled(sandbox_id)
    return record(node, sandbox_id)


async def test_a_process_exit_is_reported_without_polling(tmp_path: Path) -> None:
    """``VMMProcess.exited`` wakes on the pidfd with the status: the signal for a child
    this server started, unknown for an adopted process (not ours to wait for)."""
    spec = LaunchSpec(
        argv=("sleep", "60"), cwd=tmp_path, stdout=tmp_path / "out", stderr=tmp_path / "err"
    )
    process = launch(spec)
    other = launch(spec)
    other.detach()
    adopted = VMMProcess.adopt(other.pid)
    try:
        waiting = asyncio.ensure_future(process.exited())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        os.kill(process.pid, signal.SIGKILL)
        assert await asyncio.wait_for(waiting, 5) == -signal.SIGKILL
        os.kill(adopted.pid, signal.SIGKILL)
        assert await asyncio.wait_for(adopted.exited(), 5) is None
    finally:
        for pid in (process.pid, other.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222
    assert VMMExit(7, -9, "").describe() == "pid 7 was killed by signal 9 (SIGKILL)"
    assert VMMExit(7, 1, "").describe() == "pid 7 exited with status 1"
    assert "status unknown" in VMMExit(7, None, "").describe()
    assert VMMExit(7, 0, "", "guest-reset").describe() == (
        "pid 7 exited with status 0 (the guest reset: a reboot it asked for, or a triple "
        "fault: guest-reset)"
    )
    assert VMMExit(7, 0, "", "something-new").describe().endswith("(the VMM said: something-new)")


async def test_a_crashed_vmm_leaves_a_filesystem_pause(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="agentenv.orchestrator"):
        node.driver.crash(vm_dir(view))
        rec = await settled(node, view.sandbox_id)
    assert rec is not None and rec.state == S.PAUSED and rec.pause_mode == "filesystem"
    assert orch.get(view.sandbox_id).state == "paused"
    assert rec.slot not in node.network.live
    assert not SandboxDir(rec.workdir).memory_file.exists()
    assert orch._machines.current(view.sandbox_id) is None
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert view.sandbox_id in message and "killed by signal 9 (SIGKILL)" in message
    assert "filesystem-only pause" in message and "fake console" in message
    # Metrics of a sandbox that is not running: none, not an error.
    assert await orch.guest_metrics(view.sandbox_id) is None
    # Connect boots it from its disk.
    resumed = await orch.resume(view.sandbox_id)
    assert resumed.state == "running"
    assert node.driver.calls[-1] == ("boot", vm_dir(view))
    # The new VM is watched in turn.
    node.driver.crash(vm_dir(view))
    rec = await settled(node, view.sandbox_id)
    assert rec is not None and rec.state == S.PAUSED


async def test_a_crashed_vmm_without_its_disk_removes_the_sandbox(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    rec = record(node, view.sandbox_id)
    assert rec is not None and rec.disk_path is not None
    rec.disk_path.unlink()
    with caplog.at_level(logging.WARNING, logger="agentenv.orchestrator"):
        node.driver.crash(vm_dir(view), returncode=1)
        assert await settled(node, view.sandbox_id) is None
    assert "exited with status 1" in caplog.text and "removing the sandbox" in caplog.text
    with pytest.raises(SandboxNotFound):
        orch.get(view.sandbox_id)
    assert rec.slot not in node.network.live
    assert not rec.workdir.exists()


async def test_exits_the_server_causes_are_not_crashes(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    orch = node.orchestrator
    paused, paused_fs, killed = [await orch.create(FAKE_TEMPLATE) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="agentenv.orchestrator"):
        await orch.pause(paused.sandbox_id)
        await orch.pause(paused_fs.sandbox_id, memory=False)
        await orch.kill(killed.sandbox_id)
        await settled(node, paused.sandbox_id)
    assert "VMM" not in caplog.text
    full = record(node, paused.sandbox_id)
    assert full is not None and full.state == S.PAUSED and full.pause_mode == "full"
    assert orch._liveness._settling == {}
    # A rolled-back resume kills the VM it started: not a crash either.
    node.driver.fail_next("resume", VMMGone("no"))
    await orch.resume(paused.sandbox_id)
    assert orch._machines._watches.keys() == {paused.sandbox_id}


async def test_operations_after_the_exit_see_a_paused_sandbox(node: Node) -> None:
    """Asked for in the same instant as the exit (before the watch had a turn): the
    operation finds the VM gone, settles the exit and answers 409; the settling the
    watch queued finds nothing left to do."""
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    node.driver.crash(vm_dir(view))
    with pytest.raises(Conflict, match="paused"):
        await orch.pause(view.sandbox_id)
    rec = await settled(node, view.sandbox_id)
    assert rec is not None and rec.state == S.PAUSED and rec.pause_mode == "filesystem"
    with pytest.raises(Conflict, match="already paused"):
        await orch.pause(view.sandbox_id)
    with pytest.raises(Conflict):
        await orch.snapshot(view.sandbox_id)
    with pytest.raises(Conflict):
        await orch.fork(view.sandbox_id)
    with pytest.raises(Conflict, match="paused"):
        await orch.ready_for_traffic(view.sandbox_id)


@pytest.mark.parametrize("operation", ["pause", "snapshot", "fork"])
async def test_an_exit_during_an_operation_is_settled_first(
    node: Node, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """The VMM dies while the operation is using it: its rollback leaves the sandbox
    running, then the exit is settled under the same lock and the caller gets 409."""
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    original = FakeVM.save_state

    async def dies(vm: FakeVM, dest: Path) -> object:
        vm.driver.crash(vm.workdir)
        await asyncio.sleep(0.01)  # the watch notices, and queues its settling
        return await original(vm, dest)

    monkeypatch.setattr(FakeVM, "save_state", dies)
    with pytest.raises(Conflict, match=r"paused: its VMM exited \(pid \d+ was killed by signal 9"):
        if operation == "pause":
            await orch.pause(view.sandbox_id)
        elif operation == "snapshot":
            await orch.snapshot(view.sandbox_id)
        else:
            await orch.fork(view.sandbox_id)
    rec = await settled(node, view.sandbox_id)
    assert rec is not None and rec.state == S.PAUSED and rec.pause_mode == "filesystem"
    assert orch.store.list_snapshots() == [] or all(
        s.state == "deleted" for s in orch.store.list_snapshots()
    )
    monkeypatch.undo()
    await orch.resume(view.sandbox_id)
    assert orch.get(view.sandbox_id).state == "running"


async def test_resume_right_after_the_exit_boots_the_sandbox(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE)
    node.driver.crash(vm_dir(view))
    resumed = await orch.resume(view.sandbox_id)  # before the watch had a turn
    assert resumed.state == "running"
    assert node.driver.calls[-1] == ("boot", vm_dir(view))


async def test_auto_resume_traffic_boots_a_crashed_sandbox(node: Node) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE, auto_resume=True)
    node.driver.crash(vm_dir(view))
    ready = await orch.ready_for_traffic(view.sandbox_id)
    assert ready.state == "running"
    assert node.driver.calls[-1] == ("boot", vm_dir(view))


@pytest.mark.parametrize("operation", ["snapshot", "fork"])
@pytest.mark.parametrize("reaper_first", [False, True])
async def test_capture_racing_the_reaper_answers_404_or_succeeds(
    node: Node, operation: str, reaper_first: bool
) -> None:
    orch = node.orchestrator
    view = await orch.create(FAKE_TEMPLATE, timeout=60)
    expired = utcnow() + timedelta(seconds=120)

    async def capture() -> object:
        if operation == "snapshot":
            return await orch.snapshot(view.sandbox_id)
        children = await orch.fork(view.sandbox_id, 3)
        for child in children:
            if isinstance(child, Exception):
                raise child
        return children

    # The operation asked for first takes the sandbox's lock first.
    if reaper_first:
        reaping = asyncio.ensure_future(orch.reap_expired(expired))
        capturing = asyncio.ensure_future(capture())
    else:
        capturing = asyncio.ensure_future(capture())
        reaping = asyncio.ensure_future(orch.reap_expired(expired))
    reaped, captured = await asyncio.gather(reaping, capturing, return_exceptions=True)
    assert reaped == [view.sandbox_id]
    if reaper_first:
        assert isinstance(captured, SandboxNotFound), repr(captured)
    else:
        assert not isinstance(captured, BaseException), repr(captured)
    with pytest.raises(SandboxNotFound):
        orch.get(view.sandbox_id)

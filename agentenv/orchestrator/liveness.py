"""Sandboxes whose VMM exited on its own (a QEMU crash, an OOM kill, a ``kill -9``):
noticed within milliseconds (:class:`~.machines.Machines` watches every attached VM's
process through its pidfd), logged with why (signal or exit status, the tail of the
VMM's log and of the guest console), and settled through the state machine as a
restart's recovery would: a sandbox whose disk survives becomes a filesystem-only pause
(it boots from its disk on connect or resume; its processes restart), any other is
removed. E2B has no "crashed" state, so the API shows ``paused`` or nothing. A VMM
killed by SIGBUS is said to have died of a full data filesystem when it did (its RAM
file could not grow; see :mod:`.diskspace` for why that is not reserved up front).

Only unexpected exits get here: the server detaches a VM (:meth:`Machines.pop`) before
it kills or stops it on purpose (kill, pause, rollbacks), and a settling re-checks,
under the sandbox's operation lock, that the VM that died is still the sandbox's
attached one. An operation that was using the VM when it died settles the exit itself
(it holds the lock) and answers :class:`Conflict` or :class:`SandboxNotFound`, never a
500 (:meth:`VmmLiveness.guard`).

Owns the settlings in progress; changes states only through :class:`~.lifecycle.Lifecycle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

from agentenv.orchestrator.diskspace import FreeSpaceFloor
from agentenv.orchestrator.errors import Conflict, SandboxNotFound
from agentenv.orchestrator.lifecycle import Lifecycle
from agentenv.orchestrator.machines import Machines
from agentenv.orchestrator.operations import SandboxOperations
from agentenv.orchestrator.states import VM_STATES, SandboxState
from agentenv.orchestrator.store import SandboxRecord, Store
from agentenv.vmm.base import VirtualMachine, VMMExit, VMRunState

log = logging.getLogger("agentenv.orchestrator")

T = TypeVar("T")

# The operation kind a settling runs as (joinable: a second notice joins the first).
SETTLE_OPERATION = "vmm-exit"
# How long an operation waits for the report of an exit it has seen (reading log tails).
EXIT_REPORT_LIMIT_S = 5.0


class VmmLiveness:
    def __init__(
        self,
        store: Store,
        machines: Machines,
        operations: SandboxOperations,
        lifecycle: Lifecycle,
        free_space: FreeSpaceFloor,
    ) -> None:
        self.store = store
        self.free_space = free_space
        self.machines = machines
        self.operations = operations
        self.lifecycle = lifecycle
        # Settlings queued or running, by sandbox: requests that must not act on a dead
        # VM (connect, metrics, proxied traffic) wait for them.
        self._settling: dict[str, asyncio.Task[None]] = {}
        machines.on_unexpected_exit(self._exited)

    def _exited(self, sandbox_id: str, vm: VirtualMachine, how: VMMExit) -> None:
        """Called by :class:`Machines` as soon as an attached VM's process has exited."""
        self._start_settling(sandbox_id, vm, how)

    def _start_settling(
        self, sandbox_id: str, vm: VirtualMachine, how: VMMExit
    ) -> asyncio.Task[None]:
        """Queue the settling behind any operation on the sandbox (the lock is FIFO, so
        before every operation asked for from now on); the one already queued, if any."""
        queued = self._settling.get(sandbox_id)
        if queued is not None:
            return queued
        task = asyncio.get_running_loop().create_task(
            self._settle_queued(sandbox_id, vm, how), name=f"settle-{sandbox_id}"
        )
        self._settling[sandbox_id] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self._settling.get(sandbox_id) is done:
                del self._settling[sandbox_id]

        task.add_done_callback(forget)
        return task

    async def _settle_queued(self, sandbox_id: str, vm: VirtualMachine, how: VMMExit) -> None:
        try:
            await self.operations.run(
                sandbox_id, SETTLE_OPERATION, lambda: self.settle(sandbox_id, vm, how), join=True
            )
        except Exception:
            # Left running with a dead VM; the next restart's recovery settles it.
            log.exception("sandbox %s: settling the exit of its VMM failed", sandbox_id)
        if self.store.get_sandbox(sandbox_id) is None:
            self.operations.forget(sandbox_id)

    async def settled(self, sandbox_id: str) -> None:
        """Once a VMM exit of the sandbox that has been noticed is settled (at once if
        there is none)."""
        task = self._settling.get(sandbox_id)
        if task is None:
            vm = self.machines.current(sandbox_id)
            if vm is None or vm.state is not VMRunState.STOPPED:
                return
            # The exit is known (the pidfd fired) but its watch has not had its turn.
            task = self._start_settling(sandbox_id, vm, await self._report(sandbox_id, vm))
        with contextlib.suppress(Exception):
            await asyncio.shield(task)

    async def _report(self, sandbox_id: str, vm: VirtualMachine) -> VMMExit:
        """How ``vm``, known to have exited, did."""
        how = self.machines.exit_of(sandbox_id)
        if how is None:
            try:
                how = await asyncio.wait_for(vm.wait_exit(), EXIT_REPORT_LIMIT_S)
            except TimeoutError:
                how = VMMExit(vm.pid, None, "(no report)")
        return how

    async def settle(self, sandbox_id: str, vm: VirtualMachine, how: VMMExit) -> bool:
        """Settle the exit of ``vm``, the sandbox's VM, as its disk allows; nothing if
        ``vm`` is no longer the sandbox's (the server released it meanwhile: a kill, a
        pause, a stale notice). Runs under the sandbox's operation lock. True if it
        settled something."""
        if self.machines.current(sandbox_id) is not vm:
            return False
        rec = self.store.get_sandbox(sandbox_id)
        self.machines.pop(sandbox_id)
        # Nothing runs any more; this releases what the handle still holds (its control
        # connection, socket, jail and cgroup). The sandbox is settled even if that
        # fails: left running without a VM, every request on it would fail.
        try:
            await vm.kill()
        except Exception as exc:
            log.warning("sandbox %s: releasing its exited VMM failed: %s", sandbox_id, exc)
        if rec is None or rec.state not in VM_STATES:
            return False
        why = f"{how.describe()}, not by this server"
        level = logging.WARNING
        if how.returncode == -signal.SIGBUS:
            cause, full = self._bus_error_cause(rec)
            why += f": {cause}"
            level = logging.ERROR if full else level
        disk = self.machines.current_disk(rec)[0]
        if disk.exists():
            await self.lifecycle.keep_disk_only(rec, rec.state)
            log.log(
                level,
                "sandbox %s: its VMM %s; kept as a filesystem-only pause (its disk "
                "survives; it boots from it on connect or resume, its processes restart)"
                "\n%s",
                sandbox_id,
                why,
                how.log_tail,
            )
        else:
            log.log(
                level,
                "sandbox %s: its VMM %s, and its disk %s is gone; removing the sandbox\n%s",
                sandbox_id,
                why,
                disk,
                how.log_tail,
            )
            if rec.state == SandboxState.RUNNING:
                await self.lifecycle.kill(sandbox_id)
            else:
                await self.machines.discard(rec)
        return True

    def _bus_error_cause(self, rec: SandboxRecord) -> tuple[str, bool]:
        """Why a VMM died of SIGBUS, and whether it was the data filesystem being full.
        A guest's RAM is a file on that filesystem (a reflink of its template's, so
        pages the guest writes need new blocks); a write fault the filesystem cannot
        back (ENOSPC), or a read it cannot serve, is a SIGBUS in the VMM."""
        disk = self.free_space.reading()
        if disk.too_full_for(rec.memory_mib << 20):
            return (
                f"the data filesystem is full ({disk.describe()}): the guest wrote to "
                "its RAM file and no block was left to back the write",
                True,
            )
        return f"a page of its RAM file could not be backed ({disk.describe()})", False

    async def guard(self, sandbox_id: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work``, an operation using the sandbox's VM, under the lock the caller
        holds. If it fails because the VM exited under it, the exit is settled here and
        then the operation answers as it would have once the sandbox was settled:
        :class:`Conflict` (paused: E2B's SDK takes a 409 to a pause as "already paused"
        and returns False rather than raise, and a 409 to a snapshot or fork says the
        sandbox is not running) or :class:`SandboxNotFound` if it was removed. Never the
        internal error the VMM's disappearance would otherwise surface as."""
        try:
            return await work()
        except Exception as exc:
            vm = self.machines.current(sandbox_id)
            # A VMM call fails with VMMGone only once the exit is noticed, so a VM that
            # still looks alive here failed for some other reason.
            if vm is None or vm.state is not VMRunState.STOPPED:
                raise
            how = await self._report(sandbox_id, vm)
            await self.settle(sandbox_id, vm, how)
            rec = self.store.get_sandbox(sandbox_id)
            if rec is None:
                raise SandboxNotFound(sandbox_id) from exc
            raise Conflict(
                f"sandbox {sandbox_id} is paused: its VMM exited ({how.describe()}); "
                "connect or resume boots it from its disk"
            ) from exc

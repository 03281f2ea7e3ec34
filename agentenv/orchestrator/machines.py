"""The VMM processes of a node's sandboxes: which ones this server holds, the machine
shape every restore of a sandbox presents, and removing what a sandbox leaves.

Owns the map of attached :class:`~agentenv.vmm.base.VirtualMachine` objects and watches
each for its process's exit (:meth:`VirtualMachine.wait_exit`, a pidfd underneath: no
polling). A VM that exits while still attached exited unexpectedly (the server detaches
a VM, :meth:`Machines.pop`, before it stops or kills it): the exit handler is told
(:class:`~.liveness.VmmLiveness` settles the sandbox). Does not change sandbox states
(its callers do, through the store) and does not decide when a VM starts or stops.
Asks the driver to record a started machine's working set (what later restores of its
snapshot read ahead) a few seconds after its start, or when it is about to go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from agentenv.network import NetworkManager
from agentenv.network.addresses import GUEST_MAC, TAP_NAME
from agentenv.orchestrator.errors import Conflict, GuestUnavailable, SandboxStartFailed
from agentenv.orchestrator.layout import SandboxDir
from agentenv.orchestrator.states import PUBLIC_STATE, SandboxState
from agentenv.orchestrator.store import SandboxRecord, Store
from agentenv.snapshots.layout import MachineSnapshot
from agentenv.storage.clone import flush_file
from agentenv.storage.images import DiskFormat
from agentenv.storage.volumes import make_empty_slot
from agentenv.vmm.base import (
    DriveSpec,
    MachineSpec,
    NetSpec,
    VirtualMachine,
    VMMDriver,
    VMMError,
    VMMExit,
    VMRunState,
)

log = logging.getLogger("agentenv.orchestrator")

#: Seconds after a new sandbox's envd /init before its working set is recorded.
WORKING_SET_AFTER_S = 3.0


#: Empty volume drives every template is snapshotted with (sparse files, nothing on
#: disk): at most this many volumes per sandbox.
VOLUME_SLOTS = 3


def slot_drive_id(index: int) -> str:
    """Drive id of volume slot ``index`` (see :mod:`agentenv.orchestrator.volumes`)."""
    return f"vol{index}"


def volume_slots(snap: MachineSnapshot) -> int:
    """How many volume slots machines of ``snap`` have (0: made before volumes)."""
    drives = snap.files.shape.get("drives", [])
    return sum(1 for d in drives if isinstance(d, str) and d.startswith("vol"))


def empty_volume_slots(directory: Path, count: int) -> tuple[DriveSpec, ...]:
    """``count`` empty volume slots, their files in ``directory``: what a template is
    snapshotted with."""
    drives = []
    for index in range(count):
        image = directory / f"{slot_drive_id(index)}.empty"
        make_empty_slot(image)
        drives.append(DriveSpec(slot_drive_id(index), image))
    return tuple(drives)


def disk_format(value: str) -> DiskFormat:
    if value not in ("raw", "qcow2"):
        raise SandboxStartFailed(f"template disk has unknown format {value!r}")
    return "qcow2" if value == "qcow2" else "raw"


class Machines:
    def __init__(
        self,
        driver: VMMDriver,
        network: NetworkManager,
        store: Store,
        accel: Literal["tcg", "kvm"],
    ) -> None:
        self.driver = driver
        self.network = network
        self.store = store
        self.accel = accel
        self._vms: dict[str, VirtualMachine] = {}
        # One task per attached VM, waiting for its process to exit.
        self._watches: dict[str, asyncio.Task[None]] = {}
        # How each attached VM that exited did: until its sandbox is settled.
        self._exits: dict[str, VMMExit] = {}
        self._exit_handler: Callable[[str, VirtualMachine, VMMExit], None] | None = None

    # -- the attached VMs ------------------------------------------------------------
    def on_unexpected_exit(self, handler: Callable[[str, VirtualMachine, VMMExit], None]) -> None:
        """Call ``handler(sandbox_id, vm, how)`` when an attached VM's process exits
        while it is still attached: nothing in this server meant it to."""
        self._exit_handler = handler

    def add(self, sandbox_id: str, vm: VirtualMachine) -> None:
        self._vms[sandbox_id] = vm
        self._stop_watching(sandbox_id)
        self._watches[sandbox_id] = asyncio.get_running_loop().create_task(
            self._watch(sandbox_id, vm), name=f"vmm-exit-{sandbox_id}"
        )

    async def record_working_set_soon(self, sandbox_id: str) -> None:
        """A few seconds into a new sandbox's life, what its guest touched of the RAM it
        was restored from becomes what later restores read ahead (once per snapshot:
        the driver keeps it; :mod:`agentenv.vmm.working_set`). The seconds let a first
        command, which usually follows a create, be part of it."""
        started = self.current(sandbox_id)
        await asyncio.sleep(WORKING_SET_AFTER_S)
        vm = self.current(sandbox_id)
        # The same machine: one paused and resumed meanwhile started from its own file.
        if vm is not None and vm is started and vm.state is VMRunState.RUNNING:
            await self.record_working_set(sandbox_id, vm)

    async def record_working_set(
        self, sandbox_id: str, vm: VirtualMachine, snapshot_memory: Path | None = None
    ) -> None:
        """Record ``vm``'s source's working set now, if it has none yet: a sandbox
        killed or paused within seconds of its start (short rollouts) would otherwise
        never leave one. With ``snapshot_memory`` (a RAM image just captured from
        ``vm``), what ``vm`` holds becomes that image's working set instead. A failure
        is logged: it costs later restores speed only."""
        try:
            recorded = await self.driver.record_working_set(vm, snapshot_memory)
        except OSError as exc:
            log.warning("sandbox %s: recording its working set failed: %s", sandbox_id, exc)
            return
        if recorded:
            log.info("sandbox %s: recorded a working set of %d KiB", sandbox_id, recorded // 1024)

    def pop(self, sandbox_id: str) -> VirtualMachine | None:
        """Detach the sandbox's VM (before stopping or killing it on purpose: its exit
        is then expected and not reported)."""
        self._stop_watching(sandbox_id)
        self._exits.pop(sandbox_id, None)
        return self._vms.pop(sandbox_id, None)

    def count(self) -> int:
        """VMMs driven now."""
        return len(self._vms)

    def current(self, sandbox_id: str) -> VirtualMachine | None:
        """The VM attached for ``sandbox_id``, alive or not."""
        return self._vms.get(sandbox_id)

    def exit_of(self, sandbox_id: str) -> VMMExit | None:
        """How the attached VM of ``sandbox_id`` exited, if it has (and has been seen
        to: the exit is noticed by the event loop, within milliseconds)."""
        return self._exits.get(sandbox_id)

    async def _watch(self, sandbox_id: str, vm: VirtualMachine) -> None:
        try:
            how = await vm.wait_exit()
        except Exception as exc:  # the handle cannot tell; its operations will
            log.error("watching the VMM of sandbox %s failed: %s", sandbox_id, exc)
            return
        if self._vms.get(sandbox_id) is not vm:
            return  # detached meanwhile: an exit this server caused
        self._exits[sandbox_id] = how
        if self._exit_handler is not None:
            self._exit_handler(sandbox_id, vm, how)

    def _stop_watching(self, sandbox_id: str) -> None:
        watch = self._watches.pop(sandbox_id, None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()

    def running_vm(self, rec: SandboxRecord) -> VirtualMachine:
        """The VM of a running sandbox; :class:`Conflict` if it is not running."""
        if rec.state != SandboxState.RUNNING:
            raise Conflict(f"sandbox {rec.sandbox_id} is {PUBLIC_STATE[rec.state]}, not running")
        vm = self._vms.get(rec.sandbox_id)
        if vm is None:
            raise GuestUnavailable(f"sandbox {rec.sandbox_id} has no VMM attached")
        return vm

    async def close_all(self) -> None:
        """Let go of every VMM (they keep running, to be re-adopted)."""
        for sandbox_id in list(self._watches):
            self._stop_watching(sandbox_id)
        for vm in self._vms.values():
            await vm.close()
        self._vms.clear()
        self._exits.clear()

    async def flush_shared_memory(self) -> None:
        """Write back the dirty pages of RAM files: a snapshot or fork must write back
        what is dirty while the guest is stopped, and doing it regularly keeps that to
        what changed in the last few seconds."""
        for sandbox_id, vm in list(self._vms.items()):
            if not vm.spec.memory_shared:
                continue
            try:
                await asyncio.to_thread(flush_file, vm.spec.memory_file)
            except OSError as exc:
                log.debug("flushing RAM of %s failed: %s", sandbox_id, exc)

    # -- what a sandbox's machine is -------------------------------------------------
    def spec(
        self,
        snap: MachineSnapshot,
        disk: Path,
        fmt: DiskFormat,
        memory_file: Path,
        memory_shared: bool,
        netns: str,
        volumes: Mapping[int, Path] | None = None,
        *,
        report_free_pages: bool = False,
    ) -> MachineSpec:
        """The machine a sandbox of snapshot ``snap`` runs as: every restore of it
        (create, resume) must present the same shape. A snapshot taken with volume
        slots gets them all back: ``volumes`` (slot → image) fills some, the others
        get empty files in the disk's directory."""
        slots = []
        for index in range(volume_slots(snap)):
            image = (volumes or {}).get(index)
            if image is None:
                image = disk.parent / f"{slot_drive_id(index)}.empty"
                if not image.exists():
                    make_empty_slot(image)
            slots.append(DriveSpec(slot_drive_id(index), image))
        return MachineSpec(
            vcpus=snap.vcpus,
            memory_mib=snap.memory_mib,
            kernel=snap.kernel,
            initrd=snap.initrd,
            cmdline=snap.cmdline,
            drives=(
                DriveSpec("root", disk, fmt=fmt),
                DriveSpec("tools", snap.tools_drive, read_only=True),
                *slots,
            ),
            memory_file=memory_file,
            memory_shared=memory_shared,
            # A boot's (a restore keeps its snapshot's).
            report_free_pages=report_free_pages and memory_shared,
            accel=self.accel,
            net=NetSpec(tap=TAP_NAME, mac=GUEST_MAC, netns=netns),
        )

    @staticmethod
    def current_disk(rec: SandboxRecord) -> tuple[Path, DiskFormat]:
        if rec.disk_path is None:
            return SandboxDir(rec.workdir).legacy_disk()
        return rec.disk_path, "qcow2" if rec.disk_path.suffix == ".qcow2" else "raw"

    # -- removal ---------------------------------------------------------------------
    async def kill_leftover(self, vm_dir: Path) -> None:
        """Kill the VMM whose files are in ``vm_dir``, if one still runs."""
        if not vm_dir.exists():
            return
        try:
            vm = await self.driver.attach(vm_dir)
        except VMMError:
            # Nothing to attach to may still be something running: a VMM whose record a
            # killed server never wrote, or whose monitor does not answer. The directory
            # goes, so it goes too, instead of running on unmanaged.
            killed = await self.driver.kill_strays(vm_dir)
            if killed:
                log.warning("killed stray VMM processes %s of %s", killed, vm_dir)
            return
        await vm.kill()

    async def discard(self, rec: SandboxRecord) -> None:
        """Remove everything a sandbox holds and its record, tolerating parts that are
        already gone (a crashed server's leftovers, a create that failed midway)."""
        self.pop(rec.sandbox_id)
        await self.kill_leftover(SandboxDir(rec.workdir).vm_dir)
        with contextlib.suppress(Exception):
            await self.network.destroy(rec.slot)
        shutil.rmtree(rec.workdir, ignore_errors=True)
        self.store.delete_sandbox(rec.sandbox_id)

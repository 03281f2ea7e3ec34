"""The VMM processes of a node's sandboxes: which ones this server holds, the machine
shape every restore of a sandbox presents, and removing what a sandbox leaves.

Owns the map of attached :class:`~agentenv.vmm.base.VirtualMachine` objects. Does not
change sandbox states (its callers do, through the store) and does not decide when a
VM starts or stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
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
from agentenv.vmm.base import DriveSpec, MachineSpec, NetSpec, VirtualMachine, VMMDriver, VMMError

log = logging.getLogger("agentenv.orchestrator")


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

    # -- the attached VMs ------------------------------------------------------------
    def add(self, sandbox_id: str, vm: VirtualMachine) -> None:
        self._vms[sandbox_id] = vm

    def pop(self, sandbox_id: str) -> VirtualMachine | None:
        return self._vms.pop(sandbox_id, None)

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
        for vm in self._vms.values():
            await vm.close()
        self._vms.clear()

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
    ) -> MachineSpec:
        """The machine a sandbox of snapshot ``snap`` runs as: every restore of it
        (create, resume) must present the same shape."""
        return MachineSpec(
            vcpus=snap.vcpus,
            memory_mib=snap.memory_mib,
            kernel=snap.kernel,
            initrd=snap.initrd,
            cmdline=snap.cmdline,
            drives=(
                DriveSpec("root", disk, fmt=fmt),
                DriveSpec("tools", snap.tools_drive, read_only=True),
            ),
            memory_file=memory_file,
            memory_shared=memory_shared,
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
        self._vms.pop(rec.sandbox_id, None)
        await self.kill_leftover(SandboxDir(rec.workdir).vm_dir)
        with contextlib.suppress(Exception):
            await self.network.destroy(rec.slot)
        shutil.rmtree(rec.workdir, ignore_errors=True)
        self.store.delete_sandbox(rec.sandbox_id)

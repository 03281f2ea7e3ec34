"""What a previous run of the server left, settled at startup: sandboxes whose VMM
survived are re-adopted, paused ones whose saved state is complete are kept, interrupted
operations are settled (see :mod:`.states` for the edges recovery uses), and what cannot
be recovered is removed: records, directories, snapshots and network resources.

Runs once, before the server takes requests; owns nothing afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

from agentenv.network import NetworkManager
from agentenv.orchestrator.layout import SandboxDir, SnapshotDir
from agentenv.orchestrator.lifecycle import Lifecycle
from agentenv.orchestrator.machines import Machines
from agentenv.orchestrator.resources import FilePins
from agentenv.orchestrator.states import VM_STATES, SandboxState
from agentenv.orchestrator.store import Store
from agentenv.vmm.base import VMMDriver, VMMError

log = logging.getLogger("agentenv.orchestrator")

S = SandboxState


class Recovery:
    def __init__(
        self,
        sandboxes_dir: Path,
        snapshots_dir: Path,
        store: Store,
        driver: VMMDriver,
        network: NetworkManager,
        machines: Machines,
        lifecycle: Lifecycle,
        pins: FilePins,
    ) -> None:
        self.sandboxes_dir = sandboxes_dir
        self.snapshots_dir = snapshots_dir
        self.store = store
        self.driver = driver
        self.network = network
        self.machines = machines
        self.lifecycle = lifecycle
        self.pins = pins

    async def run(self) -> None:
        kept = await self._sandboxes()
        known = {rec.workdir for rec in self.store.list_sandboxes()}
        if self.sandboxes_dir.exists():
            for path in self.sandboxes_dir.iterdir():
                if path not in known:
                    log.info("removing orphaned sandbox directory %s", path)
                    await self.machines.kill_leftover(SandboxDir(path).vm_dir)
                    shutil.rmtree(path, ignore_errors=True)
        self._snapshots()
        removed = await self.network.reclaim(kept)
        if removed:
            log.info("reclaimed leftover network resources: %s", ", ".join(removed))

    async def _sandboxes(self) -> set[int]:
        """Settle every recorded sandbox; the network slots of those kept running."""
        kept: set[int] = set()
        for rec in self.store.list_sandboxes():
            directory = SandboxDir(rec.workdir)
            saved = directory.saved()
            if rec.state in VM_STATES:
                try:
                    vm = await self.driver.attach(directory.vm_dir)
                except VMMError as exc:
                    # Whatever runs there unattached is killed before its files are
                    # kept or removed.
                    await self.driver.kill_strays(directory.vm_dir)
                    if rec.state == S.PAUSING and saved:
                        # The save finished; the crash came while releasing the VM.
                        await self.network.destroy(rec.slot)
                        self.store.transition(rec.sandbox_id, S.PAUSING, S.PAUSED)
                        log.info("sandbox %s: interrupted pause completed", rec.sandbox_id)
                        continue
                    disk = self.machines.current_disk(rec)[0]
                    if disk.exists():
                        # Its processes are gone, its files are not: keep it, paused,
                        # to be booted from its disk on resume, instead of losing it.
                        await self.lifecycle.keep_disk_only(rec, rec.state)
                        log.warning(
                            "sandbox %s lost its VMM (%s); kept as a filesystem-only pause "
                            "(its disk survives, its processes restart on resume)",
                            rec.sandbox_id,
                            exc,
                        )
                        continue
                    log.warning("sandbox %s lost (%s); cleaning it up", rec.sandbox_id, exc)
                else:
                    # A seal may have moved the disk to a new top before the crash.
                    drive = next(d for d in vm.spec.drives if d.drive_id == "root")
                    if rec.state != S.RUNNING:
                        # Stopped mid-save, mid-snapshot or mid-fork: the running VM wins.
                        with contextlib.suppress(VMMError):
                            await vm.resume()
                        directory.clear_paused()
                        self.store.transition(
                            rec.sandbox_id, rec.state, S.RUNNING, disk_path=drive.path
                        )
                    else:
                        self.store.update_sandbox(rec.sandbox_id, disk_path=drive.path)
                    self.machines.add(rec.sandbox_id, vm)
                    self.lifecycle.finish_envd_init(rec)
                    kept.add(rec.slot)
                    log.info("re-adopted running sandbox %s", rec.sandbox_id)
                    continue
            elif rec.state in (S.PAUSED, S.RESUMING) and saved:
                # An interrupted resume leaves the saved state untouched: back to paused.
                await self.machines.kill_leftover(directory.vm_dir)
                if rec.state == S.RESUMING:
                    await self.network.destroy(rec.slot)
                    self.store.transition(rec.sandbox_id, S.RESUMING, S.PAUSED)
                continue
            elif rec.state in (S.PAUSED, S.RESUMING):
                log.warning("paused sandbox %s has no saved state; cleaning it up", rec.sandbox_id)
            await self.machines.discard(rec)
        return kept

    def _snapshots(self) -> None:
        """A snapshot whose manifest was never written did not complete: hide it (its
        layer may back a sandbox's disk) and let collection remove it once unused."""
        for snap in self.store.list_snapshots():
            complete = SnapshotDir(snap.snapshot_dir).complete()
            if snap.state == "pending" or (snap.state == "ready" and not complete):
                log.warning("snapshot %s is incomplete; hiding it", snap.snapshot_id)
                self.store.update_snapshot(snap.snapshot_id, state="deleted")
            elif snap.kind == "fork" and snap.state == "ready":
                # Its children were started (or never will be): only they keep it.
                self.store.update_snapshot(snap.snapshot_id, state="deleted")
        known = {s.snapshot_dir for s in self.store.list_snapshots()}
        for path in self.snapshots_dir.iterdir():
            if path not in known:
                log.info("removing unrecorded snapshot directory %s", path)
                shutil.rmtree(path, ignore_errors=True)
        self.pins.collect_snapshots()

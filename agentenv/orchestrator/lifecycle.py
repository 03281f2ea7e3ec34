"""A sandbox's life on this node: create (restore from a source), pause (full or
filesystem-only), resume, kill, and its timeout.

Every method here runs under the sandbox's operation lock, which the facade
(:class:`~.orchestrator.Orchestrator`) takes, or :mod:`.starts` for a create; each
moves the sandbox through the state machine (:mod:`.states`) with
:meth:`Store.transition`, writes its record before its files, and rolls back on
failure: a failed pause leaves the sandbox running, a failed resume leaves it paused, a
failed create leaves nothing.

Memory: a sandbox's RAM is a file of its own (``memory.raw``, a clone of the template's:
a reflink where the data directory can, else a sparse copy; mapped shared): pausing it
writes device state only and resuming maps the same file again. For fork children, and
on a node configured ``sandbox_memory = "shared-image"``, RAM is a private copy-on-write
mapping of the source's image, and pausing streams RAM.
A sandbox with RAM of its own gives the pages its guest frees back to the host
(``MachineSpec.report_free_pages``, unless ``free_page_reporting`` is off); a snapshot
of it, fork images included, is restored only with RAM of its own
(``VMMDriver.needs_own_memory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx

from agentenv.network import NetworkManager
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.capture import Resharing
from agentenv.orchestrator.envd_inits import EnvdInits
from agentenv.orchestrator.errors import (
    Conflict,
    InvalidRequest,
    OperationFailed,
    SandboxNotFound,
    SandboxStartFailed,
)
from agentenv.orchestrator.layout import SandboxDir, write_atomically
from agentenv.orchestrator.machines import Machines, disk_format, volume_slots
from agentenv.orchestrator.modes import Mode
from agentenv.orchestrator.network_options import NetworkOptions
from agentenv.orchestrator.resources import (
    FilePins,
    MemoryBudget,
    NetworkLeases,
    Slots,
    StartGate,
    StartPlace,
)
from agentenv.orchestrator.sources import Source, Sources
from agentenv.orchestrator.states import SETTLED_STATES, SandboxState
from agentenv.orchestrator.store import SandboxRecord, Store, utcnow
from agentenv.orchestrator.sync import RepositorySync
from agentenv.orchestrator.timing import PhaseTimer
from agentenv.orchestrator.views import SandboxView
from agentenv.orchestrator.volumes import Requested, Volumes
from agentenv.storage.clone import clone_file
from agentenv.storage.images import writable_disk
from agentenv.vmm.base import SnapshotFiles, VirtualMachine, VMMDriver, VMMError, VMRunState

log = logging.getLogger("agentenv.orchestrator")

S = SandboxState


@dataclass(frozen=True)
class Identity:
    """What a new sandbox is given (and a fork child inherits from its parent)."""

    metadata: dict[str, str]
    env_vars: dict[str, str]
    secure: bool
    network: NetworkOptions
    auto_pause: bool
    auto_resume: bool
    parent_id: str | None = None
    # Volumes to mount (name, path), taken at create (see .volumes).
    volume_mounts: tuple[Requested, ...] = ()


@dataclass(frozen=True)
class Timeouts:
    default: int
    maximum: int

    def check(self, timeout: int) -> None:
        if timeout < 0:
            raise InvalidRequest("timeout must not be negative")
        if timeout > self.maximum:
            raise InvalidRequest(f"timeout must be at most {self.maximum} seconds")

    def pick(self, timeout: int | None) -> int:
        """``timeout``, or the default; refused if out of range."""
        chosen = self.default if timeout is None else timeout
        self.check(chosen)
        return chosen


class Lifecycle:
    def __init__(
        self,
        sandboxes_dir: Path,
        store: Store,
        driver: VMMDriver,
        network: NetworkManager,
        machines: Machines,
        slots: Slots,
        leases: NetworkLeases,
        pins: FilePins,
        sources: Sources,
        resharing: Resharing,
        sync: RepositorySync,
        http: httpx.AsyncClient,
        volumes: Volumes,
        *,
        boot_timeout: float,
        memory: MemoryBudget,
        starts: StartGate,
        mode: Mode,
        envd_init_timeout: float,
    ) -> None:
        self.sandboxes_dir = sandboxes_dir
        self.envd_init_timeout = envd_init_timeout
        self.mode = mode
        self.memory = memory
        self.starts = starts
        self.store = store
        self.driver = driver
        self.network = network
        self.machines = machines
        self.slots = slots
        self.leases = leases
        self.pins = pins
        self.sources = sources
        self.resharing = resharing
        self.sync = sync
        self.http = http
        self.volumes = volumes
        self.boot_timeout = boot_timeout
        # Whether new sandboxes get RAM files of their own (decided at startup).
        self.own_memory_files = False
        #: Whether a sandbox booted with RAM of its own gives freed pages back (set by
        #: the orchestrator at startup).
        self.report_free_pages = False
        # envd /init after a create or resume, which traffic to the sandbox waits for.
        self.inits = EnvdInits(store, http, envd_init_timeout)
        self.inits.after_first = machines.record_working_set_soon

    def existing(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox no operation is changing; :class:`SandboxNotFound`
        if there is none."""
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state not in SETTLED_STATES:
            raise SandboxNotFound(sandbox_id)
        return rec

    def view(self, rec: SandboxRecord, children: tuple[str, ...] = ()) -> SandboxView:
        return SandboxView(rec, self.network.describe(rec.slot).guest_address, children)

    # -- create ----------------------------------------------------------------------
    async def create(
        self,
        sandbox_id: str,
        source: Source,
        identity: Identity,
        timeout: int,
        *,
        private_memory: bool,
        envd_in_background: bool = False,
    ) -> SandboxView:
        """Start a sandbox. With ``envd_in_background`` it answers once the machine runs
        and envd's /init (identity, clock, entropy) finishes in the background, as after
        a resume: proxied traffic waits for it, and a sandbox whose /init failed takes
        none (:class:`~.envd_inits.EnvdInits`). Without it (template builds, which
        talk to envd directly next), or with volumes to mount, the create waits."""
        # Sources check what they resolve; fork images and build machines come here
        # directly, and a node restarted in another mode may still hold one.
        self.sources.check_mode(source)
        background = envd_in_background and not identity.volume_mounts
        with self.memory.hold(sandbox_id, source.snapshot.memory_mib, "create"):
            place = await self.starts.enter("create")
            slot = self.slots.reserve()
            try:
                view = await self._create(
                    sandbox_id, source, identity, slot, timeout, private_memory, background, place
                )
            except BaseException:
                place.leave()
                raise
            finally:
                self.slots.release(slot)
        if not background:
            place.leave()  # else the /init in the background gives it back
        return view

    async def _create(
        self,
        sandbox_id: str,
        source: Source,
        identity: Identity,
        slot: int,
        timeout: int,
        private_memory: bool,
        envd_in_background: bool,
        place: StartPlace,
    ) -> SandboxView:
        snap = source.snapshot
        workdir = self.sandboxes_dir / sandbox_id
        directory = SandboxDir(workdir)
        # A guest that gives freed pages back has them punched out of its RAM file, so
        # it never maps a file others map (a fork image, on any node; a template, on a
        # node without reflinks, where the file is copied).
        own_memory = self.driver.shared_memory_boot and (
            snap.files.memory_file is None
            or (self.own_memory_files and not private_memory)
            or self.driver.needs_own_memory(snap.files)
        )
        mounts = await self.volumes.hold(sandbox_id, identity.volume_mounts, volume_slots(snap))
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=source.template_id,
            template_build_id=source.build_id,
            state=S.CREATING,
            slot=slot,
            workdir=workdir,
            started_at=now,
            end_at=now + timedelta(seconds=timeout),
            vcpus=snap.vcpus,
            memory_mib=snap.memory_mib,
            disk_size_mib=snap.disk_size_mib,
            envd_version=snap.envd_version,
            envd_token=self.store.tokens.token(sandbox_id) if identity.secure else None,
            metadata=identity.metadata,
            env_vars=identity.env_vars,
            auto_pause=identity.auto_pause,
            network=identity.network,
            traffic_token=(
                None
                if identity.network.allow_public_traffic
                else self.store.tokens.traffic_token(sandbox_id)
            ),
            memory_mode="shared" if own_memory else "private",
            source_dir=snap.directory,
            parent_id=identity.parent_id,
            snapshot_id=source.snapshot_id,
            auto_resume=identity.auto_resume,
            volumes=mounts,
            envd_pending="start" if envd_in_background else None,
        )
        # The record goes first, so a crash mid-create leaves something to clean up.
        try:
            self.store.insert_sandbox(rec)
        except BaseException:
            self.volumes.release(sandbox_id)
            raise
        vm: VirtualMachine | None = None
        phases = PhaseTimer()
        try:
            workdir.mkdir(parents=True)
            directory.vm_dir.mkdir()
            memory = directory.memory_file
            # Independent, so concurrent; a failure cancels the others before the rollback.
            try:
                async with asyncio.TaskGroup() as group:
                    disk_task = group.create_task(
                        writable_disk(
                            snap.disk,
                            disk_format(snap.disk_format),
                            workdir / "disk",
                            self.driver.disk_formats,
                        )
                    )
                    net_task = group.create_task(
                        self.network.create(slot, policy=identity.network.egress)
                    )
                    if own_memory and snap.files.memory_file is not None:
                        group.create_task(clone_file(snap.files.memory_file, memory))
            except BaseExceptionGroup as group_error:
                raise group_error.exceptions[0] from None
            disk, fmt = disk_task.result()
            net = net_task.result()
            self.store.update_sandbox(sandbox_id, disk_path=disk)
            rec.disk_path = disk
            phases.mark("disk+network+memory")
            if not own_memory and snap.files.memory_file is not None:
                # Private mapping: the sandbox's RAM writes are copy-on-write in its own
                # memory; the source image is shared through the page cache.
                memory = snap.files.memory_file
            spec = self.machines.spec(
                snap,
                disk,
                fmt,
                memory,
                own_memory,
                net.netns,
                self.volumes.images(mounts),
                report_free_pages=self.report_free_pages,
            )
            vm = await self.driver.restore(spec, snap.files, directory.vm_dir)
            phases.mark("restore")
            if not envd_in_background:
                await envd_client.init(
                    self.http,
                    net.guest_address,
                    env_vars=rec.env_vars,
                    access_token=rec.envd_token,
                    timeout=self.envd_init_timeout,
                )
                phases.mark("envd_init")
            if mounts:
                await self.volumes.mount_in_guest(
                    self.http, net.guest_address, rec.envd_token, mounts
                )
                phases.mark("volumes")
        except BaseException as exc:
            if vm is not None:
                await vm.kill()
            await self.machines.discard(rec)
            if isinstance(exc, Exception) and not isinstance(exc, asyncio.CancelledError):
                log.error("sandbox %s failed to start: %s", sandbox_id, exc)
                raise SandboxStartFailed(f"sandbox failed to start: {exc}") from exc
            raise
        self.machines.add(sandbox_id, vm)
        # The TTL counts from the moment the sandbox is usable.
        end_at = utcnow() + timedelta(seconds=timeout)
        self.store.transition(sandbox_id, S.CREATING, S.RUNNING, end_at=end_at)
        rec.state, rec.end_at = S.RUNNING, end_at
        if envd_in_background:
            self.inits.start(rec, net.guest_address, first=True, place=place)
        log.info("sandbox %s running (from %s) in %s", sandbox_id, rec.template_id, phases)
        return self.view(rec)

    # -- pause -----------------------------------------------------------------------
    async def pause(self, sandbox_id: str, memory: bool) -> SandboxView:
        await self.inits.settled(sandbox_id)
        rec = self.existing(sandbox_id)
        if rec.state == S.PAUSED:
            raise Conflict(f"sandbox {sandbox_id} is already paused")
        vm = self.machines.running_vm(rec)
        if not memory:
            return await self._pause_disk_only(rec, vm)
        phases = PhaseTimer()
        directory = SandboxDir(rec.workdir)
        dest = directory.paused
        self.store.transition(sandbox_id, S.RUNNING, S.PAUSING)
        # Announced while the machine is saved, and before the pause answers, so a
        # connect on another node right after it waits for the commit, not a 404.
        generation = self.sync.next_generation(rec)
        announcing = (
            asyncio.ensure_future(self.sync.announce_pause(sandbox_id, generation))
            if generation is not None
            else None
        )
        try:
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            if rec.volumes:
                # A paused sandbox may be killed without running again.
                address = self.network.describe(rec.slot).guest_address
                await self.volumes.flush_in_guest(self.http, address, rec.envd_token, rec.volumes)
            # With RAM in the sandbox's own file this writes device state only.
            files = await vm.save_state(dest)
            write_atomically(directory.paused_manifest, files.to_json())
        except Exception as exc:
            shutil.rmtree(dest, ignore_errors=True)
            with contextlib.suppress(VMMError):
                await vm.resume_if_paused()
            if announcing is not None:
                await announcing
                await self.sync.drop_announcement(sandbox_id)
            self.store.transition(sandbox_id, S.PAUSING, S.RUNNING)
            raise OperationFailed(f"pausing sandbox {sandbox_id} failed: {exc}") from exc
        phases.mark("save")
        self.machines.pop(sandbox_id)
        await vm.kill()
        phases.mark("vm")
        # A sandbox paused within seconds of its start leaves its source's working set
        # (once per snapshot), as a kill does. Its own RAM file gets none: its pages are
        # still cached when a resume follows soon, and recording them cost a pause 8 ms.
        await self.machines.record_working_set(sandbox_id, vm)
        self.sync.prepare_upload(rec)
        self.resharing.later(
            rec, files.memory_file, f"sandbox {sandbox_id} (paused)", paused=sandbox_id
        )
        # The pause is complete once saved and the VMM is gone; the network namespace
        # follows a little later unless a resume takes it back first.
        self.leases.release_later(rec)
        self.store.transition(sandbox_id, S.PAUSING, S.PAUSED, pause_mode="full")
        rec.state = S.PAUSED
        if announcing is not None:
            await announcing
            phases.mark("announce")
        if directory.upload_state() is not None:
            self.sync.start_upload(sandbox_id)
        log.info("sandbox %s paused in %s", sandbox_id, phases)
        return self.view(rec)

    async def _pause_disk_only(self, rec: SandboxRecord, vm: VirtualMachine) -> SandboxView:
        phases = PhaseTimer()
        self.store.transition(rec.sandbox_id, S.RUNNING, S.PAUSING)
        address = self.network.describe(rec.slot).guest_address
        try:
            # Whatever the guest still holds in its page cache reaches the disk.
            await envd_client.run(self.http, address, "/bin/sync", [], rec.envd_token)
        except envd_client.EnvdUnreachable as exc:
            log.warning("sandbox %s: guest sync before pause failed: %s", rec.sandbox_id, exc)
        phases.mark("sync")
        try:
            # Stopping the VM flushes QEMU's own disk caches (qcow2 metadata).
            await vm.pause()
        except VMMError as exc:
            self.store.transition(rec.sandbox_id, S.PAUSING, S.RUNNING)
            raise OperationFailed(f"pausing sandbox {rec.sandbox_id} failed: {exc}") from exc
        self.machines.pop(rec.sandbox_id)
        await vm.kill()
        await self.keep_disk_only(rec, S.PAUSING)
        phases.mark("release")
        rec.state, rec.pause_mode = S.PAUSED, "filesystem"
        log.info("sandbox %s paused (filesystem only) in %s", rec.sandbox_id, phases)
        return self.view(rec)

    async def keep_disk_only(self, rec: SandboxRecord, expected: SandboxState) -> None:
        """Turn a sandbox without a VMM (in state ``expected``) into a filesystem-only
        pause: marker written, RAM discarded, network released."""
        directory = SandboxDir(rec.workdir)
        # RAM first: when the VMM died of a full disk, the blocks its RAM file held are
        # what lets the marker and the state change be written. A crash in between
        # leaves a sandbox without a VMM, which recovery settles the same way.
        directory.memory_file.unlink(missing_ok=True)
        directory.mark_disk_only()
        await self.leases.release_now(rec)
        self.store.transition(
            rec.sandbox_id, expected, S.PAUSED, pause_mode="filesystem", memory_mode="shared"
        )

    # -- resume ----------------------------------------------------------------------
    async def resume(self, sandbox_id: str, timeout: int) -> SandboxView:
        rec = self.existing(sandbox_id)
        if rec.state != S.PAUSED:
            raise Conflict(f"sandbox {sandbox_id} is not paused")
        phases = PhaseTimer()
        directory = SandboxDir(rec.workdir)
        if rec.pause_mode != "filesystem":
            # Before anything changes (its upload, its claim in the repository): a node
            # restarted in another mode leaves it paused, for a node of its own mode.
            saved = SnapshotFiles.from_json(directory.paused_manifest.read_text())
            self.mode.require(f"paused sandbox {sandbox_id}", Mode.of_files(saved))
        await self.sync.stop_upload(sandbox_id)
        await self.resharing.stop(sandbox_id)
        # Resumed here before its commit: the commit will not come.
        await self.sync.withdraw_pause(rec)
        upload = directory.upload_state()
        if upload is not None and upload.committed:
            # Committed: another node may have resumed it. Whoever claims this
            # generation first holds it.
            holder = await self.sync.claim_for_resume(sandbox_id, upload.generation)
            if holder is not None:
                self.leases.forget(rec)
                await self.machines.discard(rec)
                raise Conflict(f"sandbox {sandbox_id} was resumed on node {holder}")
            phases.mark("claim")
        snap = self.sources.of_sandbox(rec)
        disk, fmt = self.machines.current_disk(rec)
        # None for a filesystem-only pause: the guest boots from its disk.
        files = (
            None
            if rec.pause_mode == "filesystem"
            else SnapshotFiles.from_json(directory.paused_manifest.read_text())
        )
        if files is not None and files.memory_file is not None:
            # The saved RAM file is the sandbox's own: mapped shared where the VMM can
            # (its RAM lives on in it), else privately (Firecracker: its next save
            # writes a new one).
            memory, shared = files.memory_file, self.driver.shared_memory_boot
        else:
            # RAM comes from the stream (or a boot); it lands in a file of the sandbox's
            # own when the VMM can map one, so the next pause is a device-state save.
            memory, shared = directory.memory_file, self.driver.shared_memory_boot
            memory.unlink(missing_ok=True)
        place = await self.starts.enter("resume")
        try:
            # No await between the check and the transition: once resuming, the record
            # itself counts as lent RAM.
            self.memory.admit(rec.memory_mib, "resume")
            self.store.transition(sandbox_id, S.PAUSED, S.RESUMING)
        except BaseException:
            place.leave()
            raise
        vm: VirtualMachine | None = None
        try:
            vm_dir = directory.vm_dir
            shutil.rmtree(vm_dir, ignore_errors=True)
            vm_dir.mkdir()
            net = await self.leases.take(rec)
            phases.mark("network")
            spec = self.machines.spec(
                snap,
                disk,
                fmt,
                memory,
                shared,
                net.netns,
                self.volumes.images(rec.volumes),
                report_free_pages=self.report_free_pages,
            )
            if files is not None:
                vm = await self.driver.restore(spec, files, vm_dir)
                phases.mark("restore")
            else:
                vm = await self.driver.boot(spec, vm_dir)
                booted = vm
                await envd_client.wait_healthy(
                    self.http,
                    net.guest_address,
                    self.boot_timeout,
                    alive=lambda: booted.state is not VMRunState.STOPPED,
                )
                phases.mark("boot")
                # A boot mounts nothing: the volumes are mounted again.
                await self.volumes.mount_in_guest(
                    self.http, net.guest_address, rec.envd_token, rec.volumes
                )
        except BaseException as exc:
            place.leave()
            if not isinstance(exc, Exception):
                raise
            if vm is not None:
                await vm.kill()
            with contextlib.suppress(Exception):
                await self.network.destroy(rec.slot)
            self.store.transition(sandbox_id, S.RESUMING, S.PAUSED)
            raise OperationFailed(f"resuming sandbox {sandbox_id} failed: {exc}") from exc
        self.machines.add(sandbox_id, vm)
        end_at = utcnow() + timedelta(seconds=timeout)
        mode = "shared" if shared else "private"
        self.store.transition(
            sandbox_id,
            S.RESUMING,
            S.RUNNING,
            end_at=end_at,
            memory_mode=mode,
            pause_mode=None,
            envd_pending="resume",
        )
        rec.state, rec.end_at, rec.memory_mode, rec.pause_mode = S.RUNNING, end_at, mode, None
        rec.envd_pending = "resume"
        # The saved state is consumed: the running machine has moved on from it.
        directory.clear_paused()
        self.inits.start(rec, net.guest_address, place=place)
        log.info("sandbox %s resumed in %s", sandbox_id, phases)
        return self.view(rec)

    def finish_envd_init(self, rec: SandboxRecord) -> None:
        """Run again, in the background, the envd /init a re-adopted sandbox was still
        owed when the last server stopped: without it a fork child's envd would keep
        its parent's token, and a new sandbox's envd would have none."""
        if rec.envd_pending is not None:
            address = self.network.describe(rec.slot).guest_address
            self.inits.start(rec, address, first=rec.envd_pending == "start")

    # -- kill ------------------------------------------------------------------------
    async def kill(self, sandbox_id: str) -> None:
        rec = self.existing(sandbox_id)
        phases = PhaseTimer()
        await self.sync.stop_upload(sandbox_id)
        await self.sync.forget(rec)
        self.leases.forget(rec)
        self.store.transition(sandbox_id, rec.state, S.KILLING)
        self.inits.forget(sandbox_id)  # its guest is going: nothing to initialise
        vm = self.machines.pop(sandbox_id)
        if vm is not None and rec.volumes and rec.state == S.RUNNING:
            address = self.network.describe(rec.slot).guest_address
            await self.volumes.flush_in_guest(self.http, address, rec.envd_token, rec.volumes)
        if vm is not None:
            if rec.state == S.RUNNING:
                # A sandbox killed within seconds of its start (short rollouts) would
                # otherwise never leave a working set for the next ones to read ahead.
                await self.machines.record_working_set(sandbox_id, vm)
            await vm.kill()
        else:
            await self.machines.kill_leftover(SandboxDir(rec.workdir).vm_dir)
        phases.mark("vm")
        try:
            await self.network.detach(rec.slot)
        except Exception as exc:
            # The VM is gone; what is left of the namespace is reclaimed at the next
            # start. The sandbox itself must not linger, half-killed.
            log.warning("sandbox %s: network teardown failed: %s", sandbox_id, exc)
        self.slots.release_after(rec.slot, self.network.destroy(rec.slot))
        phases.mark("network")
        shutil.rmtree(rec.workdir, ignore_errors=True)
        self.store.delete_sandbox(sandbox_id)
        phases.mark("files")
        self.pins.collect_snapshots()
        log.info("sandbox %s killed in %s", sandbox_id, phases)

    # -- timeouts --------------------------------------------------------------------
    def set_end(self, rec: SandboxRecord, timeout: int, *, only_extend: bool) -> None:
        """End the sandbox's life ``timeout`` seconds from now; with ``only_extend`` only
        if that is later than its current end."""
        end_at = utcnow() + timedelta(seconds=timeout)
        if only_extend:
            end_at = max(rec.end_at, end_at)
        self.store.update_sandbox(rec.sandbox_id, end_at=end_at)
        rec.end_at = end_at

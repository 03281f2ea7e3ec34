"""The orchestrator: creates, tracks, expires and kills sandboxes.

Lifecycle: :meth:`Orchestrator.startup` (open the store, re-adopt or clean what a previous
run left, start the reaper and the base template build), then requests, then
:meth:`Orchestrator.shutdown`. Every state change of a sandbox happens here, under that
sandbox's lock, and is written to the store before the call returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import string
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

import httpx

from agentenv.config import Config
from agentenv.network import NetworkManager, pick_free_subnet
from agentenv.network.addresses import GUEST_MAC, TAP_NAME
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.errors import (
    CapacityExhausted,
    Conflict,
    GuestUnavailable,
    InvalidRequest,
    OperationFailed,
    SandboxNotFound,
    SandboxStartFailed,
)
from agentenv.orchestrator.store import SandboxRecord, Store, utcnow
from agentenv.orchestrator.templates import Template, TemplateManager
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError
from agentenv.storage.images import DiskFormat, writable_disk
from agentenv.vmm.base import (
    DriveSpec,
    MachineSpec,
    NetSpec,
    SnapshotFiles,
    VirtualMachine,
    VMMDriver,
    VMMError,
)

log = logging.getLogger("agentenv.orchestrator")

_ID_ALPHABET = string.ascii_lowercase + string.digits
VM_DIR = "vm"
# A paused sandbox's saved machine lives here, next to its disk overlay.
PAUSED_DIR = "paused"
PAUSED_MANIFEST = "snapshot.json"
AUTO_PAUSE_RETRY_S = 60
# States in which a sandbox exists for callers. A sandbox being created or killed does
# not; one being paused or resumed does, as what it was before the change.
VISIBLE_STATES = ("running", "paused", "pausing", "resuming")
PUBLIC_STATE = {
    "running": "running",
    "pausing": "running",
    "paused": "paused",
    "resuming": "paused",
}


class _PhaseTimer:
    """Durations of the named phases of one operation, for the log."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._start = self._last
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now

    def __str__(self) -> str:
        total = (self._last - self._start) * 1000
        parts = ", ".join(f"{k} {v * 1000:.0f}" for k, v in self.phases.items())
        return f"{total:.0f} ms ({parts})"


def _existing_disk(workdir: Path) -> tuple[Path, DiskFormat]:
    qcow2 = workdir / "disk.qcow2"
    if qcow2.exists():
        return qcow2, "qcow2"
    return workdir / "disk.raw", "raw"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _disk_format(value: str) -> DiskFormat:
    if value not in ("raw", "qcow2"):
        raise SandboxStartFailed(f"template disk has unknown format {value!r}")
    return "qcow2" if value == "qcow2" else "raw"


def resolve_subnet(config: Config) -> str:
    """The host-side veth range: configured, else the one this data directory chose at
    its first start, else a block no address or route on this host uses yet (recorded,
    so re-adopted sandboxes keep their addresses)."""
    if config.net_subnet:
        return config.net_subnet
    if config.subnet_path.exists():
        return config.subnet_path.read_text().strip()
    subnet = pick_free_subnet(int(config.instance_tag, 16))
    config.home.mkdir(parents=True, exist_ok=True)
    config.subnet_path.write_text(subnet + "\n")
    return subnet


def new_sandbox_id() -> str:
    return "i" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(19))


@dataclass(frozen=True)
class SandboxView:
    """What callers see of a sandbox."""

    record: SandboxRecord
    guest_address: str

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    @property
    def state(self) -> str:
        """``running`` or ``paused``: a pause or resume in progress shows the state the
        sandbox is leaving, which is what it still is until the change completes."""
        return PUBLIC_STATE.get(self.record.state, self.record.state)


class Orchestrator:
    def __init__(
        self,
        config: Config,
        driver: VMMDriver,
        accel: Literal["tcg", "kvm"],
        network: NetworkManager | None = None,
    ) -> None:
        self.config = config
        self.driver = driver
        self.accel = accel
        self.store = Store(config.db_path)
        self.network = network or NetworkManager(
            prefix=f"ae{config.instance_tag}", subnet=resolve_subnet(config)
        )
        # No keep-alive: guest addresses are reused with network slots, so a pooled
        # connection could outlive its sandbox and reach the next one.
        self.http = httpx.AsyncClient(
            trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self._vms: dict[str, VirtualMachine] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._reserved_slots: set[int] = set()
        self.templates = TemplateManager(
            config,
            self.store,
            driver,
            accel,
            self.network,
            self._reserve_slot,
            self._release_slot,
            self.http,
        )
        self._reaper: asyncio.Task[None] | None = None
        self._base_build: asyncio.Task[object] | None = None
        self._started = False

    # -- lifecycle -----------------------------------------------------------------------
    async def startup(self, *, build_base: bool = True) -> None:
        for d in (self.config.home, self.config.templates_dir, self.config.sandboxes_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.store.open()
        self.templates.cleanup_staging()
        await self._recover()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        if build_base:
            self._base_build = asyncio.get_running_loop().create_task(self._build_base_quietly())
        self._started = True

    async def shutdown(self, *, kill_sandboxes: bool = False) -> None:
        """Stop background work. Sandboxes keep running (their VMMs live in their own
        sessions) and are re-adopted by the next start, unless ``kill_sandboxes``."""
        for task in (self._reaper, self._base_build):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if kill_sandboxes:
            for rec in self.store.list_sandboxes():
                with contextlib.suppress(SandboxNotFound):
                    await self.kill(rec.sandbox_id)
        for vm in self._vms.values():
            await vm.close()
        self._vms.clear()
        await self.http.aclose()
        self.store.close()
        self._started = False

    async def _build_base_quietly(self) -> object:
        try:
            return await self.templates.ensure_base()
        except Exception as exc:  # logged and reported by /health; create retries
            log.error("base template unavailable: %s", exc)
            return None

    async def _recover(self) -> None:
        """Re-adopt sandboxes whose VMM survived the previous server, keep paused ones
        whose saved state is complete, settle interrupted pauses and resumes, and clean
        up the rest."""
        kept: set[int] = set()
        for rec in self.store.list_sandboxes():
            vm_dir = rec.workdir / VM_DIR
            saved = (rec.workdir / PAUSED_DIR / PAUSED_MANIFEST).exists()
            if rec.state in ("running", "pausing"):
                try:
                    vm = await self.driver.attach(vm_dir)
                except VMMError as exc:
                    if rec.state == "pausing" and saved:
                        # The save finished; the crash came while releasing the VM.
                        await self.network.destroy(rec.slot)
                        self.store.update_sandbox(rec.sandbox_id, state="paused")
                        log.info("sandbox %s: interrupted pause completed", rec.sandbox_id)
                        continue
                    log.warning("sandbox %s lost (%s); cleaning it up", rec.sandbox_id, exc)
                else:
                    if rec.state == "pausing":
                        # The VM is still there, maybe stopped mid-save: it wins.
                        await vm.resume()
                        shutil.rmtree(rec.workdir / PAUSED_DIR, ignore_errors=True)
                        self.store.update_sandbox(rec.sandbox_id, state="running")
                    self._vms[rec.sandbox_id] = vm
                    kept.add(rec.slot)
                    log.info("re-adopted running sandbox %s", rec.sandbox_id)
                    continue
            elif rec.state in ("paused", "resuming") and saved:
                # An interrupted resume leaves the saved state untouched: back to paused.
                await self._kill_leftover_vm(vm_dir)
                if rec.state == "resuming":
                    await self.network.destroy(rec.slot)
                    self.store.update_sandbox(rec.sandbox_id, state="paused")
                continue
            elif rec.state == "paused":
                log.warning("paused sandbox %s has no saved state; cleaning it up", rec.sandbox_id)
            await self._discard(rec)
        known = {rec.workdir for rec in self.store.list_sandboxes()}
        if self.config.sandboxes_dir.exists():
            for path in self.config.sandboxes_dir.iterdir():
                if path not in known:
                    log.info("removing orphaned sandbox directory %s", path)
                    await self._kill_leftover_vm(path / VM_DIR)
                    shutil.rmtree(path, ignore_errors=True)
        removed = await self.network.reclaim(kept)
        if removed:
            log.info("reclaimed leftover network resources: %s", ", ".join(removed))

    async def _kill_leftover_vm(self, vm_dir: Path) -> None:
        if not vm_dir.exists():
            return
        try:
            vm = await self.driver.attach(vm_dir)
        except VMMError:
            return
        await vm.kill()

    async def _discard(self, rec: SandboxRecord) -> None:
        """Remove everything a sandbox holds and its record, tolerating parts that are
        already gone (a crashed server's leftovers, a create that failed midway)."""
        await self._kill_leftover_vm(rec.workdir / VM_DIR)
        with contextlib.suppress(Exception):
            await self.network.destroy(rec.slot)
        shutil.rmtree(rec.workdir, ignore_errors=True)
        self.store.delete_sandbox(rec.sandbox_id)

    # -- slots ---------------------------------------------------------------------------
    def _reserve_slot(self) -> int:
        used = self.store.used_slots() | self._reserved_slots
        slot = 0
        while slot in used:
            slot += 1
        if self.network.max_slots is not None and slot >= self.network.max_slots:
            raise CapacityExhausted("no free network slots on this node")
        self._reserved_slots.add(slot)
        return slot

    def _release_slot(self, slot: int) -> None:
        self._reserved_slots.discard(slot)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    # -- queries -------------------------------------------------------------------------
    def _view(self, rec: SandboxRecord) -> SandboxView:
        return SandboxView(rec, self.network.describe(rec.slot).guest_address)

    def get(self, sandbox_id: str) -> SandboxView:
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state not in VISIBLE_STATES:
            raise SandboxNotFound(sandbox_id)
        return self._view(rec)

    def list_sandboxes(self) -> list[SandboxView]:
        return [self._view(r) for r in self.store.list_sandboxes() if r.state in VISIBLE_STATES]

    async def guest_metrics(self, sandbox_id: str) -> dict[str, object]:
        """Current resource use inside the guest, as envd reports it."""
        view = self.get(sandbox_id)
        try:
            return await envd_client.metrics(self.http, view.guest_address, view.record.envd_token)
        except envd_client.EnvdUnreachable as exc:
            raise GuestUnavailable(f"sandbox {sandbox_id}: {exc}") from exc

    # -- create --------------------------------------------------------------------------
    def _check_timeout(self, timeout: int) -> None:
        if timeout < 0:
            raise InvalidRequest("timeout must not be negative")
        if timeout > self.config.max_timeout:
            raise InvalidRequest(f"timeout must be at most {self.config.max_timeout} seconds")

    async def create(
        self,
        template_id: str,
        *,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        env_vars: dict[str, str] | None = None,
        secure: bool = False,
        allow_internet: bool = False,
        auto_pause: bool = False,
    ) -> SandboxView:
        timeout = self.config.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)
        template = await self.templates.get(template_id)
        sandbox_id = new_sandbox_id()
        async with self._lock(sandbox_id):
            slot = self._reserve_slot()
            try:
                return await self._create_locked(
                    sandbox_id,
                    template,
                    slot,
                    timeout=timeout,
                    metadata=metadata or {},
                    env_vars=env_vars or {},
                    secure=secure,
                    allow_internet=allow_internet,
                    auto_pause=auto_pause,
                )
            finally:
                self._release_slot(slot)

    async def _create_locked(
        self,
        sandbox_id: str,
        template: Template,
        slot: int,
        *,
        timeout: int,
        metadata: dict[str, str],
        env_vars: dict[str, str],
        secure: bool,
        allow_internet: bool,
        auto_pause: bool,
    ) -> SandboxView:
        snap = template.snapshot
        workdir = self.config.sandboxes_dir / sandbox_id
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=template.record.template_id,
            template_build_id=template.record.build_id,
            state="creating",
            slot=slot,
            workdir=workdir,
            started_at=now,
            end_at=now + timedelta(seconds=timeout),
            vcpus=snap.vcpus,
            memory_mib=snap.memory_mib,
            disk_size_mib=snap.disk_size_mib,
            envd_version=snap.envd_version,
            envd_token=secrets.token_urlsafe(24) if secure else None,
            metadata=metadata,
            env_vars=env_vars,
            auto_pause=auto_pause,
            allow_internet=allow_internet,
        )
        # The record goes first, so a crash mid-create leaves something to clean up.
        self.store.insert_sandbox(rec)
        vm: VirtualMachine | None = None
        phases = _PhaseTimer()
        try:
            workdir.mkdir(parents=True)
            (workdir / VM_DIR).mkdir()
            # Independent, so concurrent; a failure cancels the other before the rollback.
            try:
                async with asyncio.TaskGroup() as group:
                    disk_task = group.create_task(
                        writable_disk(
                            snap.disk,
                            _disk_format(snap.disk_format),
                            workdir / "disk",
                            self.driver.disk_formats,
                        )
                    )
                    net_task = group.create_task(
                        self.network.create(slot, allow_internet=allow_internet)
                    )
            except BaseExceptionGroup as group_error:
                raise group_error.exceptions[0] from None
            disk, disk_format = disk_task.result()
            net = net_task.result()
            phases.mark("disk+network")
            # Private mapping: the sandbox's RAM writes are copy-on-write in its own
            # memory; the template image is shared through the page cache.
            memory = snap.files.memory_file or (workdir / "memory.raw")
            spec = self._machine_spec(snap, disk, disk_format, memory, net.netns)
            vm = await self.driver.restore(spec, snap.files, workdir / VM_DIR)
            phases.mark("restore")
            await envd_client.init(
                self.http, net.guest_address, env_vars=env_vars, access_token=rec.envd_token
            )
            phases.mark("envd_init")
        except BaseException as exc:
            if vm is not None:
                await vm.kill()
            await self._discard(rec)
            if isinstance(exc, Exception) and not isinstance(exc, asyncio.CancelledError):
                log.error("sandbox %s failed to start: %s", sandbox_id, exc)
                raise SandboxStartFailed(f"sandbox failed to start: {exc}") from exc
            raise
        self._vms[sandbox_id] = vm
        # The TTL counts from the moment the sandbox is usable.
        end_at = utcnow() + timedelta(seconds=timeout)
        self.store.update_sandbox(sandbox_id, state="running", end_at=end_at)
        rec.state, rec.end_at = "running", end_at
        log.info("sandbox %s running (template %s) in %s", sandbox_id, rec.template_id, phases)
        return self._view(rec)

    def _machine_spec(
        self,
        snap: MachineSnapshot,
        disk: Path,
        disk_format: DiskFormat,
        memory_file: Path,
        netns: str,
    ) -> MachineSpec:
        """The machine a sandbox of template snapshot ``snap`` runs as: every restore of
        it (create, resume) must present the same shape."""
        return MachineSpec(
            vcpus=snap.vcpus,
            memory_mib=snap.memory_mib,
            kernel=snap.kernel,
            initrd=snap.initrd,
            cmdline=snap.cmdline,
            drives=(
                DriveSpec("root", disk, fmt=disk_format),
                DriveSpec("tools", snap.tools_drive, read_only=True),
            ),
            memory_file=memory_file,
            memory_shared=False,
            accel=self.accel,
            net=NetSpec(tap=TAP_NAME, mac=GUEST_MAC, netns=netns),
        )

    # -- pause and resume ------------------------------------------------------------------
    async def pause(self, sandbox_id: str) -> SandboxView:
        """Save the whole machine (device state and RAM) under the sandbox's directory,
        then release its VMM process and network namespace. The disk overlay stays.

        On failure the VM keeps running (the driver resumes it) and so does the sandbox."""
        async with self._lock(sandbox_id):
            rec = self._existing(sandbox_id)
            if rec.state == "paused":
                raise Conflict(f"sandbox {sandbox_id} is already paused")
            vm = self._vms.get(sandbox_id)
            if vm is None:
                raise GuestUnavailable(f"sandbox {sandbox_id} has no VMM attached")
            phases = _PhaseTimer()
            dest = rec.workdir / PAUSED_DIR
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            self.store.update_sandbox(sandbox_id, state="pausing")
            try:
                files = await vm.save_state(dest)
                _write_atomically(dest / PAUSED_MANIFEST, files.to_json())
            except Exception as exc:
                shutil.rmtree(dest, ignore_errors=True)
                with contextlib.suppress(VMMError):
                    await vm.resume()
                self.store.update_sandbox(sandbox_id, state="running")
                raise OperationFailed(f"pausing sandbox {sandbox_id} failed: {exc}") from exc
            phases.mark("save")
            self._vms.pop(sandbox_id, None)
            await vm.kill()
            await self.network.destroy(rec.slot)
            phases.mark("release")
            self.store.update_sandbox(sandbox_id, state="paused")
            rec.state = "paused"
        log.info("sandbox %s paused in %s", sandbox_id, phases)
        return self._view(rec)

    async def resume(self, sandbox_id: str, timeout: int | None = None) -> SandboxView:
        """Restore a paused sandbox with the same id, files and processes. On failure it
        stays paused."""
        timeout = self.config.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)
        async with self._lock(sandbox_id):
            rec = self._existing(sandbox_id)
            if rec.state != "paused":
                raise Conflict(f"sandbox {sandbox_id} is not paused")
            phases = _PhaseTimer()
            files = SnapshotFiles.from_json(
                (rec.workdir / PAUSED_DIR / PAUSED_MANIFEST).read_text()
            )
            snap = self._template_snapshot(rec)
            disk, disk_format = _existing_disk(rec.workdir)
            self.store.update_sandbox(sandbox_id, state="resuming")
            vm: VirtualMachine | None = None
            try:
                vm_dir = rec.workdir / VM_DIR
                shutil.rmtree(vm_dir, ignore_errors=True)
                vm_dir.mkdir()
                net = await self.network.create(rec.slot, allow_internet=rec.allow_internet)
                spec = self._machine_spec(
                    snap, disk, disk_format, rec.workdir / "memory.raw", net.netns
                )
                vm = await self.driver.restore(spec, files, vm_dir)
                phases.mark("restore")
                await envd_client.init(
                    self.http,
                    net.guest_address,
                    env_vars=rec.env_vars,
                    access_token=rec.envd_token,
                )
                phases.mark("envd_init")
            except Exception as exc:
                if vm is not None:
                    await vm.kill()
                with contextlib.suppress(Exception):
                    await self.network.destroy(rec.slot)
                self.store.update_sandbox(sandbox_id, state="paused")
                raise OperationFailed(f"resuming sandbox {sandbox_id} failed: {exc}") from exc
            self._vms[sandbox_id] = vm
            end_at = utcnow() + timedelta(seconds=timeout)
            self.store.update_sandbox(sandbox_id, state="running", end_at=end_at)
            rec.state, rec.end_at = "running", end_at
            # The saved state is consumed: the running machine has moved on from it.
            shutil.rmtree(rec.workdir / PAUSED_DIR, ignore_errors=True)
        log.info("sandbox %s resumed in %s", sandbox_id, phases)
        return self._view(rec)

    def _existing(self, sandbox_id: str) -> SandboxRecord:
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state not in ("running", "paused"):
            raise SandboxNotFound(sandbox_id)
        return rec

    def _template_snapshot(self, rec: SandboxRecord) -> MachineSnapshot:
        directory = self.config.templates_dir / rec.template_id / rec.template_build_id
        try:
            return MachineSnapshot.load(directory)
        except SnapshotError as exc:
            raise OperationFailed(f"template of sandbox {rec.sandbox_id}: {exc}") from exc

    # -- changes -------------------------------------------------------------------------
    async def set_timeout(
        self, sandbox_id: str, timeout: int, *, only_extend: bool = False
    ) -> SandboxView:
        """End the sandbox's life ``timeout`` seconds from now; with ``only_extend`` only
        if that is later than its current end (connect and refresh never shorten it)."""
        self._check_timeout(timeout)
        async with self._lock(sandbox_id):
            view = self.get(sandbox_id)
            end_at = utcnow() + timedelta(seconds=timeout)
            if only_extend:
                end_at = max(view.record.end_at, end_at)
            self.store.update_sandbox(sandbox_id, end_at=end_at)
            view.record.end_at = end_at
            return view

    async def kill(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            rec = self._existing(sandbox_id)
            phases = _PhaseTimer()
            self.store.update_sandbox(sandbox_id, state="killing")
            vm = self._vms.pop(sandbox_id, None)
            if vm is not None:
                await vm.kill()
            else:
                await self._kill_leftover_vm(rec.workdir / VM_DIR)
            phases.mark("vm")
            await self.network.destroy(rec.slot)
            phases.mark("network")
            shutil.rmtree(rec.workdir, ignore_errors=True)
            self.store.delete_sandbox(sandbox_id)
            phases.mark("files")
        self._locks.pop(sandbox_id, None)
        log.info("sandbox %s killed in %s", sandbox_id, phases)

    # -- expiry --------------------------------------------------------------------------
    async def reap_expired(self, now: datetime | None = None) -> list[str]:
        now = now or utcnow()
        expired = [
            r for r in self.store.list_sandboxes() if r.state == "running" and r.end_at <= now
        ]
        for rec in expired:
            log.info("sandbox %s reached its timeout", rec.sandbox_id)
            if rec.auto_pause:
                try:
                    await self.pause(rec.sandbox_id)
                    continue
                except (SandboxNotFound, Conflict):
                    continue
                except OperationFailed as exc:
                    # Killing would lose what the user asked to keep: it stays running
                    # and the pause is tried again a minute later.
                    log.error(
                        "auto-pause of %s failed (%s); retrying in %ds",
                        rec.sandbox_id,
                        exc,
                        AUTO_PAUSE_RETRY_S,
                    )
                    self.store.update_sandbox(
                        rec.sandbox_id, end_at=now + timedelta(seconds=AUTO_PAUSE_RETRY_S)
                    )
                    continue
            with contextlib.suppress(SandboxNotFound):
                await self.kill(rec.sandbox_id)
        return [r.sandbox_id for r in expired]

    async def _reap_forever(self, interval: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap_expired()
            except Exception:
                log.exception("reaper failed")

"""The orchestrator: creates, tracks, pauses, snapshots, forks, expires and kills
sandboxes.

Lifecycle: :meth:`Orchestrator.startup` (open the store, re-adopt or settle what a previous
run left, start the reaper and the base template build), then requests, then
:meth:`Orchestrator.shutdown`. Every state change of a sandbox happens here, in one
operation at a time per sandbox (:class:`~.operations.SandboxOperations`), and is written to the
store before the call returns.

State machine (``SandboxRecord.state``)::

    creating -> running <-> pausing -> paused <-> resuming -> running
                running -> snapshotting -> running
                running -> forking -> running
        running | paused -> killing -> (gone)

Operations on one sandbox run one after another; an identical request arriving while one
is queued or running joins it (two ``pause`` calls get one pause). Operations run as tasks
of their own, so a client that disconnects never aborts one half-way. Failures roll back:
a failed pause, snapshot or fork leaves the sandbox running, a failed resume leaves it
paused.

Memory: on a node whose data directory can reflink (XFS, btrfs), a sandbox's RAM is a file
of its own (``memory.raw``, a clone of the template's, mapped shared): pausing it writes
device state only and resuming maps the same file again. Otherwise, and for fork children,
RAM is a private copy-on-write mapping of the source's image, and pausing streams RAM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import secrets
import shutil
import sqlite3
import string
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, cast

import httpx

from agentenv.config import Config
from agentenv.network import NetworkManager, SandboxNetwork, pick_free_subnet
from agentenv.network.addresses import GUEST_MAC, TAP_NAME
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.builds import BuildManager
from agentenv.orchestrator.catalog import Catalog
from agentenv.orchestrator.errors import (
    CapacityExhausted,
    Conflict,
    GuestUnavailable,
    InvalidRequest,
    NodeCacheFull,
    OperationFailed,
    RepositoryUnavailable,
    SandboxNotFound,
    SandboxStartFailed,
    SnapshotNotFound,
    TemplateNotFound,
)
from agentenv.orchestrator.operations import SandboxOperations
from agentenv.orchestrator.store import SandboxRecord, SnapshotRecord, Store, utcnow
from agentenv.orchestrator.templates import BASE_TEMPLATE, TemplateManager
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError, write_manifest
from agentenv.storage.clone import clone_file, flush_file, make_durable, supports_reflink
from agentenv.storage.extents import reshare
from agentenv.storage.images import DiskFormat, backing_chain, flatten, writable_disk
from agentenv.vmm.base import (
    DriveSpec,
    MachineSpec,
    NetSpec,
    SnapshotFiles,
    VirtualMachine,
    VMMDriver,
    VMMError,
    VMRunState,
)

log = logging.getLogger("agentenv.orchestrator")


_ID_ALPHABET = string.ascii_lowercase + string.digits
VM_DIR = "vm"
MEMORY_FILE = "memory.raw"
# A paused sandbox's saved machine lives here, next to its disk and RAM files.
PAUSED_DIR = "paused"
PAUSED_MANIFEST = "snapshot.json"
# Marks a filesystem-only pause: the disk is kept, RAM and processes are not.
DISK_ONLY_MARKER = "disk-only"
AUTO_PAUSE_RETRY_S = 60
# How often running sandboxes' RAM files are written back. A snapshot or fork must write
# back what is dirty while the guest is stopped (or just before); doing it regularly in
# the background keeps that to what changed in the last few seconds.
RAM_FLUSH_INTERVAL_S = 5.0
MAX_FORK_CHILDREN = 20
# Longest chain of qcow2 images a snapshot's disk may have before it is flattened onto
# its template's image. Every read of a cluster a layer does not hold walks down the
# chain (one lookup per layer, each layer with its own L2 cache in QEMU), so reads slow
# and per-VM memory grows with depth; flattening copies what the skipped layers hold, so
# doing it every few snapshots keeps that cost amortised. Eight keeps lookups cheap while
# flattening at most once per seven snapshots of a sandbox.
MAX_DISK_CHAIN = 8
# States in which a sandbox exists for callers, and what they read as: SDKs know only
# "running" and "paused", and a sandbox in transition is still what it was.
PUBLIC_STATE = {
    "running": "running",
    "pausing": "running",
    "snapshotting": "running",
    "forking": "running",
    "paused": "paused",
    "resuming": "paused",
}
VISIBLE_STATES = tuple(PUBLIC_STATE)
# Local snapshot kinds that are committed to the repository and start sandboxes.
SHAREABLE_KINDS = ("snapshot", "template")
# In a snapshot directory once its commit to the repository is complete.
COMMITTED_MARKER = "committed"
# In a paused sandbox's directory: the state of its upload to the repository.
UPLOAD_MARKER = "upload.json"
# A paused sandbox's files are copied (reflinked) here for the upload, so a resume does
# not change them under it.
FROZEN_DIR = "frozen"
HANDOFF_CHECK_INTERVAL_S = 5.0
COMMIT_RETRY_S = 10.0
# States a VMM process exists in (re-adopted after a restart).
_VM_STATES = ("running", "pausing", "snapshotting", "forking")


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


MIB = 1024 * 1024


def _committed(snapshot_dir: Path) -> bool:
    return (snapshot_dir / COMMITTED_MARKER).exists()


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


def _legacy_disk(workdir: Path) -> tuple[Path, DiskFormat]:
    """The disk of a sandbox recorded before disk paths were stored."""
    qcow2 = workdir / "disk.qcow2"
    if qcow2.exists():
        return qcow2, "qcow2"
    return workdir / "disk.raw", "raw"


def _next_top(workdir: Path) -> Path:
    """A new name for a sandbox's writable disk image after its current one is sealed."""
    return workdir / f"disk-{secrets.token_hex(4)}.qcow2"


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


def new_snapshot_id() -> str:
    return "snap-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(16))


@dataclass(frozen=True)
class SandboxView:
    """What callers see of a sandbox."""

    record: SandboxRecord
    guest_address: str
    children: tuple[str, ...] = ()

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    @property
    def state(self) -> str:
        """``running`` or ``paused``: a change in progress shows the state the sandbox
        is leaving, which is what it still is until the change completes."""
        return PUBLIC_STATE.get(self.record.state, self.record.state)


@dataclass(frozen=True)
class SnapshotView:
    record: SnapshotRecord

    @property
    def snapshot_id(self) -> str:
        return self.record.snapshot_id

    @property
    def names(self) -> list[str]:
        return [self.record.name] if self.record.name else []


def _record_from_repository(record: dict[str, Any]) -> SnapshotRecord:
    """A committed snapshot as the local record type (for views; it has no directory
    here)."""
    names = record.get("names") or []
    return SnapshotRecord(
        snapshot_id=record["id"],
        name=names[0] if names else None,
        kind=record.get("type", "snapshot"),
        state="ready",
        sandbox_id=record.get("sandbox_id", ""),
        template_id=record.get("template_id", ""),
        parent_id=record.get("parent_id"),
        snapshot_dir=Path(),
        metadata=dict(record.get("metadata") or {}),
        created_at=datetime.fromisoformat(record["created_at"]),
    )


def _generation(workdir: Path) -> int:
    """How many times this sandbox was committed paused (0: never)."""
    try:
        return int((workdir / "generation").read_text())
    except (OSError, ValueError):
        return 0


def _upload_state(workdir: Path) -> dict[str, Any] | None:
    try:
        return cast(
            "dict[str, Any]", json.loads((workdir / PAUSED_DIR / UPLOAD_MARKER).read_text())
        )
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class _Source:
    """What a new sandbox starts from: a template build, a snapshot or a fork image."""

    template_id: str
    build_id: str
    snapshot: MachineSnapshot
    snapshot_id: str | None


@dataclass(frozen=True)
class _Identity:
    """What a new sandbox is given (and a fork child inherits from its parent)."""

    metadata: dict[str, str]
    env_vars: dict[str, str]
    secure: bool
    allow_internet: bool
    auto_pause: bool
    auto_resume: bool
    parent_id: str | None = None


class _ReshareJob:
    """One resharing of a RAM file (:func:`reshare`) on the resharing thread, which can be
    stopped; :meth:`cancel` says whether it had started (and so must be waited for)."""

    def __init__(self, memory: Path, like: Path) -> None:
        self.memory, self.like = memory, like
        self.stop = threading.Event()
        self.task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._started = False

    def run(self) -> int:
        with self._lock:
            if self.stop.is_set():
                return 0
            self._started = True
        return reshare(self.memory, self.like, self.stop)

    def cancel(self) -> bool:
        with self._lock:
            self.stop.set()
            return self._started


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
        self._operations = SandboxOperations()
        # envd /init after a resume, which traffic to the sandbox waits for.
        self._settling: dict[str, asyncio.Task[None]] = {}
        # Paused sandboxes whose network namespace is kept for a while (config
        # network_linger), with the task that releases it.
        self._lingering: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[object]] = set()
        # Snapshot directories whose disk chain is being flattened.
        self._flattening: set[Path] = set()
        # One thread gives back the blocks RAM files needlessly unshared. Not niced: it
        # takes the GIL, and a starved holder would stall the event loop.
        self._resharing = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="aenv-reshare"
        )
        # A paused sandbox's resharing of its RAM file, to stop before a VM maps it again.
        self._paused_resharing: dict[str, _ReshareJob] = {}
        self._reflinks = False
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
        # Whether new sandboxes get RAM files of their own (decided in startup()).
        self.own_memory_files = False
        self._reaper: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._base_build: asyncio.Task[object] | None = None
        self._started = False
        self.catalog = Catalog(config, self._pinned_keys)
        self.builds = BuildManager(self)
        # Background commits to the repository: snapshot id -> task, sandbox id -> task.
        self._commits: dict[str, asyncio.Task[None]] = {}
        self._uploads: dict[str, asyncio.Task[None]] = {}
        self._handoffs_checked = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    async def startup(self, *, build_base: bool = True) -> None:
        for d in (
            self.config.home,
            self.config.templates_dir,
            self.config.sandboxes_dir,
            self.config.snapshots_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        reflinks = self._reflinks = supports_reflink(self.config.sandboxes_dir)
        wanted = self.config.sandbox_memory
        self.own_memory_files = self.driver.shared_memory_boot and (
            wanted == "file" or (wanted == "auto" and reflinks)
        )
        log.info(
            "data directory %s %s reflinks: sandbox RAM is %s",
            self.config.home,
            "supports" if reflinks else "does not support",
            "a file of its own (fast pause and snapshot)"
            if self.own_memory_files
            else "a private mapping of the template's (pause streams RAM)",
        )
        self.store.open()
        self.catalog.startup()
        self.templates.cleanup_staging()
        await self._recover()
        self._resume_commits()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        self._flusher = asyncio.get_running_loop().create_task(self._flush_forever())
        if build_base:
            self._base_build = asyncio.get_running_loop().create_task(self._build_base_quietly())
        self._started = True

    async def shutdown(self, *, kill_sandboxes: bool = False) -> None:
        """Stop background work. Sandboxes keep running (their VMMs live in their own
        sessions) and are re-adopted by the next start, unless ``kill_sandboxes``."""
        await self.builds.shutdown()
        for task in (
            self._reaper,
            self._flusher,
            self._base_build,
            *self._commits.values(),
            *self._uploads.values(),
        ):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for lingering in self._lingering.values():
            lingering.cancel()
        for op in self._operations.pending():
            with contextlib.suppress(Exception):
                await op
        if kill_sandboxes:
            for rec in self.store.list_sandboxes():
                with contextlib.suppress(SandboxNotFound):
                    await self.kill(rec.sandbox_id)
        for vm in self._vms.values():
            await vm.close()
        self._vms.clear()
        self._resharing.shutdown(wait=False, cancel_futures=True)
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
        whose saved state is complete, settle interrupted operations, and clean up what
        cannot be recovered."""
        kept: set[int] = set()
        for rec in self.store.list_sandboxes():
            vm_dir = rec.workdir / VM_DIR
            saved = (rec.workdir / PAUSED_DIR / PAUSED_MANIFEST).exists() or (
                rec.workdir / PAUSED_DIR / DISK_ONLY_MARKER
            ).exists()
            if rec.state in _VM_STATES:
                try:
                    vm = await self.driver.attach(vm_dir)
                except VMMError as exc:
                    if rec.state == "pausing" and saved:
                        # The save finished; the crash came while releasing the VM.
                        await self.network.destroy(rec.slot)
                        self.store.update_sandbox(rec.sandbox_id, state="paused")
                        log.info("sandbox %s: interrupted pause completed", rec.sandbox_id)
                        continue
                    disk = self._current_disk(rec)[0]
                    if disk.exists():
                        # Its processes are gone, its files are not: keep it, paused,
                        # to be booted from its disk on resume, instead of losing it.
                        await self._keep_disk_only(rec)
                        log.warning(
                            "sandbox %s lost its VMM (%s); kept as a filesystem-only pause "
                            "(its disk survives, its processes restart on resume)",
                            rec.sandbox_id,
                            exc,
                        )
                        continue
                    log.warning("sandbox %s lost (%s); cleaning it up", rec.sandbox_id, exc)
                else:
                    if rec.state != "running":
                        # Stopped mid-save, mid-snapshot or mid-fork: the running VM wins.
                        with contextlib.suppress(VMMError):
                            await vm.resume()
                        shutil.rmtree(rec.workdir / PAUSED_DIR, ignore_errors=True)
                    # A seal may have moved the disk to a new top before the crash.
                    drive = next(d for d in vm.spec.drives if d.drive_id == "root")
                    self.store.update_sandbox(rec.sandbox_id, state="running", disk_path=drive.path)
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
            elif rec.state in ("paused", "resuming"):
                log.warning("paused sandbox %s has no saved state; cleaning it up", rec.sandbox_id)
            await self._discard(rec)
        known = {rec.workdir for rec in self.store.list_sandboxes()}
        if self.config.sandboxes_dir.exists():
            for path in self.config.sandboxes_dir.iterdir():
                if path not in known:
                    log.info("removing orphaned sandbox directory %s", path)
                    await self._kill_leftover_vm(path / VM_DIR)
                    shutil.rmtree(path, ignore_errors=True)
        self._recover_snapshots()
        removed = await self.network.reclaim(kept)
        if removed:
            log.info("reclaimed leftover network resources: %s", ", ".join(removed))

    def _recover_snapshots(self) -> None:
        """A snapshot whose manifest was never written did not complete: hide it (its
        layer may back a sandbox's disk) and let collection remove it once unused."""
        for snap in self.store.list_snapshots():
            complete = (snap.snapshot_dir / PAUSED_MANIFEST).exists()
            if snap.state == "pending" or (snap.state == "ready" and not complete):
                log.warning("snapshot %s is incomplete; hiding it", snap.snapshot_id)
                self.store.update_snapshot(snap.snapshot_id, state="deleted")
            elif snap.kind == "fork" and snap.state == "ready":
                # Its children were started (or never will be): only they keep it.
                self.store.update_snapshot(snap.snapshot_id, state="deleted")
        known = {s.snapshot_dir for s in self.store.list_snapshots()}
        for path in self.config.snapshots_dir.iterdir():
            if path not in known:
                log.info("removing unrecorded snapshot directory %s", path)
                shutil.rmtree(path, ignore_errors=True)
        self.collect_snapshots()

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

    def _keep(self, task: asyncio.Task[object]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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

    # -- queries -------------------------------------------------------------------------
    def _view(self, rec: SandboxRecord, *, with_children: bool = False) -> SandboxView:
        children: tuple[str, ...] = ()
        if with_children:
            children = tuple(
                r.sandbox_id
                for r in self.store.list_sandboxes()
                if r.parent_id == rec.sandbox_id and r.state in VISIBLE_STATES
            )
        return SandboxView(rec, self.network.describe(rec.slot).guest_address, children)

    def get(self, sandbox_id: str) -> SandboxView:
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state not in VISIBLE_STATES:
            raise SandboxNotFound(sandbox_id)
        return self._view(rec, with_children=True)

    def list_sandboxes(self) -> list[SandboxView]:
        return [self._view(r) for r in self.store.list_sandboxes() if r.state in VISIBLE_STATES]

    async def guest_metrics(self, sandbox_id: str) -> dict[str, object]:
        """Current resource use inside the guest, as envd reports it."""
        view = self.get(sandbox_id)
        try:
            return await envd_client.metrics(self.http, view.guest_address, view.record.envd_token)
        except envd_client.EnvdUnreachable as exc:
            raise GuestUnavailable(f"sandbox {sandbox_id}: {exc}") from exc

    async def ready_for_traffic(self, sandbox_id: str) -> SandboxView:
        """The sandbox once it can take proxied traffic: a paused sandbox created with
        ``autoResume`` is resumed, an operation in progress is waited for, and so is
        envd's re-initialisation after a resume. Raises :class:`Conflict` for a sandbox
        that is paused and stays so."""
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state not in VISIBLE_STATES:
            raise SandboxNotFound(sandbox_id)
        if rec.state == "paused":
            if not rec.auto_resume:
                raise Conflict(f"sandbox {sandbox_id} is paused")
            with contextlib.suppress(Conflict):  # someone else resumed it first
                await self.resume(sandbox_id)
        elif rec.state != "running":
            for task in self._operations.pending(sandbox_id):
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
        settling = self._settling.get(sandbox_id)
        if settling is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(settling)
        current = self.store.get_sandbox(sandbox_id)
        if current is None or current.state not in VISIBLE_STATES:
            raise SandboxNotFound(sandbox_id)
        if current.state != "running":
            raise Conflict(f"sandbox {sandbox_id} is {PUBLIC_STATE[current.state]}")
        return self._view(current)

    # -- create --------------------------------------------------------------------------
    def _check_timeout(self, timeout: int) -> None:
        if timeout < 0:
            raise InvalidRequest("timeout must not be negative")
        if timeout > self.config.max_timeout:
            raise InvalidRequest(f"timeout must be at most {self.config.max_timeout} seconds")

    async def _resolve_source(self, template_id: str) -> _Source:
        """A template id or name, or a snapshot id or name: all start sandboxes. The
        built-in ``base`` is built on each node; everything else is the repository's
        (which is authoritative: a snapshot deleted on another node is gone here too),
        from this node's own copy when it has one, else fetched into the node cache."""
        if template_id == BASE_TEMPLATE:
            template = await self.templates.get(template_id)
            return _Source(
                template.record.template_id, template.record.build_id, template.snapshot, None
            )
        local = self.store.get_snapshot(template_id)
        if local is not None and (local.kind not in SHAREABLE_KINDS or local.state != "ready"):
            local = None
        if local is not None and not _committed(local.snapshot_dir):
            # Not in the repository yet (its commit is under way): this node's copy.
            return self._local_source(local)
        try:
            record = await self.catalog.lookup(template_id)
        except RepositoryUnavailable as exc:
            if local is None:
                raise
            log.warning("using local copy of %s: %s", template_id, exc)
            return self._local_source(local)
        if record is None:
            if local is not None:
                # Deleted from the repository by another node: forget it here too.
                self.store.update_snapshot(local.snapshot_id, state="deleted", name=None)
                self.collect_snapshots()
            if self.store.get_template(template_id) is not None:
                template = await self.templates.get(template_id)
                return _Source(
                    template.record.template_id, template.record.build_id, template.snapshot, None
                )
            raise TemplateNotFound(template_id)
        if local is not None and local.snapshot_id == record["id"]:
            return self._local_source(local)
        snapshot = await self.catalog.fetch(
            record, lambda line: log.info("fetching %s: %s", record["id"], line)
        )
        key = record["id"]
        return _Source(key, key, snapshot, key)

    def _local_source(self, rec: SnapshotRecord) -> _Source:
        try:
            snapshot = MachineSnapshot.load(rec.snapshot_dir)
        except SnapshotError as exc:
            raise SandboxStartFailed(f"snapshot {rec.snapshot_id}: {exc}") from exc
        key = rec.snapshot_id
        return _Source(key, key, snapshot, key)

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
        auto_resume: bool = False,
    ) -> SandboxView:
        timeout = self.config.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)
        source = await self._resolve_source(template_id)
        identity = _Identity(
            metadata=metadata or {},
            env_vars=env_vars or {},
            secure=secure,
            allow_internet=allow_internet,
            auto_pause=auto_pause,
            auto_resume=auto_resume,
        )
        return await self._start(source, identity, timeout, private_memory=False)

    async def create_from_machine(
        self, snapshot: MachineSnapshot, template_id: str, *, timeout: int, metadata: dict[str, str]
    ) -> SandboxView:
        """A sandbox restored from a machine snapshot that is not a template (a guest
        booted from an OCI image, which template builds start from)."""
        identity = _Identity(
            metadata=metadata,
            env_vars={},
            secure=False,
            # Build steps install packages.
            allow_internet=True,
            auto_pause=False,
            auto_resume=False,
        )
        source = _Source(template_id, template_id, snapshot, None)
        return await self._start(source, identity, timeout, private_memory=False)

    async def _start(
        self, source: _Source, identity: _Identity, timeout: int, *, private_memory: bool
    ) -> SandboxView:
        sandbox_id = new_sandbox_id()

        async def work() -> SandboxView:
            slot = self._reserve_slot()
            try:
                return await self._create_locked(
                    sandbox_id, source, identity, slot, timeout, private_memory
                )
            finally:
                self._release_slot(slot)

        return await self._operations.run(sandbox_id, "create", work, join=False)

    async def _create_locked(
        self,
        sandbox_id: str,
        source: _Source,
        identity: _Identity,
        slot: int,
        timeout: int,
        private_memory: bool,
    ) -> SandboxView:
        snap = source.snapshot
        workdir = self.config.sandboxes_dir / sandbox_id
        own_memory = self.driver.shared_memory_boot and (
            snap.files.memory_file is None or (self.own_memory_files and not private_memory)
        )
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=source.template_id,
            template_build_id=source.build_id,
            state="creating",
            slot=slot,
            workdir=workdir,
            started_at=now,
            end_at=now + timedelta(seconds=timeout),
            vcpus=snap.vcpus,
            memory_mib=snap.memory_mib,
            disk_size_mib=snap.disk_size_mib,
            envd_version=snap.envd_version,
            envd_token=secrets.token_urlsafe(24) if identity.secure else None,
            metadata=identity.metadata,
            env_vars=identity.env_vars,
            auto_pause=identity.auto_pause,
            allow_internet=identity.allow_internet,
            memory_mode="shared" if own_memory else "private",
            source_dir=snap.directory,
            parent_id=identity.parent_id,
            snapshot_id=source.snapshot_id,
            auto_resume=identity.auto_resume,
        )
        # The record goes first, so a crash mid-create leaves something to clean up.
        self.store.insert_sandbox(rec)
        vm: VirtualMachine | None = None
        phases = _PhaseTimer()
        try:
            workdir.mkdir(parents=True)
            (workdir / VM_DIR).mkdir()
            memory = workdir / MEMORY_FILE
            # Independent, so concurrent; a failure cancels the others before the rollback.
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
                        self.network.create(slot, allow_internet=identity.allow_internet)
                    )
                    if own_memory and snap.files.memory_file is not None:
                        group.create_task(clone_file(snap.files.memory_file, memory))
            except BaseExceptionGroup as group_error:
                raise group_error.exceptions[0] from None
            disk, disk_format = disk_task.result()
            net = net_task.result()
            self.store.update_sandbox(sandbox_id, disk_path=disk)
            rec.disk_path = disk
            phases.mark("disk+network+memory")
            if not own_memory and snap.files.memory_file is not None:
                # Private mapping: the sandbox's RAM writes are copy-on-write in its own
                # memory; the source image is shared through the page cache.
                memory = snap.files.memory_file
            spec = self._machine_spec(snap, disk, disk_format, memory, own_memory, net.netns)
            vm = await self.driver.restore(spec, snap.files, workdir / VM_DIR)
            phases.mark("restore")
            await envd_client.init(
                self.http, net.guest_address, env_vars=rec.env_vars, access_token=rec.envd_token
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
        log.info("sandbox %s running (from %s) in %s", sandbox_id, rec.template_id, phases)
        return self._view(rec)

    def _machine_spec(
        self,
        snap: MachineSnapshot,
        disk: Path,
        disk_format: DiskFormat,
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
                DriveSpec("root", disk, fmt=disk_format),
                DriveSpec("tools", snap.tools_drive, read_only=True),
            ),
            memory_file=memory_file,
            memory_shared=memory_shared,
            accel=self.accel,
            net=NetSpec(tap=TAP_NAME, mac=GUEST_MAC, netns=netns),
        )

    # -- pause and resume ------------------------------------------------------------------
    async def pause(self, sandbox_id: str, *, memory: bool = True) -> SandboxView:
        """Save the machine under the sandbox's directory and release its VMM process and
        network namespace; disk and RAM files stay. Joins a pause already in progress.
        Without ``memory``, only the disk is kept: RAM is discarded and the guest boots
        from its disk on resume (processes restart).

        On failure the VM keeps running (the driver resumes it) and so does the sandbox."""
        kind = "pause" if memory else "pause-filesystem"
        return await self._operations.run(
            sandbox_id, kind, lambda: self._pause_locked(sandbox_id, memory), join=True
        )

    async def _pause_locked(self, sandbox_id: str, memory: bool) -> SandboxView:
        rec = self._existing(sandbox_id)
        if rec.state == "paused":
            raise Conflict(f"sandbox {sandbox_id} is already paused")
        vm = self._running_vm(rec)
        if not memory:
            return await self._pause_disk_only(rec, vm)
        phases = _PhaseTimer()
        dest = rec.workdir / PAUSED_DIR
        self.store.update_sandbox(sandbox_id, state="pausing")
        try:
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            # With RAM in the sandbox's own file this writes device state only.
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
        phases.mark("vm")
        self._prepare_upload(rec, files)
        self._reshare_later(
            rec, files.memory_file, f"sandbox {sandbox_id} (paused)", paused=sandbox_id
        )
        # The pause is complete once saved and the VMM is gone; the network namespace
        # follows a little later unless a resume takes it back first.
        self._release_network_later(rec)
        self.store.update_sandbox(sandbox_id, state="paused", pause_mode="full")
        rec.state = "paused"
        if _upload_state(rec.workdir) is not None:
            self._start_upload(sandbox_id)
        log.info("sandbox %s paused in %s", sandbox_id, phases)
        return self._view(rec)

    async def _pause_disk_only(self, rec: SandboxRecord, vm: VirtualMachine) -> SandboxView:
        phases = _PhaseTimer()
        self.store.update_sandbox(rec.sandbox_id, state="pausing")
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
            self.store.update_sandbox(rec.sandbox_id, state="running")
            raise OperationFailed(f"pausing sandbox {rec.sandbox_id} failed: {exc}") from exc
        self._vms.pop(rec.sandbox_id, None)
        await vm.kill()
        await self._keep_disk_only(rec)
        phases.mark("release")
        rec.state, rec.pause_mode = "paused", "filesystem"
        log.info("sandbox %s paused (filesystem only) in %s", rec.sandbox_id, phases)
        return self._view(rec)

    def _release_network_later(self, rec: SandboxRecord) -> None:
        sandbox_id = rec.sandbox_id

        async def release() -> None:
            await asyncio.sleep(self.config.network_linger)
            async with self._operations.lock(sandbox_id):
                if self._lingering.get(sandbox_id) is not task:
                    return
                del self._lingering[sandbox_id]
                current = self.store.get_sandbox(sandbox_id)
                if current is None or current.state != "paused":
                    return
                try:
                    await self.network.destroy(current.slot)
                except Exception as exc:
                    # Retried when the slot is next used, or at the next start.
                    log.warning("sandbox %s: releasing its network failed: %s", sandbox_id, exc)

        task = asyncio.get_running_loop().create_task(release())
        self._lingering[sandbox_id] = task

    async def _take_network(self, rec: SandboxRecord) -> SandboxNetwork:
        """The sandbox's network: still there if its pause was recent, else built."""
        lingering = self._lingering.pop(rec.sandbox_id, None)
        if lingering is not None and not lingering.done():
            lingering.cancel()
            return self.network.describe(rec.slot)
        return await self.network.create(rec.slot, allow_internet=rec.allow_internet)

    def _forget_network(self, rec: SandboxRecord) -> None:
        lingering = self._lingering.pop(rec.sandbox_id, None)
        if lingering is not None:
            lingering.cancel()

    async def _keep_disk_only(self, rec: SandboxRecord) -> None:
        """Turn a sandbox without a VMM into a filesystem-only pause: marker written,
        RAM discarded, network released."""
        dest = rec.workdir / PAUSED_DIR
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        _write_atomically(dest / DISK_ONLY_MARKER, "")
        (rec.workdir / MEMORY_FILE).unlink(missing_ok=True)
        self._forget_network(rec)
        try:
            await self.network.destroy(rec.slot)
        except Exception as exc:
            log.warning("sandbox %s: releasing its network failed: %s", rec.sandbox_id, exc)
        self.store.update_sandbox(
            rec.sandbox_id, state="paused", pause_mode="filesystem", memory_mode="shared"
        )

    async def resume(self, sandbox_id: str, timeout: int | None = None) -> SandboxView:
        """Restore a paused sandbox with the same id, files and processes; joins a resume
        already in progress. Returns once the VM runs; envd's re-initialisation (clock,
        entropy) finishes in the background and proxied traffic waits for it. On failure
        the sandbox stays paused."""
        timeout = self.config.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)
        return await self._operations.run(
            sandbox_id, "resume", lambda: self._resume_locked(sandbox_id, timeout), join=True
        )

    async def _resume_locked(self, sandbox_id: str, timeout: int) -> SandboxView:
        rec = self._existing(sandbox_id)
        if rec.state != "paused":
            raise Conflict(f"sandbox {sandbox_id} is not paused")
        phases = _PhaseTimer()
        await self._stop_upload(sandbox_id)
        await self._stop_resharing(sandbox_id)
        marker = _upload_state(rec.workdir)
        if marker is not None and marker.get("state") == "committed":
            # Committed: another node may have resumed it. Whoever claims this
            # generation first holds it.
            if not await self.catalog.claim(sandbox_id, int(marker["generation"])):
                holder = await self.catalog.holder(sandbox_id, int(marker["generation"]))
                self._forget_network(rec)
                await self._discard(rec)
                raise Conflict(f"sandbox {sandbox_id} was resumed on node {holder}")
            phases.mark("claim")
        snap = self._source_snapshot(rec)
        disk, disk_format = self._current_disk(rec)
        # None for a filesystem-only pause: the guest boots from its disk.
        files = (
            None
            if rec.pause_mode == "filesystem"
            else SnapshotFiles.from_json((rec.workdir / PAUSED_DIR / PAUSED_MANIFEST).read_text())
        )
        if files is not None and files.memory_file is not None:
            memory, shared = files.memory_file, True
        else:
            # RAM comes from the stream (or a boot); it lands in a file of the sandbox's
            # own when the VMM can map one, so the next pause is a device-state save.
            memory, shared = rec.workdir / MEMORY_FILE, self.driver.shared_memory_boot
            memory.unlink(missing_ok=True)
        self.store.update_sandbox(sandbox_id, state="resuming")
        vm: VirtualMachine | None = None
        try:
            vm_dir = rec.workdir / VM_DIR
            shutil.rmtree(vm_dir, ignore_errors=True)
            vm_dir.mkdir()
            net = await self._take_network(rec)
            phases.mark("network")
            spec = self._machine_spec(snap, disk, disk_format, memory, shared, net.netns)
            if files is not None:
                vm = await self.driver.restore(spec, files, vm_dir)
                phases.mark("restore")
            else:
                vm = await self.driver.boot(spec, vm_dir)
                booted = vm
                await envd_client.wait_healthy(
                    self.http,
                    net.guest_address,
                    self.config.template_boot_timeout,
                    alive=lambda: booted.state is not VMRunState.STOPPED,
                )
                phases.mark("boot")
        except Exception as exc:
            if vm is not None:
                await vm.kill()
            with contextlib.suppress(Exception):
                await self.network.destroy(rec.slot)
            self.store.update_sandbox(sandbox_id, state="paused")
            raise OperationFailed(f"resuming sandbox {sandbox_id} failed: {exc}") from exc
        self._vms[sandbox_id] = vm
        end_at = utcnow() + timedelta(seconds=timeout)
        mode = "shared" if shared else "private"
        self.store.update_sandbox(
            sandbox_id, state="running", end_at=end_at, memory_mode=mode, pause_mode=None
        )
        rec.state, rec.end_at, rec.memory_mode, rec.pause_mode = "running", end_at, mode, None
        # The saved state is consumed: the running machine has moved on from it.
        shutil.rmtree(rec.workdir / PAUSED_DIR, ignore_errors=True)
        self._settle(rec, net.guest_address)
        log.info("sandbox %s resumed in %s", sandbox_id, phases)
        return self._view(rec)

    async def _forget_in_repository(self, rec: SandboxRecord) -> None:
        """A killed sandbox that was ever committed paused must not be resumable from
        the repository; unless another node holds it now."""
        generation = _generation(rec.workdir)
        if generation == 0:
            return
        try:
            marker = _upload_state(rec.workdir)
            if rec.state == "paused" and marker is not None and marker.get("state") == "committed":
                if not await self.catalog.claim(rec.sandbox_id, generation):
                    return
            await self.catalog.drop_paused(rec.sandbox_id)
        except RepositoryUnavailable as exc:
            log.warning(
                "sandbox %s: removing it from the repository failed: %s", rec.sandbox_id, exc
            )

    def _settle(self, rec: SandboxRecord, guest_address: str) -> None:
        """Re-initialise envd after a restore (clock, entropy reseed, token), in the
        background; :meth:`ready_for_traffic` waits for it."""

        async def init() -> None:
            try:
                await envd_client.init(
                    self.http,
                    guest_address,
                    env_vars=rec.env_vars,
                    access_token=rec.envd_token,
                )
            except Exception as exc:
                log.error("sandbox %s: envd /init after resume failed: %s", rec.sandbox_id, exc)
            finally:
                if self._settling.get(rec.sandbox_id) is task:
                    del self._settling[rec.sandbox_id]

        task = asyncio.get_running_loop().create_task(init())
        self._settling[rec.sandbox_id] = task

    def _existing(self, sandbox_id: str) -> SandboxRecord:
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state not in ("running", "paused"):
            raise SandboxNotFound(sandbox_id)
        return rec

    def _running_vm(self, rec: SandboxRecord) -> VirtualMachine:
        if rec.state != "running":
            raise Conflict(f"sandbox {rec.sandbox_id} is {PUBLIC_STATE[rec.state]}, not running")
        vm = self._vms.get(rec.sandbox_id)
        if vm is None:
            raise GuestUnavailable(f"sandbox {rec.sandbox_id} has no VMM attached")
        return vm

    def _current_disk(self, rec: SandboxRecord) -> tuple[Path, DiskFormat]:
        if rec.disk_path is None:
            return _legacy_disk(rec.workdir)
        return rec.disk_path, "qcow2" if rec.disk_path.suffix == ".qcow2" else "raw"

    def _source_snapshot(self, rec: SandboxRecord) -> MachineSnapshot:
        directory = rec.source_dir or (
            self.config.templates_dir / rec.template_id / rec.template_build_id
        )
        try:
            return MachineSnapshot.load(directory)
        except SnapshotError as exc:
            raise OperationFailed(f"source of sandbox {rec.sandbox_id}: {exc}") from exc

    def _reshare_later(
        self, rec: SandboxRecord, memory: Path | None, what: str, *, paused: str | None = None
    ) -> None:
        """In the background, make the RAM file ``memory`` (a paused sandbox's or a
        snapshot's) share again the blocks it holds unchanged from the RAM file of the
        sandbox's source: those the guest rewrote with the same bytes, above all the pages
        it zeroed that were zero already (see :mod:`agentenv.storage.extents`).

        Only for sandboxes whose RAM is a file of their own: their RAM files are mapped
        shared by their own VM or cloned, never mapped privately by others (fork images
        and private-memory machines are left alone). A paused sandbox's (``paused``: its
        id) is stopped by :meth:`_stop_resharing` before its VM maps the file again."""
        if not self._reflinks or memory is None or rec.memory_mode != "shared":
            return
        try:
            like = self._source_snapshot(rec).files.memory_file
        except OperationFailed:
            return
        if like is None:
            return

        job = _ReshareJob(memory, like)

        async def run() -> None:
            loop = asyncio.get_running_loop()
            try:
                if os.path.samefile(memory, like):
                    return
                shared = await loop.run_in_executor(self._resharing, job.run)
            except (FileNotFoundError, RuntimeError):
                return  # gone meanwhile (killed, deleted), or the server is shutting down
            except OSError as exc:
                log.warning("%s: resharing its RAM file failed: %s", what, exc)
                return
            finally:
                if paused is not None and self._paused_resharing.get(paused) is job:
                    del self._paused_resharing[paused]
            stopped = " (stopped early)" if job.stop.is_set() else ""
            log.info(
                "%s: RAM file shares %.1f MiB more with its source%s", what, shared / MIB, stopped
            )

        job.task = asyncio.get_running_loop().create_task(run())
        self._keep(job.task)
        if paused is not None:
            self._paused_resharing[paused] = job

    async def _stop_resharing(self, sandbox_id: str) -> None:
        """Stop resharing the paused sandbox's RAM file, waiting for a resharing that has
        started (one dedupe call at most): a VM must never map a file being reshared. One
        still queued behind others is not waited for; it will not touch the file."""
        job = self._paused_resharing.get(sandbox_id)
        if job is not None and job.cancel() and job.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(job.task)

    # -- snapshots and forks ---------------------------------------------------------------
    async def snapshot(
        self,
        sandbox_id: str,
        name: str | None = None,
        *,
        metadata: dict[str, str] | None = None,
        kind: Literal["snapshot", "template"] = "snapshot",
        replace_name: bool = False,
        wait_commit: bool = False,
        snapshot_id: str | None = None,
    ) -> SnapshotView:
        """Capture a running sandbox, which keeps running, as a snapshot that starts new
        sandboxes (by id or name, wherever a template is accepted). It is usable on this
        node at once and committed to the repository in the background (``wait_commit``:
        before returning). ``replace_name`` moves an existing name to the new snapshot
        (a template rebuilt under its name)."""
        if name is not None and not replace_name:
            existing = self.store.get_snapshot(name)
            if existing is not None and existing.state == "ready":
                raise Conflict(f"a snapshot named {name!r} already exists")
            if await self.catalog.name_holder(name) is not None:
                raise Conflict(f"a snapshot or template named {name!r} already exists")

        async def work() -> SnapshotView:
            rec = self._existing(sandbox_id)
            if name is not None and replace_name:
                existing = self.store.get_snapshot(name)
                if existing is not None and existing.name == name:
                    self.store.update_snapshot(existing.snapshot_id, name=None)
            snap_rec = await self._capture(rec, kind, name, metadata or {}, snapshot_id)
            return SnapshotView(snap_rec)

        view = await self._operations.run(sandbox_id, "snapshot", work, join=False)
        if wait_commit:
            try:
                await self._commit_snapshot(view.snapshot_id)
            except BaseException:
                self.store.update_snapshot(view.snapshot_id, state="deleted", name=None)
                self.collect_snapshots()
                raise
        else:
            self._start_commit(view.snapshot_id)
        return view

    async def _capture(
        self,
        rec: SandboxRecord,
        kind: str,
        name: str | None,
        metadata: dict[str, str],
        snapshot_id: str | None = None,
    ) -> SnapshotRecord:
        """Freeze a running sandbox into a new snapshot directory: device state, RAM
        (a reflink of its RAM file, sharing unchanged extents) and its disk's current top
        image, sealed in place while new writes go to a fresh top. The VM is stopped only
        for that; it runs on afterwards whatever happens."""
        vm = self._running_vm(rec)
        phases = _PhaseTimer()
        source = self._source_snapshot(rec)
        snapshot_id = snapshot_id or new_snapshot_id()
        directory = self.config.snapshots_dir / snapshot_id
        try:
            directory.mkdir()
        except OSError as exc:
            raise OperationFailed(f"snapshot of sandbox {rec.sandbox_id} failed: {exc}") from exc
        # Recorded (pending: hidden, and never collected) before the disk is sealed: from
        # then on the sandbox's disk may depend on this directory, so nothing may remove
        # it unrecorded.
        snap_rec = SnapshotRecord(
            snapshot_id=snapshot_id,
            name=None,
            kind=kind,
            state="pending",
            sandbox_id=rec.sandbox_id,
            template_id=rec.template_id,
            parent_id=rec.snapshot_id,
            snapshot_dir=directory,
            metadata=metadata,
            created_at=utcnow(),
        )
        self.store.insert_snapshot(snap_rec)
        state = "forking" if kind == "fork" else "snapshotting"
        self.store.update_sandbox(rec.sandbox_id, state=state)
        shared = rec.memory_mode == "shared"
        sealed = False
        try:
            if shared:
                # Write back most of the dirty RAM while the guest still runs: the
                # reflink below must write back what is dirty, with the guest stopped.
                await asyncio.to_thread(flush_file, vm.spec.memory_file)
                phases.mark("flush")
            files = await vm.save_state(directory)
            phases.mark("save")
            disk = directory / "disk.qcow2"
            new_top = _next_top(rec.workdir)
            old_top = next(d.path for d in vm.spec.drives if d.drive_id == "root")
            await vm.seal_drive("root", disk, new_top)
            sealed = True
            self.store.update_sandbox(rec.sandbox_id, disk_path=new_top, snapshot_id=snapshot_id)
            rec.disk_path, rec.snapshot_id = new_top, snapshot_id
            old_top.unlink(missing_ok=True)
            phases.mark("seal")
            if files.memory_file is not None:
                memory = directory / MEMORY_FILE
                await clone_file(files.memory_file, memory, mode=0o400)
                files = replace(files, memory_file=memory)
                phases.mark("memory")
        except Exception as exc:
            with contextlib.suppress(VMMError):
                await vm.resume()
            self.store.update_sandbox(rec.sandbox_id, state="running")
            if sealed:
                # The sandbox's disk builds on the sealed layer: collected with it.
                self.store.update_snapshot(snapshot_id, state="deleted")
            else:
                self.store.delete_snapshot(snapshot_id)
                shutil.rmtree(directory, ignore_errors=True)
            raise OperationFailed(f"snapshot of sandbox {rec.sandbox_id} failed: {exc}") from exc
        try:
            await vm.resume()
        finally:
            self.store.update_sandbox(rec.sandbox_id, state="running")
        phases.mark("resume")
        # Counted from the images themselves: a flatten in progress may not have
        # rewritten its manifest yet.
        chain = [p for p in backing_chain(disk) if p.suffix == ".qcow2"]
        depth = len(chain)
        try:
            write_manifest(
                replace(
                    source,
                    directory=directory,
                    files=files,
                    disk=disk,
                    disk_format="qcow2",
                    disk_chain_depth=depth,
                )
            )
            self.store.update_snapshot(snapshot_id, state="ready", name=name)
        except (OSError, SnapshotError, sqlite3.IntegrityError) as exc:
            self.store.update_snapshot(snapshot_id, state="deleted")
            if isinstance(exc, sqlite3.IntegrityError):
                raise Conflict(f"a snapshot named {name!r} already exists") from exc
            raise OperationFailed(f"snapshot of sandbox {rec.sandbox_id} failed: {exc}") from exc
        snap_rec.state, snap_rec.name = "ready", name
        # Safe from a server crash already (it is in the page cache); on stable storage,
        # safe from a power loss, a moment later.
        durable = [disk, *([files.memory_file] if files.memory_file else []), files.state_file]
        self._keep(asyncio.get_running_loop().create_task(self._make_durable(durable)))
        if kind != "fork":
            # A fork image is short-lived and its children are starting from it now.
            self._reshare_later(rec, files.memory_file, f"snapshot {snapshot_id}")
        if depth > MAX_DISK_CHAIN and not any(p.parent in self._flattening for p in chain):
            self._keep(asyncio.get_running_loop().create_task(self._flatten(directory)))
        log.info("sandbox %s: %s %s taken in %s", rec.sandbox_id, kind, snapshot_id, phases)
        return snap_rec

    async def _flatten(self, directory: Path) -> None:
        """Replace a snapshot's deep disk chain by one layer over the template's image.
        The flattened copy is renamed over the sealed layer's name: processes that have
        the old file open keep reading it, and every later open (restores, sandboxes
        started from the snapshot, the sandbox's own next disk top) gets the short chain
        with the same contents."""
        self._flattening.add(directory)
        try:
            snapshot = MachineSnapshot.load(directory)
            chain = backing_chain(snapshot.disk)
            qcow2 = [p for p in chain if p.suffix == ".qcow2"]
            if len(qcow2) <= 2:
                return
            onto = qcow2[-1]  # the template's own overlay on the guest image
            flat = await flatten(snapshot.disk, onto, "qcow2")
            await asyncio.to_thread(make_durable, flat)
            os.replace(flat, snapshot.disk)
            write_manifest(replace(snapshot, disk_chain_depth=2))
            log.info("snapshot %s: disk chain of %d flattened to 2", directory.name, len(qcow2))
            self.collect_snapshots()
        except Exception as exc:
            # The deep chain still works; the next snapshot tries again.
            log.warning("flattening the disk of snapshot %s failed: %s", directory.name, exc)
        finally:
            self._flattening.discard(directory)

    @staticmethod
    async def _make_durable(paths: list[Path]) -> None:
        try:
            await asyncio.to_thread(make_durable, *paths)
        except OSError as exc:  # deleted meanwhile, or a failing disk
            log.warning("writing snapshot files to stable storage failed: %s", exc)

    async def get_snapshot(self, key: str, type_: str = "snapshot") -> SnapshotView:
        local = self.store.get_snapshot(key)
        if local is not None and (local.kind != type_ or local.state != "ready"):
            local = None
        if local is not None and not _committed(local.snapshot_dir):
            return SnapshotView(local)
        try:
            record = await self.catalog.lookup(key)
        except RepositoryUnavailable:
            if local is None:
                raise
            return SnapshotView(local)
        if record is None or record.get("type") != type_:
            raise SnapshotNotFound(key)
        return SnapshotView(_record_from_repository(record))

    async def list_snapshots(
        self, sandbox_id: str | None = None, type_: str = "snapshot"
    ) -> list[SnapshotView]:
        """Committed snapshots (every node's), plus this node's still being committed."""
        views: dict[str, SnapshotView] = {}
        repository_ok = True
        try:
            for record in await self.catalog.list_records(type_):
                views[record["id"]] = SnapshotView(_record_from_repository(record))
        except RepositoryUnavailable as exc:
            log.warning("listing snapshots from this node only: %s", exc)
            repository_ok = False
        for rec in self.store.list_snapshots():
            if rec.kind != type_ or rec.state != "ready" or rec.snapshot_id in views:
                continue
            if repository_ok and _committed(rec.snapshot_dir):
                continue  # deleted from the repository by another node
            views[rec.snapshot_id] = SnapshotView(rec)
        out = [v for v in views.values() if sandbox_id is None or v.record.sandbox_id == sandbox_id]
        out.sort(key=lambda v: (v.record.created_at, v.snapshot_id))
        return out

    async def delete_snapshot(self, key: str, type_: str = "snapshot") -> None:
        """Forget a snapshot (or template) everywhere: its repository record and names
        go at once, this node's files once no sandbox or snapshot depends on them."""
        local = self.store.get_snapshot(key)
        if local is not None and (local.kind != type_ or local.state != "ready"):
            local = None
        if local is not None:
            commit = self._commits.pop(local.snapshot_id, None)
            if commit is not None:
                commit.cancel()
                with contextlib.suppress(BaseException):
                    await commit
        record = await self.catalog.lookup(key)
        if record is not None and record.get("type") != type_:
            record = None
        if record is None and local is None:
            raise SnapshotNotFound(key)
        if record is not None:
            await self.catalog.delete(record)
        local = local or self.store.get_snapshot(record["id"] if record else key)
        if local is not None and local.state == "ready":
            self.store.update_snapshot(local.snapshot_id, state="deleted", name=None)
            self.collect_snapshots()

    # -- the repository ----------------------------------------------------------------
    def _start_commit(self, snapshot_id: str) -> asyncio.Task[None]:
        task = self._commits.get(snapshot_id)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._commit_until_done(snapshot_id))
            self._commits[snapshot_id] = task

            def forget(done: asyncio.Task[None]) -> None:
                if self._commits.get(snapshot_id) is done:
                    del self._commits[snapshot_id]

            task.add_done_callback(forget)
        return task

    async def _commit_until_done(self, snapshot_id: str) -> None:
        """Commit a local snapshot, retrying while the repository is unreachable: it
        stays usable on this node meanwhile, and nothing is lost."""
        while True:
            try:
                await self._commit_snapshot(snapshot_id)
                return
            except Conflict as exc:
                # Another node committed one under the same name meanwhile: this one
                # is committed without it rather than retried forever.
                log.error("%s loses its name: %s", snapshot_id, exc)
                self.store.update_snapshot(snapshot_id, name=None)
            except (RepositoryUnavailable, NodeCacheFull, OSError, SnapshotError) as exc:
                log.warning(
                    "committing %s failed (%s); retrying in %.0fs", snapshot_id, exc, COMMIT_RETRY_S
                )
                await asyncio.sleep(COMMIT_RETRY_S)

    async def _commit_snapshot(self, snapshot_id: str) -> None:
        rec = self.store.get_snapshot(snapshot_id)
        if rec is None or rec.state != "ready" or _committed(rec.snapshot_dir):
            return
        started = time.perf_counter()
        log.info("committing %s %s to %s", rec.kind, snapshot_id, self.catalog.url)
        snap = MachineSnapshot.load(rec.snapshot_dir)
        published = await self.catalog.publish(snap)
        names = [rec.name] if rec.name else []
        record: dict[str, object] = {
            "id": rec.snapshot_id,
            "type": rec.kind,
            "names": names,
            "sandbox_id": rec.sandbox_id,
            "template_id": rec.template_id,
            "parent_id": rec.parent_id,
            "metadata": rec.metadata,
            "created_at": rec.created_at.isoformat(),
            "node": self.catalog.node,
            "vcpus": snap.vcpus,
            "memory_mib": snap.memory_mib,
            "disk_size_mib": snap.disk_size_mib,
            "envd_version": snap.envd_version,
            "manifest": published.manifest,
            "blobs": published.blobs,
        }
        await self.catalog.commit(record, names, replace_names=rec.kind == "template")
        _write_atomically(rec.snapshot_dir / COMMITTED_MARKER, "")
        log.info(
            "%s %s committed to %s in %.0f ms",
            rec.kind,
            snapshot_id,
            self.catalog.url,
            (time.perf_counter() - started) * 1000,
        )

    def _resume_commits(self) -> None:
        """Commits and uploads a previous run left unfinished start again."""
        for rec in self.store.list_snapshots():
            if rec.kind in SHAREABLE_KINDS and rec.state == "ready":
                if not _committed(rec.snapshot_dir):
                    self._start_commit(rec.snapshot_id)
        for sandbox in self.store.list_sandboxes():
            if sandbox.state == "paused" and sandbox.pause_mode != "filesystem":
                marker = _upload_state(sandbox.workdir)
                if marker is not None and marker.get("state") != "committed":
                    self._start_upload(sandbox.sandbox_id)

    def _pinned_keys(self) -> set[str]:
        """Node-cache entries that sandboxes of this node use (their disk chains and the
        snapshots they started from): never evicted."""
        used: set[Path] = set()
        for sandbox in self.store.list_sandboxes():
            if sandbox.source_dir is not None:
                used.add(sandbox.source_dir)
                with contextlib.suppress(SnapshotError):
                    source = MachineSnapshot.load(sandbox.source_dir)
                    used.update(source.required_files())
                    used.update(backing_chain(source.disk))
            if sandbox.disk_path is not None:
                used.update(backing_chain(sandbox.disk_path))
        for snap in self.store.list_snapshots():
            if snap.state in ("ready", "pending"):
                used.update(backing_chain(snap.snapshot_dir / "disk.qcow2"))
        pinned = set()
        for key in self.catalog.cache.keys():
            path = self.catalog.cache.peek(key)
            if path is not None and (path in used or any(p.is_relative_to(path) for p in used)):
                pinned.add(key)
        return pinned

    def collect_snapshots(self) -> list[str]:
        """Remove hidden snapshots (deleted ones, fork images) whose files nothing uses:
        no sandbox's disk chain or source, no live snapshot's chain."""
        records = self.store.list_snapshots()
        used: set[Path] = set()
        for sandbox in self.store.list_sandboxes():
            if sandbox.source_dir is not None:
                used.add(sandbox.source_dir)
            if sandbox.disk_path is not None:
                used.update(p.parent for p in backing_chain(sandbox.disk_path))
        for snap in records:
            if snap.state == "ready":
                used.update(p.parent for p in backing_chain(snap.snapshot_dir / "disk.qcow2"))
        removed = []
        for snap in records:
            if snap.state == "deleted" and snap.snapshot_dir not in used:
                shutil.rmtree(snap.snapshot_dir, ignore_errors=True)
                self.store.delete_snapshot(snap.snapshot_id)
                removed.append(snap.snapshot_id)
        if removed:
            log.info("removed unused snapshots %s", ", ".join(removed))
        return removed

    async def fork(
        self, sandbox_id: str, count: int = 1, timeout: int | None = None
    ) -> list[SandboxView | Exception]:
        """Start ``count`` children of a running sandbox, all at once, on this node. They
        share the parent's RAM image (private mappings) and disk (overlays), inherit its
        metadata, environment and security, and get their own id, token, network slot,
        clock and entropy. The parent keeps running. One result per child: its view or
        why it failed."""
        if not 1 <= count <= MAX_FORK_CHILDREN:
            raise InvalidRequest(f"count must be between 1 and {MAX_FORK_CHILDREN}")
        timeout = self.config.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)

        async def capture() -> tuple[SandboxRecord, SnapshotRecord]:
            rec = self._existing(sandbox_id)
            return rec, await self._capture(rec, "fork", None, {})

        parent, image = await self._operations.run(sandbox_id, "fork", capture, join=False)
        try:
            snapshot = MachineSnapshot.load(image.snapshot_dir)
        except SnapshotError as exc:
            raise OperationFailed(f"fork of {sandbox_id}: {exc}") from exc
        source = _Source(parent.template_id, parent.template_build_id, snapshot, image.snapshot_id)
        identity = _Identity(
            metadata=parent.metadata,
            env_vars=parent.env_vars,
            secure=parent.envd_token is not None,
            allow_internet=parent.allow_internet,
            auto_pause=parent.auto_pause,
            auto_resume=parent.auto_resume,
            parent_id=sandbox_id,
        )
        try:
            results = await asyncio.gather(
                *(
                    self._start(source, identity, timeout, private_memory=True)
                    for _ in range(count)
                ),
                return_exceptions=True,
            )
        finally:
            # The image now lives only as long as the children (and the parent's disk)
            # that use it.
            self.store.update_snapshot(image.snapshot_id, state="deleted")
            self.collect_snapshots()
        out: list[SandboxView | Exception] = []
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            out.append(result)
        return out

    # -- changes -------------------------------------------------------------------------
    async def set_timeout(
        self, sandbox_id: str, timeout: int, *, only_extend: bool = False
    ) -> SandboxView:
        """End the sandbox's life ``timeout`` seconds from now; with ``only_extend`` only
        if that is later than its current end (connect and refresh never shorten it)."""
        self._check_timeout(timeout)
        view = self.get(sandbox_id)
        end_at = utcnow() + timedelta(seconds=timeout)
        if only_extend:
            end_at = max(view.record.end_at, end_at)
        self.store.update_sandbox(sandbox_id, end_at=end_at)
        view.record.end_at = end_at
        return view

    async def kill(self, sandbox_id: str) -> None:
        """Remove a sandbox, after any operation in progress on it; joins a kill already
        in progress."""
        await self._operations.run(
            sandbox_id, "kill", lambda: self._kill_locked(sandbox_id), join=True
        )
        self._operations.forget(sandbox_id)

    async def _kill_locked(self, sandbox_id: str) -> None:
        rec = self._existing(sandbox_id)
        phases = _PhaseTimer()
        await self._stop_upload(sandbox_id)
        await self._forget_in_repository(rec)
        self._forget_network(rec)
        self.store.update_sandbox(sandbox_id, state="killing")
        vm = self._vms.pop(sandbox_id, None)
        if vm is not None:
            await vm.kill()
        else:
            await self._kill_leftover_vm(rec.workdir / VM_DIR)
        phases.mark("vm")
        try:
            await self.network.destroy(rec.slot)
        except Exception as exc:
            # The VM is gone; what is left of the namespace is reclaimed at the next
            # start. The sandbox itself must not linger, half-killed.
            log.warning("sandbox %s: network teardown failed: %s", sandbox_id, exc)
        phases.mark("network")
        shutil.rmtree(rec.workdir, ignore_errors=True)
        self.store.delete_sandbox(sandbox_id)
        phases.mark("files")
        self.collect_snapshots()
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
                except (OperationFailed, GuestUnavailable) as exc:
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

    async def _flush_forever(self, interval: float = RAM_FLUSH_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval)
            for sandbox_id, vm in list(self._vms.items()):
                if not vm.spec.memory_shared:
                    continue
                try:
                    await asyncio.to_thread(flush_file, vm.spec.memory_file)
                except OSError as exc:
                    log.debug("flushing RAM of %s failed: %s", sandbox_id, exc)

    async def _reap_forever(self, interval: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap_expired()
                if time.monotonic() - self._handoffs_checked >= HANDOFF_CHECK_INTERVAL_S:
                    self._handoffs_checked = time.monotonic()
                    await self._check_handoffs()
            except Exception:
                log.exception("reaper failed")

    # -- paused sandboxes in the repository ------------------------------------------------
    def _prepare_upload(self, rec: SandboxRecord, files: SnapshotFiles) -> None:
        """Start a paused sandbox's next generation in the repository (uploaded in the
        background)."""
        if self.driver.name != "qemu" or rec.disk_path is None:
            return  # Firecracker's pause files are not published yet
        generation = _generation(rec.workdir) + 1
        _write_atomically(rec.workdir / "generation", str(generation))
        _write_atomically(
            rec.workdir / PAUSED_DIR / UPLOAD_MARKER,
            json.dumps({"state": "uploading", "generation": generation}),
        )

    async def _freeze(self, sandbox_id: str) -> bool:
        """Copy (reflink) what a paused sandbox is made of, under its lock, so that its
        upload reads files a resume cannot change. False if it is no longer paused."""
        async with self._operations.lock(sandbox_id):
            rec = self.store.get_sandbox(sandbox_id)
            if rec is None or rec.state != "paused" or rec.disk_path is None:
                return False
            paused = rec.workdir / PAUSED_DIR
            dest = paused / FROZEN_DIR
            if (dest / "complete").exists():
                return True
            files = SnapshotFiles.from_json((paused / PAUSED_MANIFEST).read_text())
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            await clone_file(rec.disk_path, dest / "disk.qcow2", mode=0o400)
            if files.memory_file is not None:
                await clone_file(files.memory_file, dest / MEMORY_FILE, mode=0o400)
            _write_atomically(dest / "complete", "")
            return True

    def _start_upload(self, sandbox_id: str) -> None:
        task = self._uploads.get(sandbox_id)
        if task is not None and not task.done():
            return
        task = asyncio.get_running_loop().create_task(self._upload_until_done(sandbox_id))
        self._uploads[sandbox_id] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self._uploads.get(sandbox_id) is done:
                del self._uploads[sandbox_id]

        task.add_done_callback(forget)

    async def _stop_upload(self, sandbox_id: str) -> None:
        task = self._uploads.pop(sandbox_id, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _upload_until_done(self, sandbox_id: str) -> None:
        """Commit a paused sandbox to the repository, retrying while it is unreachable:
        it stays paused (and resumable) on this node meanwhile."""
        while True:
            try:
                await self._upload_paused(sandbox_id)
                return
            except (RepositoryUnavailable, NodeCacheFull, OSError, SnapshotError) as exc:
                log.warning(
                    "uploading paused %s failed (%s); retrying in %.0fs",
                    sandbox_id,
                    exc,
                    COMMIT_RETRY_S,
                )
                await asyncio.sleep(COMMIT_RETRY_S)

    async def _upload_paused(self, sandbox_id: str) -> None:
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state != "paused" or rec.pause_mode == "filesystem":
            return
        marker = _upload_state(rec.workdir)
        if marker is None or marker.get("state") == "committed":
            return
        started = time.perf_counter()
        if not await self._freeze(sandbox_id):
            return
        generation = int(marker["generation"])
        paused = rec.workdir / PAUSED_DIR
        files = SnapshotFiles.from_json((paused / PAUSED_MANIFEST).read_text())
        frozen = paused / FROZEN_DIR
        source = replace(self._source_snapshot(rec), files=files)
        published = await self.catalog.publish(
            source,
            state_file=files.state_file,
            memory_file=frozen / MEMORY_FILE if files.memory_file is not None else None,
            disk=frozen / "disk.qcow2",
        )
        holder = await self.catalog.holder(sandbox_id, generation)
        if holder not in (None, self.catalog.node):
            return  # taken meanwhile by a node that had an earlier upload of it
        record: dict[str, object] = {
            "sandbox_id": sandbox_id,
            "generation": generation,
            "node": self.catalog.node,
            "template_id": rec.template_id,
            "template_build_id": rec.template_build_id,
            "snapshot_id": rec.snapshot_id,
            "parent_id": rec.parent_id,
            "metadata": rec.metadata,
            "env_vars": rec.env_vars,
            "envd_token": rec.envd_token,
            "auto_pause": rec.auto_pause,
            "auto_resume": rec.auto_resume,
            "allow_internet": rec.allow_internet,
            "envd_version": rec.envd_version,
            "started_at": rec.started_at.isoformat(),
            "end_at": rec.end_at.isoformat(),
            "paused_at": utcnow().isoformat(),
            "manifest": published.manifest,
            "blobs": published.blobs,
        }
        await self.catalog.put_paused(sandbox_id, record)
        _write_atomically(
            paused / UPLOAD_MARKER, json.dumps({"state": "committed", "generation": generation})
        )
        shutil.rmtree(frozen, ignore_errors=True)
        log.info(
            "paused sandbox %s (generation %d) committed to %s in %.0f ms",
            sandbox_id,
            generation,
            self.catalog.url,
            (time.perf_counter() - started) * 1000,
        )

    def pause_committed(self, rec: SandboxRecord) -> bool:
        marker = _upload_state(rec.workdir)
        return marker is not None and marker.get("state") == "committed"

    async def adopt(self, sandbox_id: str, timeout: int | None = None) -> SandboxView:
        """Resume, on this node, a sandbox paused on another node that shares the
        repository. Raises :class:`SandboxNotFound` if the repository has no such paused
        sandbox and :class:`Conflict` if another node resumed it first."""
        timeout = self.config.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)

        async def work() -> None:
            if self.store.get_sandbox(sandbox_id) is not None:
                return  # adopted by a concurrent call
            record = await self.catalog.get_paused(sandbox_id)
            if record is None:
                raise SandboxNotFound(sandbox_id)
            generation = int(record["generation"])
            if not await self.catalog.claim(sandbox_id, generation):
                holder = await self.catalog.holder(sandbox_id, generation)
                raise Conflict(f"sandbox {sandbox_id} was resumed on node {holder}")
            await self._adopt_record(record)

        await self._operations.run(sandbox_id, "adopt", work, join=True)
        return await self.resume(sandbox_id, timeout)

    async def _adopt_record(self, record: dict[str, Any]) -> None:
        sandbox_id = record["sandbox_id"]
        workdir = self.config.sandboxes_dir / sandbox_id
        phases = _PhaseTimer()
        slot = self._reserve_slot()
        try:
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            snap = await self.catalog.materialise_paused(
                record,
                workdir / "source",
                lambda line: log.info("adopting %s: %s", sandbox_id, line),
            )
            phases.mark("fetch")
            (workdir / PAUSED_DIR).mkdir()
            _write_atomically(workdir / PAUSED_DIR / PAUSED_MANIFEST, snap.files.to_json())
            _write_atomically(workdir / "generation", str(record["generation"]))
            _write_atomically(
                workdir / PAUSED_DIR / UPLOAD_MARKER,
                json.dumps({"state": "committed", "generation": record["generation"]}),
            )
            # The sandbox writes its disk under a name of its own: a later snapshot seals
            # that name away, while the adopted machine's description keeps its link.
            disk = _next_top(workdir)
            os.link(snap.disk, disk)
            disk.chmod(0o600)
            if snap.files.memory_file is not None:
                snap.files.memory_file.chmod(0o600)
            rec = SandboxRecord(
                sandbox_id=sandbox_id,
                template_id=record["template_id"],
                template_build_id=record["template_build_id"],
                state="paused",
                slot=slot,
                workdir=workdir,
                started_at=datetime.fromisoformat(record["started_at"]),
                end_at=datetime.fromisoformat(record["end_at"]),
                vcpus=snap.vcpus,
                memory_mib=snap.memory_mib,
                disk_size_mib=snap.disk_size_mib,
                envd_version=record["envd_version"],
                envd_token=record.get("envd_token"),
                metadata=dict(record.get("metadata") or {}),
                env_vars=dict(record.get("env_vars") or {}),
                auto_pause=bool(record.get("auto_pause")),
                allow_internet=bool(record.get("allow_internet")),
                memory_mode="shared" if snap.files.memory_file is not None else "private",
                disk_path=disk,
                source_dir=snap.directory,
                parent_id=record.get("parent_id"),
                snapshot_id=record.get("snapshot_id"),
                auto_resume=bool(record.get("auto_resume")),
                pause_mode="full",
            )
            self.store.insert_sandbox(rec)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            self._release_slot(slot)
        log.info("sandbox %s adopted from node %s in %s", sandbox_id, record.get("node"), phases)

    async def _check_handoffs(self) -> None:
        """Drop paused sandboxes that another node has resumed since."""
        for rec in self.store.list_sandboxes():
            if rec.state != "paused":
                continue
            marker = _upload_state(rec.workdir)
            if marker is None or marker.get("state") != "committed":
                continue
            try:
                holder = await self.catalog.holder(rec.sandbox_id, int(marker["generation"]))
            except RepositoryUnavailable:
                return
            if holder in (None, self.catalog.node):
                continue
            async with self._operations.lock(rec.sandbox_id):
                current = self.store.get_sandbox(rec.sandbox_id)
                if current is None or current.state != "paused":
                    continue
                self._forget_network(current)
                await self._discard(current)
            log.info("sandbox %s was resumed on node %s; dropped here", rec.sandbox_id, holder)

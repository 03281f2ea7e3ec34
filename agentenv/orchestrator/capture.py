"""Capturing running sandboxes into snapshots (persistent snapshots, templates and the
frozen images forks start from), flattening deep disk chains, and resharing RAM files.

Owns snapshot directories while they are being written, the set of chains being
flattened and the resharing thread. A capture moves its sandbox ``running ->
snapshotting|forking -> running`` through the store; it runs under the sandbox's
operation lock, which its caller holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import shutil
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

from agentenv.orchestrator.errors import Conflict, OperationFailed
from agentenv.orchestrator.layout import SandboxDir, SnapshotDir
from agentenv.orchestrator.machines import Machines
from agentenv.orchestrator.resources import FilePins
from agentenv.orchestrator.sources import Sources
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxRecord, SnapshotRecord, Store, utcnow
from agentenv.orchestrator.supervisor import Supervisor
from agentenv.orchestrator.timing import PhaseTimer
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError, write_manifest
from agentenv.storage.clone import clone_file, flush_file, make_durable
from agentenv.storage.extents import reshare
from agentenv.storage.images import backing_chain, flatten
from agentenv.vmm.base import DiskCapture, VMMError

log = logging.getLogger("agentenv.orchestrator")

MIB = 1024 * 1024
#: Seconds after a pause or snapshot before its RAM file is reshared.
RESHARE_AFTER_S = 5.0
# Longest chain of qcow2 images a snapshot's disk may have before it is flattened onto
# its template's image. Every read of a cluster a layer does not hold walks down the
# chain (one lookup per layer, each layer with its own L2 cache in QEMU), so reads slow
# and per-VM memory grows with depth; flattening copies what the skipped layers hold, so
# doing it every few snapshots keeps that cost amortised. Eight keeps lookups cheap while
# flattening at most once per seven snapshots of a sandbox.
MAX_DISK_CHAIN = 8


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


class Resharing:
    """Gives back, in the background, the blocks RAM files needlessly unshared from
    their source's (see :mod:`agentenv.storage.extents`)."""

    def __init__(self, sources: Sources, supervisor: Supervisor) -> None:
        self.sources = sources
        self.supervisor = supervisor
        self.enabled = False  # set at startup: the data directory can reflink
        # One thread. Not niced: it takes the GIL, and a starved holder would stall the
        # event loop.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aenv-reshare")
        # A paused sandbox's resharing of its RAM file, to stop before a VM maps it again.
        self._paused: dict[str, _ReshareJob] = {}

    def later(
        self, rec: SandboxRecord, memory: Path | None, what: str, *, paused: str | None = None
    ) -> None:
        """In the background, make the RAM file ``memory`` (a paused sandbox's or a
        snapshot's) share again the blocks it holds unchanged from the RAM file of the
        sandbox's source: those the guest rewrote with the same bytes, above all the pages
        it zeroed that were zero already.

        Only for sandboxes whose RAM is a file of their own: their RAM files are mapped
        shared by their own VM or cloned, never mapped privately by others (fork images
        and private-memory machines are left alone). A paused sandbox's (``paused``: its
        id) is stopped by :meth:`stop` before its VM maps the file again."""
        if not self.enabled or memory is None or rec.memory_mode != "shared":
            return
        try:
            like = self.sources.of_sandbox(rec).files.memory_file
        except OperationFailed:
            return
        if like is None:
            return

        job = _ReshareJob(memory, like)

        async def run() -> None:
            loop = asyncio.get_running_loop()
            try:
                # Not at once: a sandbox paused and resumed within seconds (a connect
                # right after a pause) would wait for the dedupe call in progress, and
                # the comparison's Python holds the GIL the event loop needs.
                await asyncio.sleep(RESHARE_AFTER_S)
                if job.stop.is_set():
                    return
                if os.path.samefile(memory, like):
                    return
                shared = await loop.run_in_executor(self._thread, job.run)
            except (FileNotFoundError, RuntimeError):
                return  # gone meanwhile (killed, deleted), or the server is shutting down
            except OSError as exc:
                log.warning("%s: resharing its RAM file failed: %s", what, exc)
                return
            finally:
                if paused is not None and self._paused.get(paused) is job:
                    del self._paused[paused]
            stopped = " (stopped early)" if job.stop.is_set() else ""
            log.info(
                "%s: RAM file shares %.1f MiB more with its source%s", what, shared / MIB, stopped
            )

        job.task = self.supervisor.spawn(run())
        if paused is not None:
            self._paused[paused] = job

    async def stop(self, sandbox_id: str) -> None:
        """Stop resharing the paused sandbox's RAM file, waiting for a resharing that has
        started (one dedupe call at most): a VM must never map a file being reshared. One
        still queued behind others is not waited for; it will not touch the file."""
        job = self._paused.get(sandbox_id)
        if job is not None and job.cancel() and job.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(job.task)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class Capture:
    def __init__(
        self,
        snapshots_dir: Path,
        store: Store,
        machines: Machines,
        sources: Sources,
        pins: FilePins,
        resharing: Resharing,
        supervisor: Supervisor,
    ) -> None:
        self.snapshots_dir = snapshots_dir
        self.store = store
        self.machines = machines
        self.sources = sources
        self.pins = pins
        self.resharing = resharing
        self.supervisor = supervisor
        # Snapshot directories whose disk chain is being flattened.
        self._flattening: set[Path] = set()

    async def capture(
        self,
        rec: SandboxRecord,
        kind: str,
        name: str | None,
        metadata: dict[str, str],
        snapshot_id: str,
    ) -> SnapshotRecord:
        """Freeze a running sandbox into a new snapshot directory: device state, RAM
        (a reflink of its RAM file, sharing unchanged extents, or the RAM image the save
        wrote there) and its disk as the driver captures it (:class:`DiskCapture`): the
        current qcow2 top sealed in place while new writes go to a fresh top, or the raw
        disk copied. The VM is stopped only for that; it runs on afterwards whatever
        happens."""
        vm = self.machines.running_vm(rec)
        how = self.machines.driver.disk_capture
        if how is DiskCapture.NONE:
            raise OperationFailed(
                f"snapshots and forks need a VMM that can capture a running disk; "
                f"{self.machines.driver.name} cannot"
            )
        phases = PhaseTimer()
        source = self.sources.of_sandbox(rec)
        directory = self.snapshots_dir / snapshot_id
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
        state = SandboxState.FORKING if kind == "fork" else SandboxState.SNAPSHOTTING
        self.store.transition(rec.sandbox_id, SandboxState.RUNNING, state)
        shared = rec.memory_mode == "shared"
        sealed = False
        own_memory_image: Path | None = None
        snap_dir = SnapshotDir(directory)
        try:
            if shared:
                # Write back most of the dirty RAM while the guest still runs: the
                # reflink below must write back what is dirty, with the guest stopped.
                await asyncio.to_thread(flush_file, vm.spec.memory_file)
                phases.mark("flush")
            files = await vm.save_state(directory)
            phases.mark("save")
            root = next(d for d in vm.spec.drives if d.drive_id == "root")
            if how is DiskCapture.SEAL:
                disk, disk_fmt = snap_dir.disk_file("qcow2"), "qcow2"
                new_top = SandboxDir(rec.workdir).next_top()
                await vm.seal_drive("root", disk, new_top)
                sealed = True
                self.store.update_sandbox(
                    rec.sandbox_id, disk_path=new_top, snapshot_id=snapshot_id
                )
                rec.disk_path, rec.snapshot_id = new_top, snapshot_id
                root.path.unlink(missing_ok=True)
                phases.mark("seal")
            else:
                # A copy of the file the machine goes on writing: nothing of the sandbox
                # depends on the snapshot (a failure below can remove it whole).
                disk, disk_fmt = snap_dir.disk_file(root.fmt), root.fmt
                await clone_file(root.path, disk, mode=0o400)
                phases.mark("disk")
            if files.memory_file is not None and files.memory_file.parent != directory:
                # The VM's own RAM file (it maps it shared): cloned before it runs on.
                # A RAM image the save wrote into the directory is the snapshot's already.
                memory = snap_dir.memory_file
                await clone_file(files.memory_file, memory, mode=0o400)
                files = replace(files, memory_file=memory)
                phases.mark("memory")
                own_memory_image = memory
        except Exception as exc:
            with contextlib.suppress(VMMError):
                await vm.resume_if_paused()
            self.store.transition(rec.sandbox_id, state, SandboxState.RUNNING)
            if sealed:
                # The sandbox's disk builds on the sealed layer: collected with it.
                self.store.update_snapshot(snapshot_id, state="deleted")
            else:
                self.store.delete_snapshot(snapshot_id)
                shutil.rmtree(directory, ignore_errors=True)
            raise OperationFailed(f"snapshot of sandbox {rec.sandbox_id} failed: {exc}") from exc
        if not sealed:
            self.store.update_sandbox(rec.sandbox_id, snapshot_id=snapshot_id)
            rec.snapshot_id = snapshot_id
        try:
            await vm.resume()
        except VMMError as exc:
            # The capture is complete but the caller is told it failed: it goes unused.
            self.store.update_snapshot(snapshot_id, state="deleted")
            raise OperationFailed(
                f"snapshot of sandbox {rec.sandbox_id}: its VM did not resume: {exc}"
            ) from exc
        finally:
            self.store.transition(rec.sandbox_id, state, SandboxState.RUNNING)
        phases.mark("resume")
        if own_memory_image is not None:
            # What the machine holds in memory is what the fork children and the
            # snapshot's sandboxes will touch first: recorded for them to read ahead.
            await self.machines.record_working_set(rec.sandbox_id, vm, own_memory_image)
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
                    disk_format=disk_fmt,
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
        self.supervisor.spawn(_make_durable(durable))
        if kind != "fork":
            # A fork image is short-lived and its children are starting from it now.
            self.resharing.later(rec, files.memory_file, f"snapshot {snapshot_id}")
        if depth > MAX_DISK_CHAIN and not any(p.parent in self._flattening for p in chain):
            self.supervisor.spawn(self._flatten(directory))
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
            self.pins.collect_snapshots()
        except Exception as exc:
            if not directory.exists():
                # Deleted (and collected) meanwhile: nothing is left to flatten.
                log.info("snapshot %s was deleted while being flattened", directory.name)
                return
            # The deep chain still works; the next snapshot tries again.
            log.warning("flattening the disk of snapshot %s failed: %s", directory.name, exc)
        finally:
            self._flattening.discard(directory)


async def _make_durable(paths: list[Path]) -> None:
    try:
        await asyncio.to_thread(make_durable, *paths)
    except OSError as exc:  # deleted meanwhile, or a failing disk
        log.warning("writing snapshot files to stable storage failed: %s", exc)

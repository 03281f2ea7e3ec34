"""This node and the snapshot repository it shares with others: committing snapshots
and templates, uploading paused sandboxes, adopting sandboxes paused elsewhere, dropping
those another node took over, and the snapshot queries that merge what the repository
holds with what this node has not committed yet.

Owns the commit and upload jobs (through the supervisor) and the markers that say how
far they got (:mod:`.layout`). Records crossing the repository are the typed ones of
:mod:`.records`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from agentenv.network.policy import EgressPolicy
from agentenv.orchestrator.catalog import Catalog
from agentenv.orchestrator.errors import (
    Conflict,
    NodeCacheFull,
    OperationFailed,
    OutOfSpace,
    RepositoryUnavailable,
    SandboxNotFound,
    SnapshotNotFound,
)
from agentenv.orchestrator.layout import (
    SandboxDir,
    SnapshotDir,
    UploadState,
    write_atomically,
)
from agentenv.orchestrator.machines import Machines
from agentenv.orchestrator.modes import Mode
from agentenv.orchestrator.network_options import NetworkOptions
from agentenv.orchestrator.operations import SandboxOperations
from agentenv.orchestrator.records import PausedEntry, PendingPause, SnapshotEntry
from agentenv.orchestrator.resources import FilePins, NetworkLeases, Slots
from agentenv.orchestrator.sources import SHAREABLE_KINDS, Sources
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxRecord, Store, utcnow
from agentenv.orchestrator.supervisor import Supervisor
from agentenv.orchestrator.timing import PhaseTimer
from agentenv.orchestrator.tokens import TokenKeyMismatch, token_digest
from agentenv.orchestrator.views import SnapshotView
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError
from agentenv.storage.clone import clone_file
from agentenv.vmm.base import SnapshotFiles

log = logging.getLogger("agentenv.orchestrator")

COMMIT_RETRY_S = 10.0
_COMMIT = "commit"
_UPLOAD = "upload"


class RepositorySync:
    def __init__(
        self,
        sandboxes_dir: Path,
        store: Store,
        catalog: Catalog,
        sources: Sources,
        pins: FilePins,
        slots: Slots,
        leases: NetworkLeases,
        machines: Machines,
        operations: SandboxOperations,
        supervisor: Supervisor,
        *,
        publishes_paused_state: bool,
        mode: Mode,
        commit_wait: float = 50.0,
    ) -> None:
        self.sandboxes_dir = sandboxes_dir
        self.mode = mode
        self.store = store
        self.catalog = catalog
        self.sources = sources
        self.pins = pins
        self.slots = slots
        self.leases = leases
        self.machines = machines
        self.operations = operations
        self.supervisor = supervisor
        self.publishes_paused_state = publishes_paused_state
        self.commit_wait = commit_wait
        # Commits and uploads given up for want of space, by snapshot or sandbox id: which
        # job and why. Their files stay on this node (usable here); they are tried again
        # after the next commit or upload that succeeds, and at the next start.
        self._stopped: dict[str, _Stopped] = {}

    def resume_unfinished(self) -> None:
        """Commits and uploads a previous run left unfinished start again."""
        for rec in self.store.list_snapshots():
            if rec.kind in SHAREABLE_KINDS and rec.state == "ready":
                if not SnapshotDir(rec.snapshot_dir).committed():
                    self.start_commit(rec.snapshot_id)
        for sandbox in self.store.list_sandboxes():
            if sandbox.state == SandboxState.PAUSED and sandbox.pause_mode != "filesystem":
                upload = SandboxDir(sandbox.workdir).upload_state()
                if upload is not None and not upload.committed:
                    self.start_upload(sandbox.sandbox_id)

    def stopped_commits(self) -> str | None:
        """What was not committed for want of space (for ``/health``), if anything."""
        if not self._stopped:
            return None
        ids = sorted(self._stopped)
        shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        return (
            f"{len(ids)} commit(s) to the repository stopped for want of space ({shown}), "
            "kept on this node and tried again once a commit succeeds or at the next start; "
            f"last: {self._stopped[ids[-1]].reason}"
        )

    def _stop_for_space(self, job: str, key: str, reason: str) -> None:
        """Give up a commit or upload that found no space: retrying every few seconds
        would only fill the log (and whatever space is freed) until someone makes room."""
        self._stopped[key] = _Stopped(job, reason)
        log.error(
            "%s %s stopped for want of space: %s; it stays on this node only and is tried "
            "again once a commit succeeds, or at the server's next start",
            "committing" if job == _COMMIT else "uploading paused",
            key,
            reason,
        )

    def _retry_stopped(self) -> None:
        """A commit or upload went through, so the repository may have room again: those
        stopped for want of space try once more (each stops again at its first ENOSPC)."""
        for key, stopped in list(self._stopped.items()):
            if stopped.job == _COMMIT:
                self.start_commit(key)
            else:
                self.start_upload(key)

    # -- snapshots and templates -------------------------------------------------------
    def start_commit(self, snapshot_id: str) -> None:
        self.supervisor.start_job(
            _COMMIT, snapshot_id, lambda: self._commit_until_done(snapshot_id)
        )

    async def _commit_until_done(self, snapshot_id: str) -> None:
        """Commit a local snapshot, retrying while the repository is unreachable: it
        stays usable on this node meanwhile, and nothing is lost. Not while there is no
        space for it: that stops (and is reported) until a commit succeeds."""
        self._stopped.pop(snapshot_id, None)
        while True:
            try:
                await self.commit(snapshot_id)
                self._retry_stopped()
                return
            except OutOfSpace as exc:
                self._stop_for_space(_COMMIT, snapshot_id, str(exc))
                return
            except Conflict as exc:
                # Another node committed one under the same name meanwhile: this one
                # is committed without it rather than retried forever.
                log.error("%s loses its name: %s", snapshot_id, exc)
                self.store.update_snapshot(snapshot_id, name=None)
            except (RepositoryUnavailable, NodeCacheFull, OSError, SnapshotError) as exc:
                if _no_space(exc):
                    self._stop_for_space(_COMMIT, snapshot_id, str(exc))
                    return
                log.warning(
                    "committing %s failed (%s); retrying in %.0fs", snapshot_id, exc, COMMIT_RETRY_S
                )
                await asyncio.sleep(COMMIT_RETRY_S)

    async def commit(self, snapshot_id: str) -> None:
        """Push a local snapshot's blobs, then its record: committed everywhere."""
        rec = self.store.get_snapshot(snapshot_id)
        if rec is None or rec.state != "ready" or SnapshotDir(rec.snapshot_dir).committed():
            return
        started = time.perf_counter()
        log.info("committing %s %s to %s", rec.kind, snapshot_id, self.catalog.url)
        snap = MachineSnapshot.load(rec.snapshot_dir)
        async with self.catalog.commit_lease():
            published = await self.catalog.publish(snap)
            entry = SnapshotEntry(
                id=rec.snapshot_id,
                type=rec.kind,
                names=[rec.name] if rec.name else [],
                sandbox_id=rec.sandbox_id,
                template_id=rec.template_id,
                parent_id=rec.parent_id,
                metadata=rec.metadata,
                created_at=rec.created_at,
                node=self.catalog.node,
                vcpus=snap.vcpus,
                memory_mib=snap.memory_mib,
                disk_size_mib=snap.disk_size_mib,
                envd_version=snap.envd_version,
                manifest=published.manifest,
                blobs=published.blobs,
            )
            await self.catalog.commit(entry, replace_names=rec.kind == "template")
        SnapshotDir(rec.snapshot_dir).mark_committed()
        log.info(
            "%s %s committed to %s in %.0f ms",
            rec.kind,
            snapshot_id,
            self.catalog.url,
            (time.perf_counter() - started) * 1000,
        )

    async def get_snapshot(self, key: str, type_: str = "snapshot") -> SnapshotView:
        local = self.store.get_snapshot(key)
        if local is not None and (local.kind != type_ or local.state != "ready"):
            local = None
        if local is not None and not SnapshotDir(local.snapshot_dir).committed():
            return SnapshotView(local)
        try:
            entry = await self.catalog.lookup(key)
        except RepositoryUnavailable:
            if local is None:
                raise
            return SnapshotView(local)
        if entry is None or entry.type != type_:
            raise SnapshotNotFound(key)
        return SnapshotView.of_entry(entry)

    async def list_snapshots(
        self, sandbox_id: str | None = None, type_: str = "snapshot"
    ) -> list[SnapshotView]:
        """Committed snapshots (every node's), plus this node's still being committed."""
        views: dict[str, SnapshotView] = {}
        repository_ok = True
        try:
            for entry in await self.catalog.list_records(type_):
                views[entry.id] = SnapshotView.of_entry(entry)
        except RepositoryUnavailable as exc:
            log.warning("listing snapshots from this node only: %s", exc)
            repository_ok = False
        for rec in self.store.list_snapshots():
            if rec.kind != type_ or rec.state != "ready" or rec.snapshot_id in views:
                continue
            if repository_ok and SnapshotDir(rec.snapshot_dir).committed():
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
            await self.supervisor.cancel_job(_COMMIT, local.snapshot_id)
            self._stopped.pop(local.snapshot_id, None)
        entry = await self.catalog.lookup(key)
        if entry is not None and entry.type != type_:
            entry = None
        if entry is None and local is None:
            raise SnapshotNotFound(key)
        if entry is not None:
            await self.catalog.delete(entry)
        local = local or self.store.get_snapshot(entry.id if entry else key)
        if local is not None and local.state == "ready":
            self.store.update_snapshot(local.snapshot_id, state="deleted", name=None)
            self.pins.collect_snapshots()

    # -- paused sandboxes --------------------------------------------------------------
    def prepare_upload(self, rec: SandboxRecord) -> None:
        """Start a paused sandbox's next generation in the repository (uploaded in the
        background by :meth:`start_upload`). Not one with volumes mounted: their images
        stay on this node (see :mod:`.volumes`), so it resumes here only."""
        if not self.publishes_paused_state or rec.disk_path is None or rec.volumes:
            return
        directory = SandboxDir(rec.workdir)
        generation = directory.generation() + 1
        directory.set_generation(generation)
        directory.set_upload_state(UploadState("uploading", generation))

    def next_generation(self, rec: SandboxRecord) -> int | None:
        """The generation a pause of ``rec`` starting now will commit; None when this
        node publishes no paused state (nothing to announce)."""
        if not self.publishes_paused_state or rec.disk_path is None:
            return None
        return SandboxDir(rec.workdir).generation() + 1

    async def announce_pause(self, sandbox_id: str, generation: int) -> None:
        """Tell the repository this node is pausing ``sandbox_id`` and will commit
        ``generation`` of it, so another node asked to connect it waits for that commit
        (:meth:`Catalog.committed_pause`). Written while the pause saves the machine, awaited
        before it answers; a repository that cannot be reached is logged, and the pause
        stands (another node then answers 404 until the commit lands, as before)."""
        pending = PendingPause(
            sandbox_id=sandbox_id,
            generation=generation,
            node=self.catalog.node,
            paused_at=utcnow(),
        )
        try:
            await self.catalog.put_pending(pending)
        except RepositoryUnavailable as exc:
            log.warning("sandbox %s: announcing its pause failed: %s", sandbox_id, exc)

    async def drop_announcement(self, sandbox_id: str) -> None:
        """Other nodes stop waiting for a commit of ``sandbox_id``: the pause failed, or
        it was resumed or killed here before its commit."""
        try:
            await self.catalog.drop_pending(sandbox_id)
        except RepositoryUnavailable as exc:
            log.warning("sandbox %s: withdrawing its pause failed: %s", sandbox_id, exc)

    async def withdraw_pause(self, rec: SandboxRecord) -> None:
        """The pause announced for ``rec`` will not be committed (resumed here first)."""
        upload = SandboxDir(rec.workdir).upload_state()
        if upload is not None and not upload.committed:
            await self.drop_announcement(rec.sandbox_id)

    def start_upload(self, sandbox_id: str) -> None:
        self.supervisor.start_job(_UPLOAD, sandbox_id, lambda: self._upload_until_done(sandbox_id))

    async def stop_upload(self, sandbox_id: str) -> None:
        await self.supervisor.cancel_job(_UPLOAD, sandbox_id)
        self._stopped.pop(sandbox_id, None)

    def pause_committed(self, rec: SandboxRecord) -> bool:
        upload = SandboxDir(rec.workdir).upload_state()
        return upload is not None and upload.committed

    async def _upload_until_done(self, sandbox_id: str) -> None:
        """Commit a paused sandbox to the repository, retrying while it is unreachable:
        it stays paused (and resumable) on this node meanwhile. Not while there is no
        space for it: that stops (and is reported) until a commit succeeds."""
        self._stopped.pop(sandbox_id, None)
        while True:
            try:
                await self._upload(sandbox_id)
                self._retry_stopped()
                return
            except OutOfSpace as exc:
                self._stop_for_space(_UPLOAD, sandbox_id, str(exc))
                return
            except (RepositoryUnavailable, NodeCacheFull, OSError, SnapshotError) as exc:
                if _no_space(exc):
                    self._stop_for_space(_UPLOAD, sandbox_id, str(exc))
                    return
                log.warning(
                    "uploading paused %s failed (%s); retrying in %.0fs",
                    sandbox_id,
                    exc,
                    COMMIT_RETRY_S,
                )
                await asyncio.sleep(COMMIT_RETRY_S)

    async def _freeze(self, sandbox_id: str) -> bool:
        """Copy (reflink) what a paused sandbox is made of, under its lock, so that its
        upload reads files a resume cannot change. False if it is no longer paused."""
        async with self.operations.lock(sandbox_id):
            rec = self.store.get_sandbox(sandbox_id)
            if rec is None or rec.state != SandboxState.PAUSED or rec.disk_path is None:
                return False
            directory = SandboxDir(rec.workdir)
            if directory.frozen_complete():
                return True
            files = SnapshotFiles.from_json(directory.paused_manifest.read_text())
            shutil.rmtree(directory.frozen, ignore_errors=True)
            directory.frozen.mkdir()
            await clone_file(rec.disk_path, directory.frozen_disk, mode=0o400)
            if files.memory_file is not None:
                await clone_file(files.memory_file, directory.frozen_memory, mode=0o400)
            directory.mark_frozen_complete()
            return True

    async def _upload(self, sandbox_id: str) -> None:
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state != SandboxState.PAUSED or rec.pause_mode == "filesystem":
            return
        directory = SandboxDir(rec.workdir)
        upload = directory.upload_state()
        if upload is None or upload.committed:
            return
        started = time.perf_counter()
        if not await self._freeze(sandbox_id):
            return
        generation = upload.generation
        files = SnapshotFiles.from_json(directory.paused_manifest.read_text())
        source = replace(self.sources.of_sandbox(rec), files=files)
        async with self.catalog.commit_lease():
            published = await self.catalog.publish(
                source,
                state_file=files.state_file,
                memory_file=directory.frozen_memory if files.memory_file is not None else None,
                disk=directory.frozen_disk,
            )
            holder = await self.catalog.holder(sandbox_id, generation)
            if holder not in (None, self.catalog.node):
                return  # taken meanwhile by a node that had an earlier upload of it
            entry = PausedEntry(
                sandbox_id=sandbox_id,
                generation=generation,
                node=self.catalog.node,
                template_id=rec.template_id,
                template_build_id=rec.template_build_id,
                snapshot_id=rec.snapshot_id,
                parent_id=rec.parent_id,
                metadata=rec.metadata,
                env_vars=rec.env_vars,
                # Only a token from before tokens were derived travels as it is: the node
                # that resumes it could not compute it.
                envd_token=(
                    None
                    if rec.envd_token is None
                    or self.store.tokens.is_derived(sandbox_id, rec.envd_token)
                    else rec.envd_token
                ),
                envd_token_sha256=token_digest(rec.envd_token) if rec.envd_token else None,
                auto_pause=rec.auto_pause,
                auto_resume=rec.auto_resume,
                allow_internet=rec.network.egress.allow_internet,
                network=rec.network.to_dict(),
                traffic_token_sha256=token_digest(rec.traffic_token) if rec.traffic_token else None,
                envd_version=rec.envd_version,
                started_at=rec.started_at,
                end_at=rec.end_at,
                paused_at=utcnow(),
                manifest=published.manifest,
                blobs=published.blobs,
            )
            await self.catalog.put_paused(entry)
        directory.set_upload_state(UploadState("committed", generation))
        try:
            await self.catalog.drop_pending(sandbox_id)
        except RepositoryUnavailable as exc:
            # Harmless: a pause record of this generation makes the announcement stale.
            log.warning("sandbox %s: removing its pause announcement failed: %s", sandbox_id, exc)
        shutil.rmtree(directory.frozen, ignore_errors=True)
        log.info(
            "paused sandbox %s (generation %d) committed to %s in %.0f ms",
            sandbox_id,
            generation,
            self.catalog.url,
            (time.perf_counter() - started) * 1000,
        )

    async def claim_for_resume(self, sandbox_id: str, generation: int) -> str | None:
        """Before generation ``generation`` of a committed paused sandbox resumes here:
        claim it, since another node may have resumed it. None if this node holds it,
        else who does."""
        if await self.catalog.claim(sandbox_id, generation):
            return None
        return await self.catalog.holder(sandbox_id, generation) or "unknown"

    async def forget(self, rec: SandboxRecord) -> None:
        """A killed sandbox that was ever committed paused must not be resumable from
        the repository; unless another node holds it now."""
        directory = SandboxDir(rec.workdir)
        generation = directory.generation()
        if generation == 0:
            return
        try:
            upload = directory.upload_state()
            if rec.state == SandboxState.PAUSED and upload is not None and upload.committed:
                if not await self.catalog.claim(rec.sandbox_id, generation):
                    return
            await self.catalog.drop_paused(rec.sandbox_id)
            await self.catalog.drop_pending(rec.sandbox_id)
        except RepositoryUnavailable as exc:
            log.warning(
                "sandbox %s: removing it from the repository failed: %s", rec.sandbox_id, exc
            )

    async def adopt(self, sandbox_id: str) -> None:
        """Record here, paused, a sandbox paused on another node: fetch what it is made
        of and claim its generation. :class:`SandboxNotFound` if the repository has no
        such paused sandbox, :class:`Conflict` if another node resumed it first,
        :class:`ModeMismatch` if it was paused under another mode than this node's (then
        it is left unclaimed, for a node of its mode)."""
        if self.store.get_sandbox(sandbox_id) is not None:
            return  # adopted by a concurrent call
        entry = await self.catalog.committed_pause(sandbox_id, self.commit_wait)
        if entry is None:
            raise SandboxNotFound(sandbox_id)
        self.mode.require(
            f"sandbox {sandbox_id} (paused on node {entry.node or 'unknown'})",
            Mode.of_manifest(entry.manifest),
        )
        self._adopted_token(entry)  # before the claim: a node that cannot serve it leaves it
        if not await self.catalog.claim(sandbox_id, entry.generation):
            holder = await self.catalog.holder(sandbox_id, entry.generation)
            raise Conflict(f"sandbox {sandbox_id} was resumed on node {holder}")
        await self._record_adopted(entry)

    def _adopted_token(self, entry: PausedEntry) -> str | None:
        """The envd token of a sandbox paused by another node: carried as it is (a token
        from before tokens were derived), else derived here and checked against the
        digest the record carries. :class:`OperationFailed` if this node's key does
        not reproduce it."""
        if entry.envd_token is not None or entry.envd_token_sha256 is None:
            return entry.envd_token
        try:
            return self.store.tokens.restored(entry.sandbox_id, entry.envd_token_sha256)
        except TokenKeyMismatch as exc:
            raise OperationFailed(f"cannot resume it on node {self.catalog.node}: {exc}") from None

    def _adopted_traffic_token(self, entry: PausedEntry) -> str | None:
        """The traffic token of a sandbox paused by another node, derived here and
        checked against the digest its record carries."""
        try:
            return self.store.tokens.restored_traffic(entry.sandbox_id, entry.traffic_token_sha256)
        except TokenKeyMismatch as exc:
            raise OperationFailed(f"cannot resume it on node {self.catalog.node}: {exc}") from None

    async def _record_adopted(self, entry: PausedEntry) -> None:
        sandbox_id = entry.sandbox_id
        workdir = self.sandboxes_dir / sandbox_id
        directory = SandboxDir(workdir)
        phases = PhaseTimer()
        slot = self.slots.reserve()
        try:
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            snap = await self.catalog.materialise_paused(
                entry,
                workdir / "source",
                lambda line: log.info("adopting %s: %s", sandbox_id, line),
            )
            phases.mark("fetch")
            directory.paused.mkdir()
            write_atomically(directory.paused_manifest, snap.files.to_json())
            directory.set_generation(entry.generation)
            directory.set_upload_state(UploadState("committed", entry.generation))
            # The sandbox writes its disk under a name of its own: a later snapshot seals
            # that name away, while the adopted machine's description keeps its link.
            disk = directory.next_top()
            os.link(snap.disk, disk)
            disk.chmod(0o600)
            if snap.files.memory_file is not None:
                snap.files.memory_file.chmod(0o600)
            rec = SandboxRecord(
                sandbox_id=sandbox_id,
                template_id=entry.template_id,
                template_build_id=entry.template_build_id,
                state=SandboxState.PAUSED,
                slot=slot,
                workdir=workdir,
                started_at=entry.started_at,
                end_at=entry.end_at,
                vcpus=snap.vcpus,
                memory_mib=snap.memory_mib,
                disk_size_mib=snap.disk_size_mib,
                envd_version=entry.envd_version,
                envd_token=self._adopted_token(entry),
                metadata=dict(entry.metadata),
                env_vars=dict(entry.env_vars),
                auto_pause=entry.auto_pause,
                network=(
                    NetworkOptions.from_dict(entry.network)
                    if entry.network is not None
                    else NetworkOptions(EgressPolicy(allow_internet=entry.allow_internet))
                ),
                traffic_token=self._adopted_traffic_token(entry),
                memory_mode="shared" if snap.files.memory_file is not None else "private",
                disk_path=disk,
                source_dir=snap.directory,
                parent_id=entry.parent_id,
                snapshot_id=entry.snapshot_id,
                auto_resume=entry.auto_resume,
                pause_mode="full",
            )
            self.store.insert_sandbox(rec)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            self.slots.release(slot)
        log.info("sandbox %s adopted from node %s in %s", sandbox_id, entry.node, phases)

    async def check_handoffs(self) -> None:
        """Drop paused sandboxes that another node has resumed since."""
        for rec in self.store.list_sandboxes():
            if rec.state != SandboxState.PAUSED:
                continue
            upload = SandboxDir(rec.workdir).upload_state()
            if upload is None or not upload.committed:
                continue
            try:
                holder = await self.catalog.holder(rec.sandbox_id, upload.generation)
            except RepositoryUnavailable:
                return
            if holder in (None, self.catalog.node):
                continue
            async with self.operations.lock(rec.sandbox_id):
                current = self.store.get_sandbox(rec.sandbox_id)
                if current is None or current.state != SandboxState.PAUSED:
                    continue
                self.leases.forget(current)
                await self.machines.discard(current)
            log.info("sandbox %s was resumed on node %s; dropped here", rec.sandbox_id, holder)


class _Stopped(NamedTuple):
    job: str  # _COMMIT or _UPLOAD
    reason: str


def _no_space(exc: BaseException) -> bool:
    """Whether a local file operation failed for want of space."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)

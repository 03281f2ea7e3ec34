"""Volumes: persistent filesystems that outlive sandboxes (E2B's ``Volume``).

A volume is a record in the repository (``catalog/volume/<id>``, named
``volume:<name>``, see :class:`~.catalog.Catalog`) and an ext4 image (why a block
device, and the measurements, are in :mod:`agentenv.storage.volumes`). A sandbox mounts
volumes at create: each takes one of the template's empty volume slots (drives
``vol0``.., see :data:`~.machines.VOLUME_SLOTS`), and the guest mounts it at the path
asked for. The drive is part of the sandbox's machine from then on, so pause and resume
keep it (a full pause keeps the guest's mount and its page cache with the RAM; a
filesystem-only pause mounts it again after the boot).

ext4 has one writer: a volume is held by at most one sandbox (running or paused), or,
between those, by one content-API request at a time on the host. While a running
sandbox holds it, the content API goes through that sandbox's guest instead
(:mod:`.volume_content`). A second holder is refused with 409, and so is the content
API while the holder is paused or changing state, a destroy while held, and
snapshotting or forking a sandbox that has volumes mounted: the guest's RAM holds the
mounted filesystem, and E2B does not put volume content in snapshots either.

Across nodes the one writer is a node: the writer's claim (``claim:volume:<id>`` among
the repository's names) is taken before a node uses the image, and while another node
has it everything here answers 409 naming that node. At rest a volume's image is a blob
of the repository (``blobs["image"]`` of its record, ``node`` empty); the node taking the
claim fetches it unless its own copy is that blob (``<id>.digest`` beside the image),
and marks the record as its own (``node``); when it lets go (the sandbox's record goes,
a content request ends) it pushes the image (changed chunks only), clears ``node`` and
drops the claim, in the background. A new volume is published at once; what a node left
claimed when it stopped is published at its next start (:meth:`Volumes.settle`).

Owns the map of holders (rebuilt from sandbox records at start, and a sandbox's
entries dropped when its record goes), the per-volume locks and the publishing in
progress; does not start VMs or change sandbox states.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from agentenv.orchestrator import envd_client
from agentenv.orchestrator.catalog import Catalog
from agentenv.orchestrator.errors import (
    Conflict,
    InvalidRequest,
    OperationFailed,
    RepositoryUnavailable,
    VolumeNotFound,
)
from agentenv.orchestrator.records import VolumeEntry
from agentenv.orchestrator.states import PUBLIC_STATE, SandboxState
from agentenv.orchestrator.store import SandboxEvent, Store, VolumeMount, utcnow
from agentenv.orchestrator.supervisor import FinishingWork
from agentenv.orchestrator.volume_content import GuestVolumeFiles, HostVolumeFiles, VolumeFiles
from agentenv.storage.volumes import VolumeImageError, make_image, mounted

log = logging.getLogger("agentenv.volumes")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
_HOST = "the content API"


def slot_device(index: int) -> str:
    """The guest's device of slot ``index``: after ``root`` (vda) and ``tools`` (vdb)."""
    return f"/dev/vd{chr(ord('c') + index)}"


def _check_mount_path(path: str) -> str:
    if not path.startswith("/") or path == "/" or ".." in path.split("/"):
        raise InvalidRequest(f"volume mount path {path!r} must be an absolute path below /")
    if any(c in path for c in "\0\n"):
        raise InvalidRequest("volume mount path has control characters")
    return path.rstrip("/")


@dataclass(frozen=True)
class Requested:
    name: str
    path: str


class Volumes:
    def __init__(
        self,
        directory: Path,
        node: str,
        catalog: Catalog,
        store: Store,
        http: httpx.AsyncClient,
        guest_address: Callable[[int], str],
    ) -> None:
        self.directory = directory
        self.node = node
        self.catalog = catalog
        self.store = store
        self.http = http
        # A network slot's guest address: where a holding sandbox's envd answers.
        self.guest_address = guest_address
        self._holders: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Publishing images that were let go (see release).
        self._publishing = FinishingWork()
        # Whatever removes a sandbox's record (kill, a failed create, a VMM that died
        # with its disk gone, recovery, a handoff) lets go of its volumes.
        store.listen(self._on_sandbox_event)

    def _on_sandbox_event(self, event: SandboxEvent) -> None:
        if event.new is None:
            self.release(event.sandbox_id)

    def startup(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for partial in self.directory.glob("*.partial"):
            partial.unlink(missing_ok=True)
        for rec in self.store.list_sandboxes():
            for mount in rec.volumes:
                self._holders[mount.volume_id] = rec.sandbox_id

    def settle(self) -> None:
        """Publish what a previous run left claimed here and held by no sandbox now
        (it stopped between a release and its publish). Runs in the background."""
        self._spawn(self._settle(), "settling volumes")

    async def _settle(self) -> None:
        for entry in await self.catalog.list_volumes():
            if entry.node == self.node and entry.id not in self._holders:
                await self._publish(entry.id)

    async def drain(self) -> None:
        """Wait for the publishing in progress (at shutdown)."""
        await self._publishing.drain()

    def _spawn(self, work: Coroutine[Any, Any, None], what: str) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the next start settles it
            work.close()
            log.warning("%s left for the next start", what)
            return
        self._publishing.start(work, what)

    def image(self, volume_id: str) -> Path:
        return self.directory / f"{volume_id}.ext4"

    def _digest_marker(self, volume_id: str) -> Path:
        """Which published image the local one is (so it is not fetched again)."""
        return self.directory / f"{volume_id}.digest"

    # -- moving between nodes ------------------------------------------------------------
    async def _acquire(self, entry: VolumeEntry) -> VolumeEntry:
        """Make this node the volume's writer (under the volume's lock): the writer's
        claim in the repository, then the current image here (fetched if another node
        wrote it last). 409 while another node has the claim."""
        writer = await self.catalog.claim_volume(entry.id)
        if writer is not None:
            raise Conflict(
                f"volume {entry.name!r} is in use by a writer on node {writer}: an ext4 "
                "volume has one writer at a time"
            )
        try:
            fresh = await self.catalog.get_volume(entry.id)
            if fresh is None:
                raise VolumeNotFound(entry.id)
            if fresh.node == self.node:
                return fresh
            if fresh.node:
                raise Conflict(
                    f"volume {fresh.name!r} was last written on node {fresh.node}, which has "
                    "not published it yet (it does when its sandbox lets go, or at its start)"
                )
            digest = fresh.blobs.get("image")
            if digest is None:
                raise OperationFailed(f"volume {fresh.name!r} has no image in the repository")
            marker = self._digest_marker(fresh.id)
            here = self.image(fresh.id)
            known = marker.read_text() if marker.exists() else None
            if known != digest or not here.exists():
                partial = here.with_name(here.name + ".partial")
                partial.unlink(missing_ok=True)
                await self.catalog.pull_volume_image(digest, partial)
                os.replace(partial, here)
                marker.write_text(digest)
            mine = fresh.model_copy(update={"node": self.node})
            await self.catalog.put_volume(mine)
            return mine
        except BaseException:
            await self.catalog.release_volume(entry.id)
            raise

    async def _publish(self, volume_id: str) -> None:
        async with self._lock(volume_id):
            await self._publish_locked(volume_id)

    async def _publish_locked(self, volume_id: str) -> None:
        """Put the local image in the repository and let go of the writer's claim, if
        no sandbox here holds the volume (under its lock)."""
        if volume_id in self._holders:
            return
        entry = await self.catalog.get_volume(volume_id)
        if entry is None:
            return
        if entry.node == self.node:
            digest = await self.catalog.push_volume_image(self.image(volume_id))
            self._digest_marker(volume_id).write_text(digest)
            published = entry.model_copy(update={"node": "", "blobs": {"image": digest}})
            await self.catalog.put_volume(published)
        await self.catalog.release_volume(volume_id)

    def _lock(self, volume_id: str) -> asyncio.Lock:
        return self._locks.setdefault(volume_id, asyncio.Lock())

    # -- the volume API ----------------------------------------------------------------
    async def create(self, name: str) -> VolumeEntry:
        if not _NAME.match(name):
            raise InvalidRequest(
                "volume name must be 1 to 63 letters, digits, _ and -, starting with a "
                "letter or digit"
            )
        entry = VolumeEntry(
            id="vol-" + secrets.token_hex(10),
            name=name,
            token=secrets.token_urlsafe(32),
            node=self.node,
            created_at=utcnow(),
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            await make_image(self.image(entry.id))
        except (VolumeImageError, OSError) as exc:
            raise OperationFailed(f"making volume {name!r} failed: {exc}") from exc
        try:
            # Published at once, so that any node sharing the repository can mount it.
            digest = await self.catalog.push_volume_image(self.image(entry.id))
            entry = entry.model_copy(update={"node": "", "blobs": {"image": digest}})
            await self.catalog.add_volume(entry)
            self._digest_marker(entry.id).write_text(digest)
        except BaseException:
            self.image(entry.id).unlink(missing_ok=True)
            raise
        return entry

    async def get(self, volume_id: str) -> VolumeEntry:
        entry = await self.catalog.get_volume(volume_id)
        if entry is None:
            raise VolumeNotFound(volume_id)
        return entry

    async def list(self) -> list[VolumeEntry]:
        return sorted(await self.catalog.list_volumes(), key=lambda e: (e.created_at, e.id))

    async def destroy(self, volume_id: str) -> None:
        entry = await self.get(volume_id)
        async with self._lock(entry.id):
            holder = self._holders.get(entry.id)
            if holder is not None:
                raise Conflict(f"volume {entry.name!r} is mounted in sandbox {holder}")
            writer = await self.catalog.volume_writer(entry.id)
            if writer is not None and writer != self.node:
                raise Conflict(f"volume {entry.name!r} is in use by a writer on node {writer}")
            await self.catalog.drop_volume(entry)
            await self.catalog.release_volume(entry.id)
            self.image(entry.id).unlink(missing_ok=True)
            self._digest_marker(entry.id).unlink(missing_ok=True)
        self._locks.pop(entry.id, None)

    # -- the content API ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def files(self, volume_id: str, token: str | None) -> AsyncIterator[VolumeFiles]:
        """The volume's files while the block runs: through the guest of the running
        sandbox that holds it, else through the image mounted on the host (one
        content request at a time). 404 for a volume that does not exist or a wrong
        token; 409 while a sandbox that is not running (paused, changing) holds it."""
        entry = await self.catalog.get_volume(volume_id)
        if entry is None or token is None or not secrets.compare_digest(token, entry.token):
            raise VolumeNotFound(volume_id)
        guest = self._in_guest(entry)
        if guest is not None:
            yield guest
            return
        async with self._lock(entry.id):
            guest = self._in_guest(entry)  # a sandbox took it while this waited
            if guest is not None:
                yield guest
                return
            await self._acquire(entry)
            try:
                async with mounted(self.image(entry.id)) as files:
                    yield HostVolumeFiles(files)
            except VolumeImageError as exc:
                raise OperationFailed(f"volume {entry.name!r}: {exc}") from exc
            finally:
                try:
                    await self._publish_locked(entry.id)
                except RepositoryUnavailable as exc:
                    # The request itself is done; this node keeps the claim, and
                    # publishes at its next release of the volume or its next start.
                    log.warning("publishing volume %s failed: %s", entry.name, exc)

    def _in_guest(self, entry: VolumeEntry) -> GuestVolumeFiles | None:
        """The volume's files in the guest of the sandbox holding it; ``None`` if no
        sandbox does; 409 if the one that does is not running."""
        holder = self._holders.get(entry.id)
        if holder is None:
            return None
        rec = self.store.get_sandbox(holder)
        mount = None if rec is None else next(
            (m for m in rec.volumes if m.volume_id == entry.id), None
        )  # fmt: skip
        if rec is None or mount is None or rec.state != SandboxState.RUNNING:
            state = "gone" if rec is None else PUBLIC_STATE.get(rec.state, rec.state)
            raise Conflict(
                f"volume {entry.name!r} is held by sandbox {holder}, which is {state}: its "
                "files can be reached while that sandbox runs, or once it is killed"
            )
        return GuestVolumeFiles(
            self.http,
            self.guest_address(rec.slot),
            rec.envd_token,
            slot_device(mount.slot),
            mount.path,
            entry.name,
        )

    # -- sandboxes ---------------------------------------------------------------------
    async def hold(
        self, sandbox_id: str, requested: Sequence[Requested], slots: int
    ) -> tuple[VolumeMount, ...]:
        """Take the volumes ``requested`` for ``sandbox_id`` (all or none)."""
        if not requested:
            return ()
        if len(requested) > slots:
            raise InvalidRequest(
                f"{len(requested)} volume mounts asked for; this template has {slots} volume "
                "slots" + (" (rebuild it to get some)" if slots == 0 else "")
            )
        paths = [_check_mount_path(r.path) for r in requested]
        if len(set(paths)) != len(paths):
            raise InvalidRequest("two volumes mounted at one path")
        entries: list[VolumeEntry] = []
        for r in requested:
            entry = await self.catalog.get_volume(r.name, by_name=True)
            if entry is None:
                raise VolumeNotFound(r.name)
            entries.append(entry)
        if len({e.id for e in entries}) != len(entries):
            raise InvalidRequest("a volume mounted twice in one sandbox")
        taken: list[str] = []
        try:
            for entry in entries:
                async with self._lock(entry.id):
                    holder = self._holders.get(entry.id)
                    if holder is not None:
                        raise Conflict(
                            f"volume {entry.name!r} is in use by sandbox {holder}: an ext4 "
                            "volume has one writer at a time"
                        )
                    await self._acquire(entry)
                    self._holders[entry.id] = sandbox_id
                    taken.append(entry.id)
        except BaseException:
            for volume_id in taken:
                self._holders.pop(volume_id, None)
                self._spawn(self._publish(volume_id), f"publishing volume {volume_id}")
            raise
        return tuple(
            VolumeMount(volume_id=e.id, name=e.name, path=p, slot=i)
            for i, (e, p) in enumerate(zip(entries, paths, strict=True))
        )

    def release(self, sandbox_id: str) -> None:
        """Let go of the sandbox's volumes: each is published to the repository, and
        its writer's claim dropped, in the background."""
        for volume_id, holder in list(self._holders.items()):
            if holder == sandbox_id:
                del self._holders[volume_id]
                self._spawn(self._publish(volume_id), f"publishing volume {volume_id}")

    def images(self, mounts: Sequence[VolumeMount]) -> dict[int, Path]:
        return {m.slot: self.image(m.volume_id) for m in mounts}

    @staticmethod
    async def mount_in_guest(
        http: httpx.AsyncClient, address: str, token: str | None, mounts: Sequence[VolumeMount]
    ) -> None:
        """Mount each volume's slot at its path in the guest (made if missing), one
        ``mount`` process each: under TCG every process the guest starts costs a few
        hundred milliseconds. The empty slot's blocks the guest cached when the template
        was snapshotted are not read: ext4's mount changes the device's block size,
        which drops its page cache."""
        for m in mounts:
            output: list[str] = []

            def keep(_stream: str, line: str, lines: list[str] = output) -> None:
                lines.append(line)

            # noinit_itable: volumes have lazy inode tables, which the guest kernel would
            # otherwise zero in the background, writing to an idle sandbox's drive.
            options = "nodev,nosuid,noinit_itable,X-mount.mkdir"
            argv = ["/bin/mount", "-t", "ext4", "-o", options]
            result = await envd_client.execute(
                http,
                address,
                [*argv, slot_device(m.slot), m.path],
                user="root",
                on_output=keep,
                timeout=60.0,
                access_token=token,
            )
            if result.exit_code != 0:
                raise OperationFailed(
                    f"mounting volume {m.name!r} at {m.path} failed: {' '.join(output)}"
                )

    @staticmethod
    async def flush_in_guest(
        http: httpx.AsyncClient, address: str, token: str | None, mounts: Sequence[VolumeMount]
    ) -> None:
        """Write what the guest holds of its volumes' files to them (``sync -f``), so a
        kill, or a kill after a pause, loses none of it (E2B's volumes keep a file once
        it is closed). A guest that does not answer is let go, with a warning."""
        if not mounts:
            return
        try:
            await envd_client.run(
                http, address, "/bin/sync", ["-f", *(m.path for m in mounts)], token, timeout=30.0
            )
        except envd_client.EnvdUnreachable as exc:
            log.warning("flushing volumes %s failed: %s", ", ".join(m.name for m in mounts), exc)

    @classmethod
    @contextlib.asynccontextmanager
    async def unmounted(
        cls,
        http: httpx.AsyncClient,
        address: str,
        token: str | None,
        mounts: Sequence[VolumeMount],
    ) -> AsyncIterator[None]:
        """The guest's volumes unmounted while the block runs (a snapshot or fork is
        taken), mounted again after. A volume is not part of a snapshot (nor is it in
        E2B): sandboxes started from one mount volumes of their own, and the guest RAM
        captured must not hold a mounted filesystem whose device they will not have. A
        volume the guest is using (open files, a working directory) cannot be unmounted:
        409, and nothing is captured."""
        done: list[VolumeMount] = []
        try:
            for m in mounts:
                output: list[str] = []

                def keep(_stream: str, line: str, lines: list[str] = output) -> None:
                    lines.append(line)

                result = await envd_client.execute(
                    http, address, ["/bin/umount", m.path], user="root", on_output=keep,
                    timeout=60.0, access_token=token,
                )  # fmt: skip
                if result.exit_code != 0:
                    raise Conflict(
                        f"volume {m.name!r} at {m.path} is in use in the sandbox and cannot be "
                        f"left out of the snapshot: {' '.join(output)}"
                    )
                done.append(m)
            yield
        finally:
            await cls.mount_in_guest(http, address, token, done)

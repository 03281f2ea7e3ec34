"""Moving machine snapshots between a node and the repository.

:class:`Publisher` turns a local machine snapshot (device state, RAM image, a chain of
disk layers, the guest's boot files) into content-addressed blobs plus a portable
manifest; :class:`Fetcher` turns such a manifest back into local files a VMM can restore
from, taking shared, read-only pieces (disk layers below the top, boot files) from the
node cache and fetching what is missing.

Disk layers are qcow2 images whose headers name their backing file by absolute path.
Each is stored as it is; a fetched layer is re-pointed (``qemu-img rebase -u``, a header
write) at the local copy of the layer below it. The guest image's files are not stored
per snapshot: a node that has the same guest image (same digest) uses its own, and one
that does not fetches them from ``images/<digest>.json`` (pushed once per repository).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.guest import find_guest_image
from agentenv.snapshots.blobs import CHUNK_SIZE, load_manifest
from agentenv.snapshots.cache import NodeCache
from agentenv.snapshots.layout import MachineSnapshot
from agentenv.snapshots.objects import RepositoryError
from agentenv.snapshots.repository import Repository
from agentenv.storage.images import backing_chain, rebase_unsafe
from agentenv.vmm.base import SnapshotFiles

log = logging.getLogger("agentenv.snapshots")

MANIFEST_VERSION = 1
# A guest's RAM changes in scattered pages: over 5 idle seconds here, 0.9 MiB of pages
# touched 108 MiB of 4 MiB chunks, 25 MiB of 256 KiB ones and 9 MiB of 64 KiB ones. 256 KiB
# keeps a 512 MiB image at 2048 objects at most (S3 requests per commit and per fetch).
RAM_CHUNK_SIZE = 256 * 1024
GUEST_IMAGES_PREFIX = "images/"


async def _stored_bytes(repository: Repository, digest: str) -> int:
    """Bytes a blob's file takes on disk once fetched (its holes take none)."""
    manifest = await load_manifest(repository.store, digest)
    return sum(length for _, length, _ in manifest.chunks)


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1]


def _layer_format(path: Path) -> str:
    return "qcow2" if path.suffix == ".qcow2" else "raw"


class DigestMemo:
    """Digests of local files this node has pushed or fetched, keyed by file identity
    (device, inode, size, mtime), so an unchanged file is never hashed twice. Sealed
    layers, RAM images and boot files never change once written, and a rewrite (a
    flatten renames a new file into place) gets a new identity."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, str] = {}
        try:
            self._entries = json.loads(path.read_text())
        except (OSError, ValueError):
            self._entries = {}

    @staticmethod
    def _key(path: Path) -> str:
        st = path.stat()
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def get(self, path: Path) -> str | None:
        try:
            return self._entries.get(self._key(path))
        except OSError:
            return None

    def put(self, path: Path, digest: str) -> None:
        self._entries[self._key(path)] = digest
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self._entries))
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class Published:
    """A snapshot's portable description and the blobs it references."""

    manifest: dict[str, Any]
    blobs: dict[str, str]


class KnownChunks:
    """Chunks this node knows the repository holds (it stored or found them), so a
    commit does not ask about each again: after a small change most of a RAM image's
    chunks are old ones. Forgotten whenever the repository's garbage collection has run
    (its epoch changed), since chunks may be gone since."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.epoch: str | None = None
        self.chunks: set[str] = set()
        try:
            data = json.loads(path.read_text())
            self.epoch, self.chunks = str(data["epoch"]), set(data["chunks"])
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def check_epoch(self, epoch: str) -> None:
        if epoch != self.epoch:
            self.epoch, self.chunks = epoch, set()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"epoch": self.epoch, "chunks": sorted(self.chunks)}))
        os.replace(tmp, self.path)


class Publisher:
    def __init__(
        self,
        repository: Repository,
        memo: DigestMemo,
        image_cache: Path,
        known: KnownChunks,
    ) -> None:
        self.repository = repository
        self.memo = memo
        self.image_cache = image_cache
        self.known = known
        self._images_pushed: set[str] = set()

    async def push(self, path: Path, *, chunk_size: int = CHUNK_SIZE) -> str:
        digest = self.memo.get(path)
        if digest is not None and await self.repository.blob_exists(digest):
            return digest
        digest = await self.repository.push_file(
            path, chunk_size=chunk_size, known=self.known.chunks
        )
        self.memo.put(path, digest)
        return digest

    async def _push_guest_image(self, snap: MachineSnapshot, rootfs: Path | None) -> None:
        """The guest image's boot files (and base root filesystem), once per repository."""
        key = f"{GUEST_IMAGES_PREFIX}{snap.image_digest}"
        if key in self._images_pushed:
            return
        if await self.repository.get_record("images", snap.image_digest) is None:
            files: dict[str, str] = {
                "kernel": await self.push(snap.kernel),
                "tools": await self.push(snap.tools_drive),
            }
            if snap.initrd is not None:
                files["initrd"] = await self.push(snap.initrd)
            if rootfs is not None:
                files["rootfs"] = await self.push(rootfs)
            await self.repository.put_record(
                "images", snap.image_digest, {"digest": snap.image_digest, "blobs": files}
            )
        self._images_pushed.add(key)

    def _is_guest_file(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.image_cache.resolve())
            return True
        except ValueError:
            return False

    async def publish(
        self,
        snap: MachineSnapshot,
        *,
        state_file: Path | None = None,
        memory_file: Path | None = None,
        disk: Path | None = None,
    ) -> Published:
        """Push ``snap``'s files (or the given replacements: a paused sandbox's frozen
        state, RAM and disk top) and return its manifest. Nothing is recorded: the caller
        commits by writing a catalog record that names the blobs."""
        # The caller holds a commit lease (Repository.commit_lease) from here until its
        # record is written: no garbage collection sweeps while this push relies on
        # chunks and blobs it finds stored. The epoch is read under it.
        self.known.check_epoch(await self.repository.gc_epoch())
        try:
            return await self._publish(snap, state_file, memory_file, disk)
        finally:
            self.known.save()

    async def _publish(
        self,
        snap: MachineSnapshot,
        state_file: Path | None,
        memory_file: Path | None,
        disk: Path | None,
    ) -> Published:
        state = state_file or snap.files.state_file
        memory = memory_file or snap.files.memory_file
        top = disk or snap.disk
        chain = backing_chain(top)
        if not chain or chain[0] != top:
            raise RepositoryError(f"disk {top} is missing")
        guest_rootfs = chain[-1] if self._is_guest_file(chain[-1]) else None
        await self._push_guest_image(snap, guest_rootfs)
        blobs: dict[str, str] = {"state": await self.push(state)}
        if memory is not None:
            blobs["memory"] = await self.push(memory, chunk_size=RAM_CHUNK_SIZE)
        layers: list[dict[str, Any]] = []
        for i, path in enumerate(chain):
            if path == guest_rootfs:
                layers.append({"guest_rootfs": True, "format": "raw"})
                continue
            digest = await self.push(path)
            blobs[f"layer{i}"] = digest
            layers.append({"digest": digest, "format": _layer_format(path)})
        files = json.loads(snap.files.to_json())
        files.pop("state_file", None)
        files.pop("memory_file", None)
        manifest = {
            "version": MANIFEST_VERSION,
            "files": files,
            "has_memory": memory is not None,
            "layers": layers,
            "cmdline": snap.cmdline,
            "vcpus": snap.vcpus,
            "memory_mib": snap.memory_mib,
            "disk_size_mib": snap.disk_size_mib,
            "image_digest": snap.image_digest,
            "envd_version": snap.envd_version,
            "boot_files": {
                "kernel": snap.kernel.name,
                "initrd": snap.initrd.name if snap.initrd else None,
            },
        }
        return Published(manifest, blobs)


ProgressLog = Callable[[str], None]
# The cache keys the current materialise holds (see Fetcher.pinned).
_HELD: ContextVar[list[str] | None] = ContextVar("agentenv_fetch_held", default=None)


class Fetcher:
    """Materialises repository snapshots on this node, through the bounded cache."""

    def __init__(
        self,
        repository: Repository,
        cache: NodeCache,
        memo: DigestMemo,
        image_cache: Path,
        pinned: Callable[[], set[str]],
    ) -> None:
        self.repository = repository
        self.cache = cache
        self.memo = memo
        self.image_cache = image_cache
        self._pinned = pinned
        self._locks: dict[str, asyncio.Lock] = {}
        # Cache entries a materialise in progress has fetched or found: not yet used by
        # any sandbox, but it needs them until it is done.
        self._busy: Counter[str] = Counter()

    def pinned(self) -> set[str]:
        return self._pinned() | {key for key, n in self._busy.items() if n > 0}

    def _hold(self, key: str) -> None:
        held = _HELD.get()
        if held is not None:
            held.append(key)
            self._busy[key] += 1

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def _blob(
        self, digest: str, suffix: str, below: tuple[Path, str] | None, say: ProgressLog
    ) -> Path:
        """The cached copy of blob ``digest`` (fetched if absent). A qcow2 layer is
        re-pointed at ``below`` (its local backing file and format) before it is
        published in the cache."""
        key = f"blob:{_hex(digest)}"
        async with self._lock(key):
            cached = self.cache.get(key)
            if cached is not None and cached.exists():
                self._hold(key)
                return cached
            size = await _stored_bytes(self.repository, digest)
            self.cache.make_room(size, self.pinned)
            dest = self.cache.path_for(key).with_suffix(suffix)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".part")
            say(f"fetching {digest[:19]} ({size / 2**20:.0f} MiB)")
            try:
                await self.repository.pull_file(digest, tmp)
                if below is not None:
                    await rebase_unsafe(tmp, below[0], below[1])
                tmp.chmod(0o444)
                os.replace(tmp, dest)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            self.cache.add(key, dest)
            self._hold(key)
            self.memo.put(dest, digest)
            return dest

    async def _boot_files(
        self, manifest: dict[str, Any], say: ProgressLog
    ) -> tuple[Path, Path | None, Path, Path | None]:
        """kernel, initrd, tools and the guest root filesystem: this host's own copy of
        the guest image if it has that digest, else fetched."""
        digest = manifest["image_digest"]
        local = find_guest_image(self.image_cache, digest)
        if local is not None:
            return local.kernel, local.initrd, local.tools, local.rootfs
        record = await self.repository.get_record("images", digest)
        if record is None:
            raise RepositoryError(f"guest image {digest} is not in the repository")
        blobs = record["blobs"]
        kernel = await self._blob(blobs["kernel"], ".kernel", None, say)
        tools = await self._blob(blobs["tools"], ".raw", None, say)
        initrd = (
            await self._blob(blobs["initrd"], ".initrd", None, say) if "initrd" in blobs else None
        )
        rootfs = await self._blob(blobs["rootfs"], ".raw", None, say) if "rootfs" in blobs else None
        return kernel, initrd, tools, rootfs

    async def _lower_layers(
        self, manifest: dict[str, Any], rootfs: Path | None, say: ProgressLog
    ) -> list[Path]:
        """Local paths of the manifest's layers below the top, bottom first fetched."""
        layers = manifest["layers"]
        below: tuple[Path, str] | None = None
        paths: list[Path] = []
        for layer in reversed(layers[1:]):
            if layer.get("guest_rootfs"):
                if rootfs is None:
                    raise RepositoryError("the snapshot's guest root filesystem is unavailable")
                path = rootfs
            else:
                suffix = ".qcow2" if layer["format"] == "qcow2" else ".raw"
                path = await self._blob(
                    layer["digest"], suffix, below if layer["format"] == "qcow2" else None, say
                )
            below = (path, layer["format"])
            paths.append(path)
        return list(reversed(paths))

    async def materialise(
        self,
        manifest: dict[str, Any],
        blobs: dict[str, str],
        directory: Path,
        *,
        top_shared: bool,
        say: ProgressLog = lambda _: None,
    ) -> MachineSnapshot:
        """Write a restorable snapshot into ``directory`` (which must not exist; built in
        a staging sibling and renamed). With ``top_shared`` the top disk layer is a
        read-only cache entry (a snapshot that sandboxes overlay); otherwise it is a
        private writable copy in ``directory`` (a paused sandbox's own disk)."""
        if manifest.get("version") != MANIFEST_VERSION:
            raise RepositoryError(
                f"unsupported snapshot manifest version {manifest.get('version')}"
            )
        held: list[str] = []
        token = _HELD.set(held)
        try:
            return await self._materialise(manifest, blobs, directory, top_shared, say)
        finally:
            _HELD.reset(token)
            for key in held:
                self._busy[key] -= 1
                if self._busy[key] <= 0:
                    del self._busy[key]

    async def _materialise(
        self,
        manifest: dict[str, Any],
        blobs: dict[str, str],
        directory: Path,
        top_shared: bool,
        say: ProgressLog,
    ) -> MachineSnapshot:
        kernel, initrd, tools, rootfs = await self._boot_files(manifest, say)
        lower = await self._lower_layers(manifest, rootfs, say)
        top_layer = manifest["layers"][0]
        below = (lower[0], manifest["layers"][1]["format"]) if lower else None
        staging = directory.with_name(f".staging-{directory.name}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            if top_layer.get("guest_rootfs"):
                if rootfs is None:
                    raise RepositoryError("the snapshot's guest root filesystem is unavailable")
                disk, disk_format = rootfs, "raw"
            elif top_shared:
                suffix = ".qcow2" if top_layer["format"] == "qcow2" else ".raw"
                disk = await self._blob(top_layer["digest"], suffix, below, say)
                disk_format = top_layer["format"]
            else:
                disk = staging / ("disk.qcow2" if top_layer["format"] == "qcow2" else "disk.raw")
                await self.repository.pull_file(top_layer["digest"], disk)
                if below is not None and top_layer["format"] == "qcow2":
                    await rebase_unsafe(disk, below[0], below[1])
                disk_format = top_layer["format"]
            if top_shared:
                # The snapshot's own files land in the cache too: room for them first.
                needed = await _stored_bytes(self.repository, blobs["state"])
                if manifest.get("has_memory"):
                    needed += await _stored_bytes(self.repository, blobs["memory"])
                self.cache.make_room(needed, self.pinned)
            state = staging / "state"
            say("fetching machine state")
            await self.repository.pull_file(blobs["state"], state)
            memory: Path | None = None
            if manifest.get("has_memory"):
                memory = staging / "memory.raw"
                say("fetching RAM image")
                await self.repository.pull_file(blobs["memory"], memory)
            files_data = dict(manifest["files"])
            files_data["state_file"] = str(directory / "state")
            files_data["memory_file"] = str(directory / "memory.raw") if memory else None
            files = SnapshotFiles.from_json(json.dumps(files_data))
            snap = MachineSnapshot(
                directory=staging,
                files=files,
                disk=disk,
                disk_format=disk_format,
                kernel=kernel,
                initrd=initrd,
                tools_drive=tools,
                cmdline=manifest["cmdline"],
                vcpus=int(manifest["vcpus"]),
                memory_mib=int(manifest["memory_mib"]),
                disk_size_mib=int(manifest["disk_size_mib"]),
                image_digest=manifest["image_digest"],
                envd_version=manifest["envd_version"],
                disk_chain_depth=sum(
                    1 for layer in manifest["layers"] if layer["format"] == "qcow2"
                ),
            )
            # The manifest names files by their final paths; written before the rename,
            # which is the commit point.
            data = snap.to_dict()
            (staging / "snapshot.json").write_text(json.dumps(data, indent=2, sort_keys=True))
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return MachineSnapshot.load(directory)

"""Volume images: one ext4 filesystem in a sparse raw file per volume, and the host's
access to its files while no sandbox has it (the volume content API).

Why a block device per volume (measured on this 2-core TCG host, QEMU 7.2):

* virtio-fs (``vhost-user-fs``) and virtio-9p both block QEMU's migration while the
  export is in use, and a pause or snapshot here *is* a migration to a file; Firecracker
  has neither device. A virtio-blk drive saves and restores like the root disk, on both
  VMMs.
* Making one costs a sparse ``truncate`` and ``mkfs.ext4`` with lazy inode tables:
  about 15 ms and 2 MiB on disk for the fixed 4 GiB image.
* The host reaches the files with ``fuse2fs``: ext4 read and written by a userspace
  process, never by the host kernel. A guest writes the filesystem, so the image is
  hostile input, and the kernel's ext4 driver is not hardened against crafted images
  (a bug there is the host's kernel); a bug in fuse2fs (or in ``e2fsck``, which replays
  the journal first: fuse2fs crashed on an image whose journal needed recovery) is a
  crashed process. The kernel only speaks FUSE to it. (It was a loop mount first: about
  10 ms to mount and 10 ms to unmount, 64 MiB written at about 400 MB/s with ``sync``.)

The price: ext4 is not a shared filesystem, so a volume has one writer at a time (one
sandbox, or the host's content API); :mod:`agentenv.orchestrator.volumes` enforces that.
Every image has the same size, :data:`VOLUME_BYTES`, because templates are snapshotted
with empty drives of that size in the slots volumes later take (a restored guest keeps
the capacity it saw).

Paths given to :class:`MountedVolume` are volume paths (``/a/b``); none may leave the
volume, through ``..`` or a symbolic link the guest made. Mounted ``nosuid,nodev,noexec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

#: Every volume image's (and every empty volume slot's) size.
VOLUME_BYTES = 4 << 30
#: Owner of a new volume's root and of files the content API makes without one: the
#: guest's ``user`` (agentenv.guest.rootfs.USER_UID).
DEFAULT_OWNER = 1000


class VolumeImageError(Exception):
    """A volume image could not be made, mounted or changed (``what`` failed)."""


class VolumePathError(Exception):
    """A path in a volume is not there, or not what the operation needs."""

    def __init__(self, message: str, *, missing: bool) -> None:
        super().__init__(message)
        self.missing = missing


async def _run(*argv: str, ok: tuple[int, ...] = (0,)) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    if proc.returncode not in ok:
        raise VolumeImageError(f"{argv[0]} failed: {out.decode(errors='replace').strip()}")


async def make_image(path: Path) -> None:
    """A new, empty ext4 image at ``path`` (written beside it, then renamed)."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    make_empty_slot(partial)
    owner = f"root_owner={DEFAULT_OWNER}:{DEFAULT_OWNER}"
    try:
        await _run(
            "mkfs.ext4", "-q", "-F", "-m", "0", "-L", "volume",
            "-E", f"{owner},lazy_itable_init=1,lazy_journal_init=1", str(partial),
        )  # fmt: skip
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def make_empty_slot(path: Path) -> None:
    """A sparse, unformatted file of :data:`VOLUME_BYTES`: a volume slot no volume
    fills."""
    with open(path, "wb") as fh:
        fh.truncate(VOLUME_BYTES)


#: How long fuse2fs may take to mount, or to finish writing the image once unmounted.
FUSE_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def mounted(image: Path) -> AsyncIterator[MountedVolume]:
    """The image mounted on the host through ``fuse2fs`` for the duration (the caller
    guarantees no VM has it open). It is given back only once fuse2fs has exited, so
    everything written is in the image before a VM may open it."""
    # The journal is replayed first (0: clean, 1: replayed).
    await _run("e2fsck", "-p", "-E", "journal_only", str(image), ok=(0, 1))
    where = Path(tempfile.mkdtemp(prefix="aenv-volume-"))
    try:
        fuse = await asyncio.create_subprocess_exec(
            "fuse2fs", "-f", str(image), str(where), "-o", "nosuid,nodev,noexec",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            await _until_mounted(fuse, where)
            try:
                yield MountedVolume(where)
            finally:
                await _run("umount", str(where))
            await asyncio.wait_for(fuse.wait(), FUSE_TIMEOUT_S)
        finally:
            if fuse.returncode is None:
                fuse.kill()
                await fuse.wait()
        if fuse.returncode != 0:
            raise VolumeImageError(f"fuse2fs exited with status {fuse.returncode}")
    finally:
        with contextlib.suppress(OSError):
            where.rmdir()


async def _until_mounted(fuse: asyncio.subprocess.Process, where: Path) -> None:
    deadline = asyncio.get_running_loop().time() + FUSE_TIMEOUT_S
    while not os.path.ismount(where):
        if fuse.returncode is not None or asyncio.get_running_loop().time() > deadline:
            out = await fuse.stdout.read() if fuse.stdout and fuse.returncode is not None else b""
            raise VolumeImageError(
                f"fuse2fs did not mount the volume image: {out.decode(errors='replace').strip()}"
            )
        await asyncio.sleep(0.005)


@dataclass(frozen=True)
class Entry:
    """One file or directory as the content API describes it."""

    name: str
    type: str
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | None = None


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


class MountedVolume:
    """Files of a volume mounted at ``root`` on the host."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def clean(path: str) -> str:
        """``path`` as a normalised volume path (``/`` for the root)."""
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise VolumePathError(f"{path!r}: '..' is not allowed", missing=False)
        return "/" + "/".join(parts)

    def host_path(self, path: str, *, follow: bool = True) -> Path:
        """Where volume path ``path`` is on the host; with ``follow`` a final symbolic
        link is followed too. Links resolving outside the volume are refused."""
        clean = self.clean(path)
        local = self.root / clean.lstrip("/")
        parent = local.parent if local != self.root else local
        resolved_parent = Path(os.path.realpath(parent))
        target = resolved_parent / local.name if local != self.root else resolved_parent
        if follow:
            target = Path(os.path.realpath(target))
        if target != self.root and self.root not in target.parents:
            raise VolumePathError(f"{path!r} leads outside the volume", missing=False)
        return target

    def entry(self, path: str) -> Entry:
        clean = self.clean(path)
        local = self.host_path(clean, follow=False)
        try:
            st = local.lstat()
        except FileNotFoundError:
            raise VolumePathError(f"{clean} does not exist", missing=True) from None
        target = None
        if stat.S_ISDIR(st.st_mode):
            kind = "directory"
        elif stat.S_ISREG(st.st_mode):
            kind = "file"
        elif stat.S_ISLNK(st.st_mode):
            kind, target = "symlink", os.readlink(local)
        else:
            kind = "unknown"
        return Entry(
            name=clean.rsplit("/", 1)[-1] or "/",
            type=kind,
            path=clean,
            size=st.st_size,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            atime=_time(st.st_atime),
            mtime=_time(st.st_mtime),
            ctime=_time(st.st_ctime),
            target=target,
        )

    def listing(self, path: str, depth: int) -> list[Entry]:
        clean = self.clean(path)
        directory = self.host_path(clean)
        if not directory.is_dir():
            raise VolumePathError(f"{clean} is not a directory", missing=not directory.exists())
        found: list[Entry] = []

        def walk(volume_dir: str, local: Path, level: int) -> None:
            for name in sorted(os.listdir(local)):
                child = f"{volume_dir.rstrip('/')}/{name}"
                item = self.entry(child)
                found.append(item)
                if item.type == "directory" and level < depth:
                    walk(child, local / name, level + 1)

        walk(clean, directory, 1)
        return found

    def _own(self, local: Path, uid: int | None, gid: int | None, mode: int | None) -> None:
        owner = (DEFAULT_OWNER if uid is None else uid, DEFAULT_OWNER if gid is None else gid)
        os.chown(local, *owner, follow_symlinks=False)
        if mode is not None:
            os.chmod(local, mode & 0o7777)

    def _parent_ready(self, local: Path, clean: str, force: bool) -> None:
        if local.parent.is_dir():
            return
        if not force:
            raise VolumePathError(f"the directory of {clean} does not exist", missing=True)
        self.make_dir(clean.rsplit("/", 1)[0] or "/", None, None, None, force=True)

    def make_dir(
        self, path: str, uid: int | None, gid: int | None, mode: int | None, *, force: bool
    ) -> Entry:
        clean = self.clean(path)
        local = self.host_path(clean)
        if local.exists():
            if local.is_dir() and force:
                return self.entry(clean)
            raise VolumePathError(f"{clean} already exists", missing=False)
        self._parent_ready(local, clean, force)
        local.mkdir()
        self._own(local, uid, gid, 0o755 if mode is None else mode)
        return self.entry(clean)

    def open_for_write(self, path: str, *, force: bool) -> tuple[str, Path]:
        clean = self.clean(path)
        if clean == "/":
            raise VolumePathError("the volume's root is a directory", missing=False)
        local = self.host_path(clean)
        if local.is_dir():
            raise VolumePathError(f"{clean} is a directory", missing=False)
        self._parent_ready(local, clean, force)
        return clean, local

    def finish_write(
        self, clean: str, local: Path, partial: Path, uid: int | None, gid: int | None,
        mode: int | None,
    ) -> Entry:  # fmt: skip
        self._own(partial, uid, gid, 0o644 if mode is None else mode)
        os.replace(partial, local)
        return self.entry(clean)

    def read_path(self, path: str) -> Path:
        clean = self.clean(path)
        local = self.host_path(clean)
        if not local.is_file():
            raise VolumePathError(f"{clean} is not a file", missing=not local.exists())
        return local

    def remove(self, path: str) -> None:
        clean = self.clean(path)
        if clean == "/":
            raise VolumePathError("the volume's root cannot be removed", missing=False)
        local = self.host_path(clean, follow=False)
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        elif local.exists() or local.is_symlink():
            local.unlink()
        else:
            raise VolumePathError(f"{clean} does not exist", missing=True)

    def set_metadata(self, path: str, uid: int | None, gid: int | None, mode: int | None) -> Entry:
        clean = self.clean(path)
        local = self.host_path(clean)
        if not local.exists():
            raise VolumePathError(f"{clean} does not exist", missing=True)
        if uid is not None or gid is not None:
            os.chown(local, -1 if uid is None else uid, -1 if gid is None else gid)
        if mode is not None:
            os.chmod(local, mode & 0o7777)
        return self.entry(clean)


def read_chunks(local: Path, size: int = 1 << 20) -> Iterator[bytes]:
    with open(local, "rb") as fh:
        while chunk := fh.read(size):
            yield chunk

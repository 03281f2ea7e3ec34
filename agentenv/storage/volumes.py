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

The files themselves, paths confined to the volume, are :mod:`.volume_tree`'s
:class:`MountedVolume` (which the guest runs too). Mounted ``nosuid,nodev,noexec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from agentenv.storage.volume_tree import (
    DEFAULT_OWNER,
    Entry,
    MountedVolume,
    VolumePathError,
    read_chunks,
)

__all__ = [
    "DEFAULT_OWNER",
    "VOLUME_BYTES",
    "Entry",
    "MountedVolume",
    "VolumeImageError",
    "VolumePathError",
    "make_empty_slot",
    "make_image",
    "mounted",
    "read_chunks",
]

#: Every volume image's (and every empty volume slot's) size.
VOLUME_BYTES = 4 << 30


class VolumeImageError(Exception):
    """A volume image could not be made, mounted or changed (``what`` failed)."""


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

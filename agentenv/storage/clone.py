"""File clones: reflinks (``FICLONE``) where the filesystem shares extents, sparse copies
elsewhere.

A reflink is what makes a sandbox's own RAM file and a snapshot's frozen RAM cheap: the
clone shares every extent with its source until one side writes, so cloning a clean file
takes milliseconds whatever its size, and a snapshot stores only the extents that changed
since its source. XFS and btrfs can; ext4 cannot, and then a sparse copy (data extents
only, found with ``SEEK_DATA``/``SEEK_HOLE``) is the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
from pathlib import Path

# linux/fs.h: _IOW(0x94, 9, int)
FICLONE = 0x40049409
_COPY_CHUNK = 8 * 1024 * 1024


class CloneError(OSError):
    """A file could not be cloned or copied."""


def _reflink_fd(src_fd: int, dst_fd: int) -> bool:
    """Try ``FICLONE``; False if this filesystem (or pair of files) cannot share extents."""
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL):
            return False
        raise
    return True


def _sparse_copy_fd(src_fd: int, dst_fd: int, size: int) -> None:
    """Copy only the data extents of ``src_fd``; holes stay holes."""
    os.ftruncate(dst_fd, size)
    offset = 0
    while offset < size:
        try:
            data = os.lseek(src_fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after offset
                break
            raise
        hole = os.lseek(src_fd, data, os.SEEK_HOLE)
        pos = data
        while pos < hole:
            n = os.copy_file_range(src_fd, dst_fd, min(_COPY_CHUNK, hole - pos), pos, pos)
            if n == 0:
                break
            pos += n
        offset = hole


def _clone(source: Path, dest: Path, mode: int, *, copy: bool) -> bool:
    """Make ``dest`` a reflink of ``source`` (or, with ``copy``, a sparse copy where it
    cannot be one) under a temporary name renamed into place, so ``dest`` is never
    half-written. Returns whether it is a reflink; without ``copy``, False leaves ``dest``
    as it was."""
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(source, "rb") as src:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            try:
                linked = _reflink_fd(src.fileno(), fd)
                if not linked and copy:
                    _sparse_copy_fd(src.fileno(), fd, os.fstat(src.fileno()).st_size)
            finally:
                os.close(fd)
        if linked or copy:
            os.replace(tmp, dest)
    except OSError as exc:
        raise CloneError(exc.errno, f"cloning {source} to {dest} failed: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return linked


def clone_file_sync(source: Path, dest: Path, *, mode: int = 0o600) -> bool:
    """Make ``dest`` a copy of ``source``, atomically (a temporary name is renamed into
    place, so ``dest`` is never half-written). Returns True for a reflink, False for a
    copy."""
    return _clone(source, dest, mode, copy=True)


def reflink_file_sync(source: Path, dest: Path, *, mode: int = 0o600) -> bool:
    """Make ``dest`` a reflink of ``source``, atomically, and return True; or return
    False, leaving ``dest`` as it was, where the filesystem cannot share extents (no
    copy: for callers to whom a clone is only worth its constant time)."""
    return _clone(source, dest, mode, copy=False)


async def clone_file(source: Path, dest: Path, *, mode: int = 0o600) -> bool:
    """:func:`clone_file_sync` off the event loop (a copy, or the writeback a reflink of a
    dirty file forces, can take long)."""
    return await asyncio.to_thread(clone_file_sync, source, dest, mode=mode)


def supports_reflink(directory: Path) -> bool:
    """Whether files in ``directory`` can be reflinked (probed with two tiny files)."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".reflink-probe-{secrets.token_hex(4)}"
    clone = probe.with_name(probe.name + ".clone")
    try:
        probe.write_bytes(b"x" * 4096)
        with open(probe, "rb") as src, open(clone, "wb") as dst:
            return _reflink_fd(src.fileno(), dst.fileno())
    except OSError:
        return False
    finally:
        for p in (probe, clone):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def flush_file(path: Path) -> None:
    """Write ``path``'s dirty page cache back to its filesystem, without the device
    cache flush ``fdatasync`` adds (``sync_file_range``). Done before a reflink while the
    writer still runs, so the reflink itself (which must write back what is dirty) finds
    little left. Not a durability barrier: see :func:`make_durable`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        flags = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
        if _libc.sync_file_range(fd, 0, 0, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def make_durable(*paths: Path) -> None:
    """``fdatasync`` each file: on stable storage, surviving a power loss."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

"""What a file costs on disk, and giving back what a clone needlessly stopped sharing.

:func:`unshared_bytes` reads a file's extent map (``FIEMAP``): the bytes in extents no
other file shares, i.e. what deleting it would free. :func:`reshare` makes a clone share
again the blocks whose content still equals its source's (``FIDEDUPERANGE``, which the
kernel does atomically: it compares the two ranges under the files' locks and remaps only
if they are identical). It must not run on a file a VM maps: resuming a paused sandbox
while its RAM file was being reshared hung its guest in 3 of 36 cycles (measured).
The remap drops the file's page cache under the VMM; the likely way that loses data is a
page the VMM had pinned for a device's direct I/O (virtio-blk reads land in guest RAM),
written after it left the cache. Callers stop a resharing (``stop``) before a VM maps the
file again.

Why a clone needs it: a sandbox's RAM file is a reflink of its template's, and a Linux
guest zeroes every page it allocates. Writing zeros over zeros changes nothing, but each
write to a shared extent still gets a block of its own. Measured here, a sandbox just
created had 88 MiB of its RAM file unshared while only 3 MiB of pages differed from the
template's; resharing left 3.5 MiB.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

# linux/fs.h and linux/fiemap.h
_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_EXTENT_SHARED = 0x2000
_FIEMAP_HEADER = struct.Struct("=QQIIII")  # start, length, flags, mapped, count, reserved
_FIEMAP_EXTENT = struct.Struct("=QQQQQIIII")  # logical, physical, length, 2 reserved, flags
_EXTENTS_PER_CALL = 256
_FIDEDUPERANGE = 0xC0189436
_DEDUPE_RANGE = struct.Struct("=QQHHI")  # src offset, src length, dest count, 2 reserved
_DEDUPE_INFO = struct.Struct("=qQQiI")  # dest fd, dest offset, bytes deduped, status, reserved
_DEDUPE_DIFFERS = 1
# Pages are compared at the filesystem's usual block size; a run of equal pages is one
# call, at most _MAX_DEDUPE bytes: a call holds the file's locks, and a VM faulting in
# pages of it waits meanwhile.
PAGE = 4096
_READ = 1024 * 1024
_MAX_DEDUPE = 2 * 1024 * 1024
# The filesystem (or this pair of files) cannot share extents.
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL)


class Extent(NamedTuple):
    offset: int  # in the file
    physical: int  # on the device
    length: int
    shared: bool  # some other file (or clone) maps these blocks too


def extents(fd: int) -> Iterator[Extent]:
    """The extents of the open file ``fd``, after its dirty pages are written back (what
    it costs once on disk)."""
    start = 0
    while True:
        header = _FIEMAP_HEADER.pack(
            start, 2**64 - 1 - start, _FIEMAP_FLAG_SYNC, 0, _EXTENTS_PER_CALL, 0
        )
        buf = bytearray(header + bytes(_FIEMAP_EXTENT.size * _EXTENTS_PER_CALL))
        fcntl.ioctl(fd, _FS_IOC_FIEMAP, buf)
        mapped = _FIEMAP_HEADER.unpack_from(buf)[3]
        if mapped == 0:
            return
        for i in range(mapped):
            logical, physical, length, _, _, flags, *_ = _FIEMAP_EXTENT.unpack_from(
                buf, _FIEMAP_HEADER.size + i * _FIEMAP_EXTENT.size
            )
            yield Extent(logical, physical, length, bool(flags & _FIEMAP_EXTENT_SHARED))
            if flags & _FIEMAP_EXTENT_LAST:
                return
            start = logical + length


def unshared_bytes(path: Path) -> int:
    """Bytes of ``path`` in extents no other file (or clone) shares."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return sum(e.length for e in extents(fd) if not e.shared)
    finally:
        os.close(fd)


def _not_shared_with(dest: list[Extent], source: list[Extent]) -> Iterator[tuple[int, int]]:
    """Ranges ``(offset, length)`` of dest's data that are not the very blocks source has
    at the same offsets (both lists in ascending offsets)."""
    for d in dest:
        pos, end = d.offset, d.offset + d.length
        for s in source:
            if s.offset + s.length <= pos:
                continue
            if s.offset >= end:
                break
            lo, hi = max(pos, s.offset), min(end, s.offset + s.length)
            if d.physical + (lo - d.offset) == s.physical + (lo - s.offset):
                if lo > pos:
                    yield pos, lo - pos
                pos = hi
        if pos < end:
            yield pos, end - pos


def _dedupe(source_fd: int, dest_fd: int, offset: int, length: int) -> int:
    """Share ``[offset, offset + length)`` of dest with the same range of source if the
    two are still identical; the bytes now shared (0 if they differ)."""
    done = 0
    while done < length:
        n = min(length - done, _MAX_DEDUPE)
        buf = bytearray(
            _DEDUPE_RANGE.pack(offset + done, n, 1, 0, 0)
            + _DEDUPE_INFO.pack(dest_fd, offset + done, 0, 0, 0)
        )
        fcntl.ioctl(source_fd, _FIDEDUPERANGE, buf)
        _, _, deduped, status, _ = _DEDUPE_INFO.unpack_from(buf, _DEDUPE_RANGE.size)
        if status < 0:
            raise OSError(-status, f"FIDEDUPERANGE: {os.strerror(-status)}")
        if status != _DEDUPE_DIFFERS:
            done += deduped
            if deduped == 0:
                break
        else:
            break
    return done


def _equal_runs(source: bytes, dest: bytes, base: int) -> Iterator[tuple[int, int]]:
    """Runs ``(offset, length)`` of whole pages equal in the two buffers."""
    if source == dest:
        yield base, len(dest)
        return
    start: int | None = None
    pos = 0
    for pos in range(0, len(dest), PAGE):
        if source[pos : pos + PAGE] == dest[pos : pos + PAGE]:
            if start is None:
                start = pos
        elif start is not None:
            yield base + start, pos - start
            start = None
    if start is not None:
        yield base + start, len(dest) - start


def reshare(path: Path, like: Path, stop: threading.Event | None = None) -> int:
    """Make ``path`` share with ``like`` every page both hold at the same offset with the
    same content, where it is not already the same block; return the bytes it now shares.
    0 where the filesystem cannot share extents. Neither file's content or modification
    time changes. Once ``stop`` is set it returns before its next dedupe call (within
    one call of at most 2 MiB)."""
    source_fd = os.open(like, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Dedupe needs the destination open for writing, or owned by the caller.
        dest_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = min(os.fstat(source_fd).st_size, os.fstat(dest_fd).st_size)
            size -= size % PAGE
            try:
                ranges = list(
                    _not_shared_with(
                        [e for e in extents(dest_fd) if e.offset < size], list(extents(source_fd))
                    )
                )
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    return 0
                raise
            total = 0
            for offset, length in ranges:
                end = min(offset + length, size)
                pos = offset - offset % PAGE
                while pos < end:
                    if stop is not None and stop.is_set():
                        return total
                    n = min(_READ, end - pos)
                    dest = os.pread(dest_fd, n, pos)
                    source = os.pread(source_fd, n, pos)
                    if len(source) < len(dest):
                        source += bytes(len(dest) - len(source))
                    for run_offset, run_length in _equal_runs(source, dest, pos):
                        if stop is not None and stop.is_set():
                            return total
                        try:
                            total += _dedupe(source_fd, dest_fd, run_offset, run_length)
                        except OSError as exc:
                            if exc.errno in _UNSUPPORTED:
                                return total
                            raise
                    pos += n
            return total
        finally:
            os.close(dest_fd)
    finally:
        os.close(source_fd)

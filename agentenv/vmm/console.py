"""Keeping a VMM's console log within a byte bound.

A VMM appends the guest's console to a file (QEMU through a chardev opened with
``append=on``, Firecracker through its stdout opened for appending). A task of the VM's
handle cuts the file's oldest part once it is past its bound, so a guest flooding its
serial port cannot fill the host's disk, and the file the server reads on a failed boot
stays where it was. QEMU's own output file is bounded alike (a guest can make QEMU log
an error per page it hands its balloon). The writer must append (``O_APPEND``): a writer
at a fixed offset would leave a hole of zeros behind every cut.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
from pathlib import Path

#: Default bound of a VM's console log, in bytes.
CONSOLE_LIMIT_BYTES = 1024 * 1024
#: How often a VM's console log is checked against its bound: a guest writing its serial
#: port flat out (about 1 MB/s under TCG) gets this much past it at most.
CONSOLE_CHECK_INTERVAL_S = 0.5

_FALLOC_FL_COLLAPSE_RANGE = 0x08
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def bound_file(path: Path, limit: int) -> None:
    """Keep ``path`` (a log another process appends to) within about ``limit`` bytes by
    cutting its oldest part once it is larger: whole filesystem blocks are collapsed out
    of its head, leaving the most recent ``limit // 2`` bytes or a little more. Where the
    filesystem cannot collapse ranges, the tail is copied to the head and the file
    truncated (a write landing in between may be lost)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size <= limit:
        return
    block = os.statvfs(path).f_bsize
    drop = (size - limit // 2) // block * block
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if (
            drop > 0
            and _libc.fallocate(
                fd, _FALLOC_FL_COLLAPSE_RANGE, ctypes.c_long(0), ctypes.c_long(drop)
            )
            == 0
        ):
            return
        keep = limit // 2
        os.lseek(fd, max(0, size - keep), os.SEEK_SET)
        tail = os.read(fd, keep)
        os.pwrite(fd, tail, 0)
        os.ftruncate(fd, len(tail))
    finally:
        os.close(fd)


async def bound_console(paths: tuple[Path, ...], limit: int) -> None:
    """Run until cancelled: keep each of ``paths`` within ``limit`` bytes (see
    :func:`bound_file`)."""
    while True:
        await asyncio.sleep(CONSOLE_CHECK_INTERVAL_S)
        for path in paths:
            try:
                bound_file(path, limit)
            except OSError:
                pass

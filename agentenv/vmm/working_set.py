"""Reading ahead the part of a snapshot's RAM a restored guest touches first.

A restore maps the guest's RAM file and the guest faults pages in as it touches them.
QEMU runs with ``MADV_RANDOM`` on that mapping (``ram_advice.c``), so a first touch reads
the one page it needs: the host's page cache then holds what the guest uses (21 MiB for a
sandbox that answered a command, against 138 MiB with QEMU's own huge-page advice, which
reads 2 MiB around every touch). But a page read on a fault is a synchronous 4 KiB read:
from create to a command's output took 740 ms against 430 ms.

So the pages of its RAM file that the first machine restored from a snapshot has in the
page cache a few seconds after it started (its working set) are recorded once
(:meth:`WorkingSets.record`), and every later restore from that snapshot asks the kernel
to read them (``posix_fadvise(WILLNEED)``: asynchronous, in large requests, single
pages in the cache) while QEMU starts (the driver, with :meth:`WorkingSets.extents` and
:func:`read_ahead`).

Records are small files under one directory of the node, named by the snapshot RAM
file's identity (device, inode, size, modification time): snapshot files are never
rewritten in place, so a record can only describe the file it was made from, and a
file that changed (a paused sandbox's own RAM, resumed and written since) finds none.
Owns that directory; knows nothing of sandboxes or snapshots beyond a file's path.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import mmap
import os
import re
import threading
from pathlib import Path

log = logging.getLogger("agentenv.vmm")

PAGE = mmap.PAGESIZE
#: Resident runs closer than this many pages are read as one: a request costs more
#: than the few pages between them.
MERGE_GAP_PAGES = 2
#: Records kept at most; the oldest go first (each is a few KiB).
MAX_RECORDS = 2048
#: Records kept parsed in memory.
PARSED_KEPT = 64

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value

Extents = list[tuple[int, int]]


def resident_extents(path: Path) -> Extents:
    """Runs of ``path``'s pages in the page cache, as (first page, pages), nearby runs
    merged. Maps the file without touching it (``mincore``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return []
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = (size + PAGE - 1) // PAGE
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            resident = bytes(vector)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return _runs(resident)


#: mincore's bytes mapped to their low bit, "resident" (the other bits are reserved).
_LOW_BIT = bytes(value & 1 for value in range(256))
_RESIDENT_RUN = re.compile(b"\x01+")


def _runs(resident: bytes) -> Extents:
    """(first, count) runs of resident pages, runs at most :data:`MERGE_GAP_PAGES`
    apart merged (in C: a 512 MiB file's vector takes about a millisecond)."""
    extents: Extents = []
    for run in _RESIDENT_RUN.finditer(resident.translate(_LOW_BIT)):
        start, end = run.span()
        if extents and start - sum(extents[-1]) <= MERGE_GAP_PAGES:
            start = extents.pop()[0]
        extents.append((start, end - start))
    return extents


def read_ahead(path: Path, extents: Extents) -> int:
    """Ask the kernel to read ``extents`` of ``path`` into the page cache; returns the
    bytes asked for. The reads run in the background once submitted."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    asked = 0
    try:
        for first, count in extents:
            os.posix_fadvise(fd, first * PAGE, count * PAGE, os.POSIX_FADV_WILLNEED)
            asked += count * PAGE
    finally:
        os.close(fd)
    return asked


class WorkingSets:
    """The node's records of what restored guests touched first, under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # Records never change once written: the last ones read, kept parsed (a create
        # looks its source's up on the event loop).
        self._parsed: dict[str, Extents] = {}

    def key(self, source: Path) -> str | None:
        """The name ``source``'s record has (or would have) now; None if it is gone."""
        try:
            st = source.stat()
        except OSError:
            return None
        return f"{st.st_dev:x}-{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"

    def extents(self, key: str) -> Extents | None:
        """The pages recorded as ``key``'s working set; None without a record (an
        unreadable one is dropped)."""
        parsed = self._parsed.get(key)
        if parsed is not None:
            return parsed
        record = self.directory / key
        try:
            text = record.read_text()
            parsed = [(int(a), int(b)) for a, b in json.loads(text)["extents"]]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("working set %s unreadable, dropped: %s", record, exc)
            with contextlib.suppress(OSError):
                record.unlink()
            return None
        if len(self._parsed) >= PARSED_KEPT:
            self._parsed.pop(next(iter(self._parsed)))
        self._parsed[key] = parsed
        return parsed

    def has(self, key: str) -> bool:
        return (self.directory / key).exists()

    def record(self, key: str, ram_file: Path) -> int:
        """Record as ``key``'s working set the pages of ``ram_file`` now in the page
        cache, unless a record exists; returns the bytes recorded (0 if it existed)."""
        record = self.directory / key
        if record.exists():
            return 0
        extents = resident_extents(ram_file)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Two sandboxes of one snapshot may record at once, from two threads.
        temporary = record.with_name(f".{record.name}.{os.getpid()}.{threading.get_ident()}")
        temporary.write_text(json.dumps({"page_size": PAGE, "extents": extents}))
        os.replace(temporary, record)
        self._prune()
        return sum(count for _, count in extents) * PAGE

    def _prune(self) -> None:
        try:
            records = [p for p in self.directory.iterdir() if not p.name.startswith(".")]
        except OSError:
            return
        if len(records) <= MAX_RECORDS:
            return
        records.sort(key=lambda p: p.stat().st_mtime if p.exists() else 0)
        for stale in records[: len(records) - MAX_RECORDS]:
            with contextlib.suppress(OSError):
                stale.unlink()

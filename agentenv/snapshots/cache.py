"""A bounded node-local cache of pulled snapshot files, evicted least recently used first.

Entries live under ``<root>/entries/`` (or elsewhere under ``<root>``, when a caller
needs its own layout); ``<root>/index.json`` records each entry's path, allocated size
and last use, and is replaced atomically after every change, so a restarted node finds
its cache as it left it. The cache does not know which entries are
in use: :meth:`NodeCache.make_room` asks the caller (``pinned``) and never evicts those.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger(__name__)

INDEX = "index.json"
ENTRIES = "entries"
_MAX_NAME = 200


class CacheFull(Exception):
    """Not enough unpinned entries to evict to make the room asked for."""


@dataclass
class _Entry:
    path: str  # relative to the cache root
    size: int
    seq: int  # LRU order: higher is more recent
    used_at: float


def allocated_bytes(path: Path) -> int:
    """Bytes ``path`` occupies on disk (a sparse file's holes are free), summed over a
    directory tree with each hard-linked inode counted once; symlinks are not followed."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [path]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        ident = (st.st_dev, st.st_ino)
        if ident in seen:
            continue
        seen.add(ident)
        total += st.st_blocks * 512
        if os.path.isdir(p) and not os.path.islink(p):
            with os.scandir(p) as it:
                stack.extend(Path(e.path) for e in it)
    return total


class NodeCache:
    """LRU bookkeeping over files and directories under ``root``, bounded by
    ``limit_bytes`` of allocated space."""

    def __init__(self, root: Path, limit_bytes: int) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self._entries: dict[str, _Entry] = {}
        self._seq = 0

    # Index ------------------------------------------------------------------------

    def load(self) -> None:
        """Read the index; drop entries whose files are gone, and delete anything under
        ``entries/`` the index does not know (left by a crash before :meth:`add`)."""
        (self.root / ENTRIES).mkdir(parents=True, exist_ok=True)
        self._entries = {}
        self._seq = 0
        try:
            doc = json.loads((self.root / INDEX).read_text())
            self._seq = int(doc.get("seq", 0))
            for key, e in doc.get("entries", {}).items():
                self._entries[key] = _Entry(
                    str(e["path"]), int(e["size"]), int(e["seq"]), float(e["used_at"])
                )
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("%s: unreadable cache index, starting empty: %s", self.root, exc)
            self._entries = {}
        changed = False
        for key, entry in list(self._entries.items()):
            if not _valid_rel(entry.path) or not os.path.lexists(self.root / entry.path):
                del self._entries[key]
                changed = True
        self._seq = max([self._seq, *(e.seq for e in self._entries.values())])
        # Top-level names under entries/ that some entry is or is inside.
        known = {
            parts[1]
            for parts in (Path(e.path).parts for e in self._entries.values())
            if parts[0] == ENTRIES
        }
        for child in (self.root / ENTRIES).iterdir():
            if child.name not in known:
                log.info("%s: removing unindexed cache entry %s", self.root, child.name)
                _delete(child)
        if changed:
            self._save()

    def _save(self) -> None:
        doc = {
            "seq": self._seq,
            "entries": {
                k: {"path": e.path, "size": e.size, "seq": e.seq, "used_at": e.used_at}
                for k, e in self._entries.items()
            },
        }
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / INDEX
        tmp = final.with_name(f".{INDEX}.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # Entries ----------------------------------------------------------------------

    def path_for(self, key: str) -> Path:
        """Where the entry for ``key`` belongs: a single path component under
        ``entries/`` derived from the key."""
        safe = quote(key, safe="")
        if not safe or len(safe) > _MAX_NAME:
            safe = "+" + hashlib.sha256(key.encode()).hexdigest()
        elif safe.startswith("."):  # "." and ".." are not names; hidden ones look stray
            safe = "%2E" + safe[1:]
        return self.root / ENTRIES / safe

    def add(self, key: str, path: Path) -> None:
        """Register ``path`` (an existing file or directory inside the cache root, usually
        :meth:`path_for` ``(key)``) as the entry for ``key``, measuring its allocated
        size; it counts as just used. An earlier entry for ``key`` at another path is
        deleted."""
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            raise ValueError(f"{path} is not inside the cache {self.root}") from None
        if not _valid_rel(str(rel)):
            raise ValueError(f"{path} cannot be a cache entry of {self.root}")
        if not os.path.lexists(path):
            raise FileNotFoundError(f"cache entry {path} does not exist")
        old = self._entries.get(key)
        self._seq += 1
        self._entries[key] = _Entry(str(rel), allocated_bytes(path), self._seq, time.time())
        self._save()
        if old is not None and old.path != str(rel):
            _delete(self.root / old.path)

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used (KeyError if it is not cached)."""
        entry = self._entries[key]
        self._seq += 1
        entry.seq = self._seq
        entry.used_at = time.time()
        self._save()

    def get(self, key: str) -> Path | None:
        """The entry's path, marked as just used; None if it is not cached (or its files
        disappeared)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        path = self.root / entry.path
        if not os.path.lexists(path):
            del self._entries[key]
            self._save()
            return None
        self.touch(key)
        return path

    def peek(self, key: str) -> Path | None:
        """The entry's path without marking it used; None if it is not cached."""
        entry = self._entries.get(key)
        return None if entry is None else self.root / entry.path

    def remove(self, key: str) -> None:
        """Forget ``key`` and delete its files (no error if it is not cached)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        # Index first: a crash in between leaves an unindexed path, which load() deletes.
        self._save()
        _delete(self.root / entry.path)

    def used_bytes(self) -> int:
        return sum(e.size for e in self._entries.values())

    def keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        return [k for k, _ in sorted(self._entries.items(), key=lambda kv: kv[1].seq)]

    def make_room(self, needed: int, pinned: Callable[[], set[str]]) -> list[str]:
        """Evict least recently used entries not in ``pinned()`` (asked again after each
        eviction) until ``needed`` more bytes fit within the limit. Returns the evicted
        keys; :class:`CacheFull` if the room cannot be made, before evicting anything when
        that is already clear."""
        pins = pinned()
        evictable = sum(e.size for k, e in self._entries.items() if k not in pins)
        if self.used_bytes() - evictable + needed > self.limit_bytes:
            raise self._full(needed, pins)
        evicted: list[str] = []
        while self.used_bytes() + needed > self.limit_bytes:
            victim = next((k for k in self.keys() if k not in pins), None)
            if victim is None:
                raise self._full(needed, pins)
            self.remove(victim)
            evicted.append(victim)
            pins = pinned()
        return evicted

    def _full(self, needed: int, pins: set[str]) -> CacheFull:
        pinned_bytes = sum(e.size for k, e in self._entries.items() if k in pins)
        return CacheFull(
            f"node cache {self.root}: cannot make room for {needed} bytes: "
            f"{self.used_bytes()} of {self.limit_bytes} bytes used, {pinned_bytes} pinned"
        )


def _valid_rel(rel: str) -> bool:
    """Whether ``rel`` names something inside the root that may be an entry (not the
    root, not the index, nothing reached through "..")."""
    parts = Path(rel).parts
    return (
        bool(parts)
        and not Path(rel).is_absolute()
        and ".." not in parts
        and parts not in ((INDEX,), (ENTRIES,))
        and not parts[0].startswith(f".{INDEX}")
    )


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

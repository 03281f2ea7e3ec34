"""Directory watchers over Linux inotify (through ctypes: the guest has no third-party
watcher library), with E2B's event model.

inotify events map to E2B event types the way Go's fsnotify (which E2B's envd uses) maps
them: IN_CREATE and IN_MOVED_TO are CREATE, IN_MODIFY is WRITE, IN_DELETE is REMOVE,
IN_MOVED_FROM is RENAME (under the old name) and IN_ATTRIB is CHMOD. Event names are
relative to the watched directory. A recursive watcher adds a watch for every directory
created or moved into its tree.

Uploads are staged in a hidden file beside the target and renamed over it (see
``files``). Watchers hide the staging files and report the final rename as what a
watcher of E2B's envd sees: that envd opens the target with O_CREAT|O_TRUNC, chowns it to
the user and writes, so a new file gives CREATE, CHMOD, WRITE (no WRITE if it is empty)
and a replaced one CHMOD, WRITE. Whether the target existed is part of the staging file's
name, since the rename does not say.

A watcher made for a user adds its watches with that user's permissions
(``fsaccess.call_as``): inotify_add_watch needs read permission on the directory, checked
against the calling thread's credentials, so a recursive watch skips the subdirectories
the user may not read and reports no names from inside them.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from .fsaccess import call_as
from .users import OSUser

logger = logging.getLogger("agentenv.envd")

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_DONT_FOLLOW
)
#: Name prefix of upload staging files; watchers never report them.
STAGING_PREFIX = ".envd-upload-"
#: What follows the prefix: whether the upload creates its target or replaces it.
_STAGING_CREATES = "n"
_STAGING_REPLACES = "r"
#: Staging renames remembered per watcher (cookies whose MOVED_TO has not arrived).
_MAX_PENDING_COOKIES = 1024
_EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
_READ_SIZE = 64 * 1024

#: Filesystem types that are network mounts (watching them needs allowNetworkMounts).
NETWORK_FS_TYPES = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "fuse.sshfs", "afs", "ncpfs"}
)


class EventType(IntEnum):
    """E2B's ``filesystem.EventType`` numbers."""

    CREATE = 1
    WRITE = 2
    REMOVE = 3
    RENAME = 4
    CHMOD = 5


@dataclass(frozen=True, slots=True)
class WatchEvent:
    #: Path relative to the watched directory.
    name: str
    type: EventType
    #: Absolute path, for building the entry.
    path: str


def staging_name(unique: str, *, replaces: bool) -> str:
    """The name of an upload's staging file (``unique``: random, for this upload)."""
    return STAGING_PREFIX + (_STAGING_REPLACES if replaces else _STAGING_CREATES) + unique


class WatchError(OSError):
    """The directory cannot be watched."""


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise WatchError(err, f"{what}: {os.strerror(err)}")
    return result


def is_network_mount(path: str) -> bool:
    """Whether ``path`` lies on a network filesystem (per /proc/self/mountinfo)."""
    best, best_type = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields:
                    continue
                mount_point = fields[4].encode().decode("unicode_escape")
                fs_type = fields[fields.index("-") + 1]
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fs_type
    except OSError:
        return False
    return best_type in NETWORK_FS_TYPES


def _is_empty(path: str) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_size == 0
    except OSError:
        return False  # already gone again: report what the upload most likely did


class DirectoryWatcher:
    """One inotify instance following a directory (and, if recursive, its subtree).

    Events go to ``sink`` from the event loop; call :meth:`close` to stop.
    """

    def __init__(
        self,
        root: str,
        *,
        recursive: bool,
        sink: Callable[[WatchEvent], None],
        user: OSUser | None = None,
    ) -> None:
        """``user``: whose permissions the watches are added with (None: envd's own)."""
        self.root = root
        self.recursive = recursive
        self._sink = sink
        self._user = user
        self._loop = asyncio.get_running_loop()
        self._fd = _check(_libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
        #: wd -> directory path relative to root ("" for the root).
        self._dirs: dict[int, str] = {}
        #: Rename cookies of staging files moved away (to their upload target), and
        #: whether that upload replaces its target.
        self._staging_cookies: dict[int, bool] = {}
        self._closed = False
        try:
            self._follow(root, "", subtree=recursive)
        except BaseException:
            os.close(self._fd)
            raise
        self._loop.add_reader(self._fd, self._readable)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        os.close(self._fd)  # drops every watch
        self._dirs.clear()

    # -- watches -------------------------------------------------------------------

    def _follow(self, path: str, relative: str, *, subtree: bool) -> None:
        """Watch ``path`` (and every directory below it if ``subtree``) as the user."""

        def add() -> None:
            self._add(path, relative)
            if subtree:
                self._add_subtree(path, relative)

        if self._user is None:
            add()
        else:
            call_as(self._user, add)

    def _add(self, path: str, relative: str) -> None:
        wd = _check(
            _libc.inotify_add_watch(self._fd, os.fsencode(path), WATCH_MASK),
            f"inotify_add_watch {path!r}",
        )
        self._dirs[wd] = relative

    def _add_subtree(self, path: str, relative: str) -> None:
        try:
            with os.scandir(path) as entries:
                children = [e for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            return  # vanished or unreadable: nothing to follow
        for child in children:
            child_relative = os.path.join(relative, child.name) if relative else child.name
            try:
                self._add(child.path, child_relative)
            except WatchError as e:
                if e.errno == errno.ENOSPC:
                    logger.warning("inotify watch limit reached; %s is not watched", child.path)
                continue
            self._add_subtree(child.path, child_relative)

    def _drop_subtree(self, relative: str) -> None:
        prefix = relative + "/"
        for wd, path in list(self._dirs.items()):
            if path == relative or path.startswith(prefix):
                del self._dirs[wd]
                _libc.inotify_rm_watch(self._fd, wd)

    # -- events --------------------------------------------------------------------

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, _READ_SIZE)
        except BlockingIOError:
            return
        except OSError as e:
            logger.warning("reading inotify events failed: %s", e)
            return
        offset = 0
        while offset + _EVENT_HEADER.size <= len(data):
            wd, mask, cookie, length = _EVENT_HEADER.unpack_from(data, offset)
            offset += _EVENT_HEADER.size
            raw_name = data[offset : offset + length].rstrip(b"\0")
            offset += length
            self._handle(wd, mask, cookie, os.fsdecode(raw_name))

    def _handle(self, wd: int, mask: int, cookie: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            logger.warning("inotify queue overflowed for %s; events were lost", self.root)
            return
        if mask & IN_IGNORED:
            self._dirs.pop(wd, None)
            return
        directory = self._dirs.get(wd)
        if directory is None or not name:
            return  # *_SELF events: the parent's watch reports them by name
        relative = os.path.join(directory, name) if directory else name
        absolute = os.path.join(self.root, relative)
        is_dir = bool(mask & IN_ISDIR)
        if name.startswith(STAGING_PREFIX) and not is_dir:
            if mask & IN_MOVED_FROM and cookie:
                if len(self._staging_cookies) >= _MAX_PENDING_COOKIES:
                    self._staging_cookies.clear()
                replaces = name[len(STAGING_PREFIX) :].startswith(_STAGING_REPLACES)
                self._staging_cookies[cookie] = replaces
            return
        if mask & IN_MOVED_TO and cookie in self._staging_cookies:
            replaces = self._staging_cookies.pop(cookie)
            if not replaces:
                self._emit(relative, EventType.CREATE, absolute)
            self._emit(relative, EventType.CHMOD, absolute)
            # Truncating the file it replaces is a write; a new file is written to only
            # if the upload had data.
            if replaces or not _is_empty(absolute):
                self._emit(relative, EventType.WRITE, absolute)
            return

        if mask & (IN_CREATE | IN_MOVED_TO):
            if is_dir and self.recursive:
                try:
                    self._follow(absolute, relative, subtree=True)
                except WatchError:
                    pass  # already gone again, or not the user's to read
            self._emit(relative, EventType.CREATE, absolute)
        if mask & IN_MODIFY:
            self._emit(relative, EventType.WRITE, absolute)
        if mask & IN_ATTRIB:
            self._emit(relative, EventType.CHMOD, absolute)
        if mask & IN_MOVED_FROM:
            if is_dir and self.recursive:
                self._drop_subtree(relative)
            self._emit(relative, EventType.RENAME, absolute)
        if mask & IN_DELETE:
            if is_dir and self.recursive:
                self._drop_subtree(relative)
            self._emit(relative, EventType.REMOVE, absolute)

    def _emit(self, relative: str, event_type: EventType, absolute: str) -> None:
        try:
            self._sink(WatchEvent(relative, event_type, absolute))
        except Exception:
            logger.exception("watch event sink failed")

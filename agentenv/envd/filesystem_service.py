"""``filesystem.Filesystem``: Stat, ListDir, MakeDir, Move, Remove and the directory
watchers (WatchDir streams; CreateWatcher/GetWatcherEvents/RemoveWatcher poll) over the
guest's filesystem, with E2B's envd error codes (section 4.6 of the protocol reference).

envd runs as root, but every RPC touches the filesystem with the request user's
permissions (``fsaccess``, the mechanism the /files routes use): a request as
``user`` cannot stat, list, move or remove what that user could not, directories it makes
belong to that user, and watchers see only what that user may read. EACCES and EPERM
answer ``permission_denied``, which the SDK raises as a SandboxException. (Go's envd does
these as root.) Paths are resolved for the request's user (``~``, relative paths).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import secrets
import shutil
import stat
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt import Timestamp

from .fsaccess import call_as, run_as
from .gen import filesystem_connect, filesystem_pb
from .process_service import keepalive_interval, request_user
from .state import EnvdState
from .users import OSUser, group_name, owner_name
from .watchers import DirectoryWatcher, EventType, WatchError, WatchEvent, is_network_mount

logger = logging.getLogger("agentenv.envd")

_Ctx = RequestContext[Any, Any]

METADATA_XATTR_PREFIX = "user.e2b."
#: Events a polled watcher keeps between GetWatcherEvents calls; older ones are dropped.
WATCHER_EVENT_CAPACITY = 10_000
#: Polled watchers at once (each holds an inotify instance; the kernel default limit
#: is 128 per user).
MAX_POLLED_WATCHERS = 64
#: Event types whose FilesystemEvent carries the entry when includeEntry is set.
_ENTRY_EVENTS = frozenset({EventType.CREATE, EventType.WRITE, EventType.CHMOD})


def go_mode_string(mode: int) -> str:
    """``st_mode`` rendered like Go's ``FileMode.String()``, e.g. ``drwxr-xr-x``."""
    # Go's type letters, in its order ("dalTLDpSugct?"), for what a Unix stat can have.
    flags = (
        ("d", stat.S_ISDIR(mode)),
        ("L", stat.S_ISLNK(mode)),
        ("D", stat.S_ISBLK(mode) or stat.S_ISCHR(mode)),
        ("p", stat.S_ISFIFO(mode)),
        ("S", stat.S_ISSOCK(mode)),
        ("u", bool(mode & stat.S_ISUID)),
        ("g", bool(mode & stat.S_ISGID)),
        ("c", stat.S_ISCHR(mode)),
        ("t", bool(mode & stat.S_ISVTX)),
    )
    kind = "".join(letter for letter, present in flags if present) or "-"
    perms = "".join(char if mode & (1 << (8 - i)) else "-" for i, char in enumerate("rwxrwxrwx"))
    return kind + perms


def _file_type(mode: int) -> Any:
    if stat.S_ISDIR(mode):
        return filesystem_pb.FileType.DIRECTORY
    if stat.S_ISREG(mode):
        return filesystem_pb.FileType.FILE
    return filesystem_pb.FileType.UNSPECIFIED


def entry_info(path: str, name: str | None = None) -> filesystem_pb.EntryInfo:
    """Describe ``path`` (absolute). A symlink gets its target's type, plus the target."""
    info = os.lstat(path)
    file_type = _file_type(info.st_mode)
    symlink_target: str | None = None
    is_symlink = stat.S_ISLNK(info.st_mode)
    if is_symlink:
        symlink_target = os.path.realpath(path)
        try:
            file_type = _file_type(os.stat(path).st_mode)
        except OSError:
            file_type = filesystem_pb.FileType.UNSPECIFIED  # dangling link
    return filesystem_pb.EntryInfo(
        name=name if name is not None else (os.path.basename(path) or path),
        type=file_type,
        path=path,
        size=info.st_size,
        mode=stat.S_IMODE(info.st_mode) & 0o777,
        permissions=go_mode_string(info.st_mode),
        owner=owner_name(info.st_uid),
        group=group_name(info.st_gid),
        modified_time=Timestamp(
            seconds=info.st_mtime_ns // 1_000_000_000, nanos=info.st_mtime_ns % 1_000_000_000
        ),
        symlink_target=symlink_target,
        metadata=read_metadata(path),
        is_symlink=is_symlink,
    )


def read_metadata(path: str) -> dict[str, str]:
    """The ``user.e2b.*`` extended attributes of ``path``, keyed without the prefix."""
    metadata: dict[str, str] = {}
    try:
        names = os.listxattr(path)
    except OSError:
        return metadata  # no xattr support, dangling link, ...
    for name in names:
        if name.startswith(METADATA_XATTR_PREFIX):
            try:
                value = os.getxattr(path, name)
            except OSError:
                continue
            metadata[name[len(METADATA_XATTR_PREFIX) :]] = value.decode("utf-8", "replace")
    return metadata


def _os_error(e: OSError, path: str) -> ConnectError:
    if e.errno == errno.ENOENT:
        return ConnectError(Code.NOT_FOUND, f"path {path!r} does not exist")
    if e.errno == errno.ENOTDIR:
        return ConnectError(Code.INVALID_ARGUMENT, f"path {path!r} is not a directory")
    if e.errno in (errno.EACCES, errno.EPERM):
        return ConnectError(Code.PERMISSION_DENIED, f"{path!r}: {e.strerror}")
    if e.errno == errno.ENOSPC:
        return ConnectError(Code.RESOURCE_EXHAUSTED, f"{path!r}: {e.strerror}")
    return ConnectError(Code.INTERNAL, f"{path!r}: {e.strerror or e}")


def _make_dirs(path: str) -> None:
    """``mkdir -p``; runs as the user, so the kernel makes what it creates theirs."""
    missing: list[str] = []
    current = path
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        os.mkdir(directory, 0o755)


# The RPCs' filesystem work, each run whole as the request's user: inline on the event
# loop (fsaccess.call_as) when it touches one path, on a file worker (fsaccess.run_as)
# when it walks a tree. A path the user may not search fails with EACCES there, so these
# stat explicitly where os.path.exists() and friends would take EACCES for "missing".


def _list_dir(path: str, depth: int) -> list[filesystem_pb.EntryInfo]:
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        os.lstat(path)  # raises ENOENT for a missing path; a dangling link is no directory
        is_dir = False
    if not is_dir:
        raise ConnectError(Code.INVALID_ARGUMENT, f"path {path!r} is not a directory")
    entries: list[filesystem_pb.EntryInfo] = []
    _walk(path, depth, entries)
    return entries


def _walk(directory: str, depth: int, out: list[filesystem_pb.EntryInfo]) -> None:
    with os.scandir(directory) as it:
        children = sorted(it, key=lambda d: d.name)
    for child in children:
        try:
            out.append(entry_info(child.path, child.name))
        except FileNotFoundError:
            continue  # removed while listing
        if depth > 1 and child.is_dir(follow_symlinks=False):
            try:
                _walk(child.path, depth - 1, out)
            except PermissionError:
                continue


def _make_dir(path: str) -> filesystem_pb.EntryInfo:
    if os.path.isdir(path):
        raise ConnectError(Code.ALREADY_EXISTS, f"directory {path!r} already exists")
    if os.path.lexists(path):
        raise ConnectError(Code.INVALID_ARGUMENT, f"path {path!r} exists and is not a directory")
    _make_dirs(path)
    return entry_info(path)


def _move(source: str, destination: str) -> filesystem_pb.EntryInfo:
    try:
        os.lstat(source)
    except FileNotFoundError:
        raise ConnectError(Code.NOT_FOUND, f"path {source!r} does not exist") from None
    except OSError as e:
        raise _os_error(e, source) from None
    _make_dirs(os.path.dirname(destination))
    _rename(source, destination)
    return entry_info(destination)


class _CrossDevice(Exception):
    """A move needs copying across filesystems, which is left to a file worker."""


def _move_across(source: str, destination: str) -> filesystem_pb.EntryInfo:
    shutil.move(source, destination)
    return entry_info(destination)


def _rename(source: str, destination: str) -> None:
    """``shutil.move(source, destination)`` as far as a rename goes; raises _CrossDevice
    where shutil would copy. Only EXDEV may lead to a copy: shutil copies after any
    failed rename, so a user who may read a file but not move it (EACCES) would be left
    holding a copy of it."""
    target = destination
    if os.path.isdir(destination):
        try:
            same = os.path.samefile(source, destination) and not os.path.islink(source)
        except OSError:
            same = False
        if not same:  # into the directory, as shutil.move does
            target = os.path.join(destination, os.path.basename(source.rstrip(os.sep)))
            if os.path.exists(target):
                raise shutil.Error(f"Destination path '{target}' already exists")
    try:
        os.rename(source, target)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        raise _CrossDevice from None


def _remove(path: str) -> bool:
    """Remove ``path`` unless it is a directory; True when it is one (a tree to remove
    with _remove_tree on a file worker)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            return True
        os.remove(path)
    except FileNotFoundError:
        pass  # removing what is not there succeeds, as os.RemoveAll does
    return False


def _remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass


class PolledWatcher:
    """A watcher created by CreateWatcher: buffers events until GetWatcherEvents."""

    def __init__(self, root: str, recursive: bool, include_entry: bool, user: OSUser) -> None:
        self.include_entry = include_entry
        self.user = user
        self.events: collections.deque[filesystem_pb.FilesystemEvent] = collections.deque(
            maxlen=WATCHER_EVENT_CAPACITY
        )
        self.watcher = DirectoryWatcher(root, recursive=recursive, sink=self._add, user=user)

    def _add(self, event: WatchEvent) -> None:
        self.events.append(filesystem_event(event, self.include_entry, self.user))

    def drain(self) -> list[filesystem_pb.FilesystemEvent]:
        events = list(self.events)
        self.events.clear()
        return events


def filesystem_event(
    event: WatchEvent, include_entry: bool, user: OSUser
) -> filesystem_pb.FilesystemEvent:
    """The event for the wire; its entry is described as ``user`` may see it (on the
    calling thread: this runs on the event loop, synchronously)."""
    entry: filesystem_pb.EntryInfo | None = None
    if include_entry and event.type in _ENTRY_EVENTS:
        try:
            entry = call_as(user, entry_info, event.path)
        except OSError:
            entry = None  # already gone again, or not the user's to see
    return filesystem_pb.FilesystemEvent(
        name=event.name, type=filesystem_pb.EventType(int(event.type)), entry=entry
    )


def _check_watchable(path: str) -> None:
    """Runs as the user: the path must be a directory they can read."""
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    os.close(fd)


class FilesystemService(filesystem_connect.Filesystem):  # type: ignore[misc]
    """Implements every ``filesystem.Filesystem`` RPC."""

    def __init__(self, state: EnvdState) -> None:
        self._state = state
        self._watchers: dict[str, PolledWatcher] = {}

    def close(self) -> None:
        for polled in self._watchers.values():
            polled.watcher.close()
        self._watchers.clear()

    def _resolve(self, path: str, ctx: _Ctx) -> tuple[str, OSUser]:
        user = request_user(self._state, ctx)
        return self._state.resolve_path(path, user), user

    async def stat(self, request: filesystem_pb.StatRequest, ctx: _Ctx) -> Any:
        path, user = self._resolve(request.path, ctx)
        try:
            return filesystem_pb.StatResponse(entry=call_as(user, entry_info, path))
        except OSError as e:
            raise _os_error(e, path) from None

    async def list_dir(self, request: filesystem_pb.ListDirRequest, ctx: _Ctx) -> Any:
        path, user = self._resolve(request.path, ctx)
        depth = max(request.depth, 1)
        try:
            entries = await run_as(user, _list_dir, path, depth)
        except OSError as e:
            raise _os_error(e, path) from None
        return filesystem_pb.ListDirResponse(entries=entries)

    async def make_dir(self, request: filesystem_pb.MakeDirRequest, ctx: _Ctx) -> Any:
        path, user = self._resolve(request.path, ctx)
        try:
            return filesystem_pb.MakeDirResponse(entry=call_as(user, _make_dir, path))
        except OSError as e:
            raise _os_error(e, path) from None

    async def move(self, request: filesystem_pb.MoveRequest, ctx: _Ctx) -> Any:
        source, user = self._resolve(request.source, ctx)
        destination, _ = self._resolve(request.destination, ctx)
        try:
            try:
                entry = call_as(user, _move, source, destination)
            except _CrossDevice:
                entry = await run_as(user, _move_across, source, destination)
        except OSError as e:
            raise _os_error(e, destination) from None
        return filesystem_pb.MoveResponse(entry=entry)

    async def remove(self, request: filesystem_pb.RemoveRequest, ctx: _Ctx) -> Any:
        path, user = self._resolve(request.path, ctx)
        try:
            if call_as(user, _remove, path):
                await run_as(user, _remove_tree, path)
        except OSError as e:
            raise _os_error(e, path) from None
        return filesystem_pb.RemoveResponse()

    # -- watchers ------------------------------------------------------------------

    async def _watch_target(
        self, path: str, allow_network_mounts: bool, ctx: _Ctx
    ) -> tuple[str, OSUser]:
        root, user = self._resolve(path, ctx)
        try:
            call_as(user, _check_watchable, root)
        except OSError as e:
            raise _os_error(e, root) from None
        if not allow_network_mounts and is_network_mount(root):
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"{root!r} is on a network mount; set allowNetworkMounts to watch it",
            )
        return root, user

    async def watch_dir(
        self, request: filesystem_pb.WatchDirRequest, ctx: _Ctx
    ) -> AsyncIterator[filesystem_pb.WatchDirResponse]:
        root, user = await self._watch_target(request.path, request.allow_network_mounts, ctx)
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        try:
            watcher = DirectoryWatcher(
                root, recursive=request.recursive, sink=queue.put_nowait, user=user
            )
        except WatchError as e:
            raise _os_error(e, root) from None
        keepalive_s = keepalive_interval(ctx)
        try:
            yield filesystem_pb.WatchDirResponse(
                event=Oneof("start", filesystem_pb.WatchDirResponse.StartEvent())
            )
            while True:
                try:
                    async with asyncio.timeout(keepalive_s):
                        event = await queue.get()
                except TimeoutError:
                    yield filesystem_pb.WatchDirResponse(
                        event=Oneof("keepalive", filesystem_pb.WatchDirResponse.KeepAlive())
                    )
                    continue
                yield filesystem_pb.WatchDirResponse(
                    event=Oneof("filesystem", filesystem_event(event, request.include_entry, user))
                )
        finally:
            watcher.close()

    async def create_watcher(self, request: filesystem_pb.CreateWatcherRequest, ctx: _Ctx) -> Any:
        root, user = await self._watch_target(request.path, request.allow_network_mounts, ctx)
        if len(self._watchers) >= MAX_POLLED_WATCHERS:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED, f"too many watchers (limit {MAX_POLLED_WATCHERS})"
            )
        try:
            polled = PolledWatcher(root, request.recursive, request.include_entry, user)
        except WatchError as e:
            raise _os_error(e, root) from None
        watcher_id = secrets.token_hex(8)
        self._watchers[watcher_id] = polled
        return filesystem_pb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self, request: filesystem_pb.GetWatcherEventsRequest, ctx: _Ctx
    ) -> Any:
        request_user(self._state, ctx)
        polled = self._watchers.get(request.watcher_id)
        if polled is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found")
        return filesystem_pb.GetWatcherEventsResponse(events=polled.drain())

    async def remove_watcher(self, request: filesystem_pb.RemoveWatcherRequest, ctx: _Ctx) -> Any:
        request_user(self._state, ctx)
        polled = self._watchers.pop(request.watcher_id, None)
        if polled is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found")
        polled.watcher.close()
        return filesystem_pb.RemoveWatcherResponse()

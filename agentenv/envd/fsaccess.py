"""File access with a user's permissions, for a root envd acting for that user.

envd runs as root, but a file request made as ``user`` must not read ``/root/secret`` or
write ``/etc``. Linux keeps credentials per thread: a thread that switches its
filesystem uid/gid (``setfsuid``/``setfsgid``) and supplementary groups is checked by the
kernel exactly as that user is for every path lookup, open, mkdir and rename, and the
files it creates are owned by the user. Switching the fsuid away from 0 also drops the
filesystem capabilities (CAP_DAC_OVERRIDE, CAP_FOWNER, ...) for that thread only.

So user file operations run on a small dedicated thread pool, each call switching the
worker's credentials before the operation and back after it. glibc's ``setgroups()``
would change every thread of the process, so the supplementary groups are set with the
raw system call, which (like setfsuid/setfsgid) touches only the calling thread.

:func:`call_as` is the one switch, used by the /files routes, every filesystem RPC and the
directory watchers. Besides the file workers it also runs on the event loop's thread, for
operations that touch one path (Stat, MakeDir, a rename, unlinking a file) and for the
watchers' inotify callbacks: under TCG, handing a call to a worker and back cost about
3 ms in the guest, the switch and restore about 0.4 ms. The switch, the operation and the
restore are one synchronous call there, so no other request's code runs on that thread
while it holds a user's credentials. What may take long (a listing, removing a tree,
anything streaming) goes to the workers, so it does not hold up other requests.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .users import OSUser

logger = logging.getLogger("agentenv.envd")

T = TypeVar("T")

#: __NR_setgroups per architecture (the only per-thread way to set supplementary groups).
_SETGROUPS_SYSCALL = {"x86_64": 116, "aarch64": 159, "riscv64": 159}
#: Enough threads that a slow disk does not serialise every transfer.
FILE_WORKERS = 4


class AccessSwitchError(OSError):
    """The worker thread could not take on (or give back) a user's credentials."""


_libc = ctypes.CDLL(None, use_errno=True)
_executor = ThreadPoolExecutor(max_workers=FILE_WORKERS, thread_name_prefix="envd-files")


def _set_thread_groups(groups: tuple[int, ...] | list[int]) -> None:
    number = _SETGROUPS_SYSCALL.get(platform.machine())
    if number is None:
        raise AccessSwitchError(f"cannot switch groups per thread on {platform.machine()}")
    array = (ctypes.c_uint * max(len(groups), 1))(*groups)
    if _libc.syscall(ctypes.c_long(number), ctypes.c_size_t(len(groups)), array) != 0:
        err = ctypes.get_errno()
        raise AccessSwitchError(err, f"setgroups: {os.strerror(err)}")


def _set_fs_ids(uid: int, gid: int) -> None:
    # setfs[ug]id return the previous id and cannot report errors; calling again with
    # the same value and reading back what is now in effect is the documented check.
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    if _libc.setfsgid(gid) != gid or _libc.setfsuid(uid) != uid:
        raise AccessSwitchError(f"setfsuid/setfsgid to {uid}:{gid} did not take effect")


def call_as(user: OSUser, operation: Callable[..., T], *args: object) -> T:
    """Run ``operation(*args)`` on the calling thread with ``user``'s filesystem
    permissions, and give the thread envd's own back afterwards. It must not yield to
    other work (no event loop iteration inside): the credentials belong to the thread."""
    euid = os.geteuid()
    if user.uid == euid and (euid != 0 or user.gid == 0):
        return operation(*args)  # already this user (or root acting as root)
    if euid != 0:
        raise PermissionError(f"envd is not root, so it cannot access files as {user.name!r}")
    saved_groups = os.getgroups()
    try:
        _set_thread_groups(user.groups)
        _set_fs_ids(user.uid, user.gid)
        return operation(*args)
    finally:
        try:
            _set_fs_ids(0, os.getegid())
            _set_thread_groups(saved_groups)
        except AccessSwitchError:
            # A worker stuck with a user's credentials would apply them to the next
            # request; stopping envd (it is restarted) is the only safe answer.
            logger.critical("could not restore file-access credentials; exiting")
            os._exit(70)


async def run_as(user: OSUser, operation: Callable[..., T], *args: object) -> T:
    """Run ``operation(*args)`` on a file worker with ``user``'s filesystem permissions."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(call_as, user, operation, *args))


async def run_io(operation: Callable[..., T], *args: object) -> T:
    """Run blocking I/O on an already-open fd off the event loop (no credential switch:
    the kernel checked permissions when the fd was opened)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(operation, *args))

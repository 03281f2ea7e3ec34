"""Reading a file for ``GET /files``: a regular file by byte range, anything whose size
says nothing (procfs and sysfs files, pipes, character devices) until EOF, and sending
the chunks while watching for the client to go away.

Regular files are read on the file workers (``fsaccess.run_io``); pipes and devices on
the event loop once they poll readable, so a pipe that never ends holds no worker.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from .fsaccess import run_io

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Read/write granularity (uploads' too); also the most a single gzip step may inflate to.
CHUNK_SIZE = 256 * 1024
#: gzip level for downloads: cheap on the guest's CPU, still most of the gain on text.
GZIP_LEVEL = 1


@dataclass(frozen=True, slots=True)
class Source:
    fd: int
    #: Bytes to send, or None to read until EOF: what procfs and sysfs files (whose
    #: size says 0 or a page whatever they hold), pipes and devices need.
    size: int | None
    #: A pipe or character device: wait for data on the event loop rather than block a
    #: file worker on a read that may never return.
    pollable: bool


def open_for_reading(path: str) -> Source:
    """Open a file to download (runs as the user)."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it has no effect on
    # regular files.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    except BaseException:
        os.close(fd)
        raise
    # A regular file with data blocks has the size it says. Pseudo-files have no
    # blocks; an empty or fully sparse regular file read to EOF loses nothing either.
    sized = stat.S_ISREG(info.st_mode) and info.st_size > 0 and info.st_blocks > 0
    pollable = stat.S_ISFIFO(info.st_mode) or stat.S_ISCHR(info.st_mode)
    return Source(fd, info.st_size if sized else None, pollable)


async def file_range(fd: int, start: int, end: int) -> AsyncIterator[bytes]:
    """Bytes [start, end) of a regular file."""
    offset = start
    while offset < end:
        chunk = await run_io(os.pread, fd, min(CHUNK_SIZE, end - offset), offset)
        if not chunk:
            return  # the file shrank while we were sending it
        offset += len(chunk)
        yield chunk


async def file_to_eof(fd: int) -> AsyncIterator[bytes]:
    """A file that does not know its size (procfs, sysfs), read until EOF."""
    while chunk := await run_io(os.read, fd, CHUNK_SIZE):
        yield chunk


async def pipe_to_eof(fd: int) -> AsyncIterator[bytes]:
    """A pipe or character device until EOF. Before reading, wait until it is readable:
    a FIFO whose writer has not opened it yet reads as EOF, but polls readable only
    once there is data or its writers have all gone (as ``cat`` sees it)."""
    while True:
        await _readable(fd)
        try:
            chunk = os.read(fd, CHUNK_SIZE)
        except BlockingIOError:
            continue
        if not chunk:
            return
        yield chunk


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    try:
        loop.add_reader(fd, ready.set_result, None)
    except PermissionError:
        return  # not pollable (such as /dev/null): reads do not wait
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def send_chunks(
    chunks: AsyncIterator[bytes], use_gzip: bool, receive: Receive, send: Send
) -> None:
    """Send the body; stop early if the client goes away (a pipe may never end)."""

    async def send_all() -> None:
        compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        async for chunk in chunks:
            data = compressor.compress(chunk) if use_gzip else chunk
            if data:
                # uvicorn's send waits while the socket is congested: flow control.
                await send({"type": "http.response.body", "body": data, "more_body": True})
        tail = compressor.flush() if use_gzip else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def watch_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    sender = asyncio.create_task(send_all())
    watcher = asyncio.create_task(watch_disconnect())
    try:
        await asyncio.wait([sender, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        sender.cancel()
        watcher.cancel()
        await asyncio.gather(sender, watcher, return_exceptions=True)
    if not sender.cancelled():
        sender.result()

"""File transfers through the SDK's files API, streamed both ways: an upload is an
iterator of chunks (the SDK sends it as an ``application/octet-stream`` body without
buffering it), a download is ``files.read(format="stream")``. Neither holds the file in
memory, so size is bounded by disk, not RAM. A Rich progress bar goes to stderr when it
is a terminal.

A download lands in a hidden file next to its destination and is renamed into place at
the end, so a broken transfer never leaves a truncated file under the wanted name.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from e2b import FileType, Sandbox
from e2b.exceptions import NotFoundException
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from agentenv.cli.errors import CliError, ExitCode
from agentenv.cli.output import stderr_console

CHUNK_SIZE = 1024 * 1024
STDIO = "-"


@dataclass(frozen=True)
class Transferred:
    source: str
    destination: str
    size: int


class _Meter:
    """A progress bar when stderr is a terminal, else nothing."""

    def __init__(self, label: str, total: int | None) -> None:
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self.count = 0
        if sys.stderr.isatty():
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=stderr_console(),
                transient=True,
            )
            self._task = self._progress.add_task(label, total=total)

    def __enter__(self) -> _Meter:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, count: int) -> None:
        self.count += count
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, count)


def _chunks(source: BinaryIO, meter: _Meter) -> Iterator[bytes]:
    while chunk := source.read(CHUNK_SIZE):
        # Counted as the SDK pulls the chunk for sending, which tracks the network
        # because the body is not buffered.
        meter.advance(len(chunk))
        yield chunk


def _remote_is_dir(sandbox: Sandbox, path: str, user: str | None) -> bool:
    try:
        return sandbox.files.get_info(path, user=user).type == FileType.DIR
    except NotFoundException:
        return False


def upload(sandbox: Sandbox, local: str, remote: str, *, user: str | None = None) -> Transferred:
    """Copy ``local`` (``-``: stdin) to ``remote``; into it when it is a directory."""
    if local != STDIO and Path(local).is_dir():
        raise CliError(f"{local} is a directory; upload takes one file")
    name = "stdin" if local == STDIO else Path(local).name
    if remote.endswith("/") or _remote_is_dir(sandbox, remote, user):
        if local == STDIO:
            raise CliError(f"{remote} is a directory; name the file to write from stdin")
        remote = posixpath.join(remote, name)
    with contextlib.ExitStack() as stack:
        if local == STDIO:
            source, total = sys.stdin.buffer, None
        else:
            source = stack.enter_context(open(local, "rb"))
            total = os.fstat(source.fileno()).st_size
        meter = stack.enter_context(_Meter(f"{name} → {remote}", total))
        info = sandbox.files.write(remote, _chunks(source, meter), user=user)
    return Transferred(local, info.path, meter.count)


def download(sandbox: Sandbox, remote: str, local: str, *, user: str | None = None) -> Transferred:
    """Copy ``remote`` to ``local`` (``-``: stdout); into it when it is a directory."""
    info = sandbox.files.get_info(remote, user=user)
    if info.type == FileType.DIR:
        raise CliError(f"{remote} is a directory in the sandbox; download takes one file")
    if local == STDIO:
        _stream_to(sandbox, remote, sys.stdout.buffer, info.size, user, "stdout")
        sys.stdout.buffer.flush()
        return Transferred(remote, STDIO, info.size)
    target = Path(local)
    if local.endswith(os.sep) or target.is_dir():
        target = target / posixpath.basename(remote.rstrip("/"))
    if not target.parent.is_dir():
        raise CliError(f"{target.parent}: no such directory", ExitCode.NOT_FOUND)
    fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as sink:
            _stream_to(sandbox, remote, sink, info.size, user, str(target))
        # mkstemp makes the file 0600; a download gets the usual mode for new files.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)
        os.replace(staging, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise
    return Transferred(remote, str(target), info.size)


def _stream_to(
    sandbox: Sandbox,
    remote: str,
    sink: BinaryIO,
    total: int | None,
    user: str | None,
    label: str,
) -> None:
    with (
        _Meter(f"{remote} → {label}", total) as meter,
        sandbox.files.read(remote, format="stream", user=user) as stream,
    ):
        for chunk in stream:
            sink.write(chunk)
            meter.advance(len(chunk))

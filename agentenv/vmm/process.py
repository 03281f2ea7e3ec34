"""Watching VMM processes that may outlive the server that started them.

VMM processes run in their own session (:mod:`agentenv.vmm.launch` starts them) so a
server restart does not take them down, and a new server re-adopts them. asyncio's
subprocess transport is deliberately not used: it kills a still-running child when the
transport is closed or garbage-collected, which is the opposite of what we want. Instead
every process, started or adopted, is watched through a pidfd (readable once the process
has exited), and processes we started are reaped with ``waitpid`` so they do not linger as
zombies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from pathlib import Path

from agentenv.vmm.base import VMMGone


def read_cmdline(pid: int) -> list[str]:
    """The argv of ``pid`` (empty if it has gone or is a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


async def launched_cmdline(pid: int, argv: list[str], limit_s: float) -> list[str]:
    """The argv of ``pid`` once the launch chain in front of ``argv`` has run.

    A VMM started through :func:`agentenv.vmm.launch.launch` first runs as
    ``agentenv-launch`` (and, for a jailed Firecracker, the jailer), whose command lines
    end with the VMM's own ``argv``, each exec'ing the next in the same pid. A server that died in
    that window and looks again finds the chain, not the VMM: it waits, up to ``limit_s``
    seconds, for the exec rather than take a VMM about to start for someone else's
    process (and leave it running, unwatched)."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        cmdline = read_cmdline(pid)
        # Just after an exec the command line can read empty for a moment.
        starting = not cmdline and not is_zombie(pid)
        in_chain = starting or (len(cmdline) > len(argv) and cmdline[-len(argv) :] == argv)
        if not in_chain or asyncio.get_running_loop().time() >= deadline:
            return cmdline
        await asyncio.sleep(0.01)


def processes_naming(markers: tuple[str, ...], executables: tuple[str, ...]) -> list[int]:
    """Processes that run one of ``executables`` (matched as the start of an argument's
    last path component) with an argument that is one of ``markers`` or a path under one:
    a VMM started for them, or the launch chain in front of one."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmdline = read_cmdline(int(entry.name))
        if not any(arg == m or f"{m}/" in arg for arg in cmdline for m in markers):
            continue
        if any(Path(arg).name.startswith(executables) for arg in cmdline):
            found.append(int(entry.name))
    return found


async def kill_processes(pids: list[int], limit_s: float = 5.0) -> None:
    """SIGKILL ``pids`` and wait, up to ``limit_s`` seconds each, until they have exited."""
    for pid in pids:
        try:
            process = VMMProcess.adopt(pid)
        except OSError:
            continue  # gone already
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.kill(), limit_s)
        # Exited (the pidfd said so): reaping it, if it is this server's child, does not
        # block.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222


def is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # The command name is in parentheses and may contain spaces; the state follows it.
    return stat[stat.rindex(")") + 2] in "ZX"


class VMMProcess:
    """One VMM process: started here (by :func:`agentenv.vmm.launch.launch`, which passes
    its ``Popen``) or left by a previous server (``adopt``)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None) -> None:
        self.pid = pid
        self._popen = popen
        self._pidfd = os.pidfd_open(pid)
        self._exited = asyncio.Event()
        self._returncode: int | None = None
        self._detached = False
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pidfd, self._on_exit)

    @classmethod
    def adopt(cls, pid: int) -> VMMProcess:
        """Watch a process this server did not start. Raises ``ProcessLookupError`` if it
        is not there."""
        if is_zombie(pid):
            # If it is our own child (a handle was closed and the VM exited later), reap
            # it now rather than leave the zombie until this server exits.
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            raise ProcessLookupError(pid)
        return cls(pid, None)

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def alive(self) -> bool:
        """Whether the process is running, as far as this handle knows: a detached handle
        knows nothing any more and answers False."""
        return not self._exited.is_set() and not self._detached

    def _on_exit(self) -> None:
        self._release_pidfd()
        if self._popen is not None:
            # Reaps the child; Popen copes if someone else already reaped it.
            self._returncode = self._popen.poll()
        self._exited.set()

    def _release_pidfd(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    async def exited(self) -> int | None:
        """Wait for the process to exit (however long that takes: no polling, the pidfd
        says when) and return its status: ``Popen``'s, negative for the signal that
        killed it, for a process this server started; None for an adopted one, which
        is not our child and so cannot be waited for. Never returns once detached."""
        await self._exited.wait()
        return self._returncode

    async def wait(self, limit_s: float | None = None) -> bool:
        """Wait for the process to exit; True if it did within ``limit_s`` seconds."""
        try:
            await asyncio.wait_for(self._exited.wait(), limit_s)
        except TimeoutError:
            return False
        return True

    def send_signal(self, sig: int) -> None:
        if not self.alive() or self._pidfd < 0:
            return
        with contextlib.suppress(ProcessLookupError):
            # Through the pidfd, so a recycled pid can never receive the signal.
            signal.pidfd_send_signal(self._pidfd, sig)

    async def kill(self) -> None:
        """SIGKILL and wait until the process is gone (reaped, if it is our child)."""
        if self._detached:
            raise VMMGone(f"process {self.pid} is no longer watched by this handle")
        self.send_signal(signal.SIGKILL)
        await self._exited.wait()

    def detach(self) -> None:
        """Stop watching without touching the process."""
        self._detached = True
        self._release_pidfd()
        if self._popen is not None:
            # Keep Popen from reaping (or warning about) a process we leave running.
            self._popen.returncode = 0
            self._popen = None

"""Processes envd starts: spawning them as a user, reading their output eagerly and fanning
it out to subscribers, and remembering them by pid so later RPCs (Connect, SendInput,
SendSignal, ...) can find them.

A process belongs to the registry, not to the RPC that started it: a client disconnect
only drops that client's subscription. Output is always read as it arrives and queued
per subscriber, so a process never blocks on a slow or absent reader.

Exit is observed through a pidfd for the child's own pid (never ``waitpid(-1)``), so envd
reaps only what it started; orphans are left to PID 1.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .users import OSUser

logger = logging.getLogger("agentenv.envd")

#: After the process exits, how long to keep reading pipes that a background grandchild
#: still holds open before ending the stream anyway.
PIPE_DRAIN_GRACE_S = 1.0
#: How many finished processes Connect can still report the end of.
FINISHED_CAPACITY = 256
#: PATH for processes when envd itself has none.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

OutputStream = Literal["stdout", "stderr", "pty"]

# Go's syscall signal names (Linux), which E2B's envd puts in ProcessState.String().
_GO_SIGNAL_NAMES = {
    1: "hangup",
    2: "interrupt",
    3: "quit",
    4: "illegal instruction",
    5: "trace/breakpoint trap",
    6: "aborted",
    7: "bus error",
    8: "floating point exception",
    9: "killed",
    10: "user defined signal 1",
    11: "segmentation fault",
    12: "user defined signal 2",
    13: "broken pipe",
    14: "alarm clock",
    15: "terminated",
    16: "stack fault",
    17: "child exited",
    18: "continued",
    19: "stopped (signal)",
    20: "stopped",
    21: "stopped (tty input)",
    22: "stopped (tty output)",
    23: "urgent I/O condition",
    24: "CPU time limit exceeded",
    25: "file size limit exceeded",
    26: "virtual timer expired",
    27: "profiling timer expired",
    28: "window changed",
    29: "I/O possible",
    30: "power failure",
    31: "bad system call",
}


class SpawnError(Exception):
    """The process could not be started (bad command, permissions, ...)."""


class StdinUnavailableError(Exception):
    """The process was started without stdin, or its stdin is already closed."""


class ProcessGoneError(Exception):
    """The process has already exited."""


@dataclass(frozen=True, slots=True)
class ProcessOutput:
    stream: OutputStream
    data: bytes


@dataclass(frozen=True, slots=True)
class ProcessExit:
    """How a process ended, in the shape of E2B's EndEvent."""

    #: The exit code, or -1 when a signal ended the process.
    exit_code: int
    exited: bool
    #: Go's ``ProcessState.String()``: "exit status 3", "signal: killed".
    status: str
    #: Set (to ``status``) unless the process exited with 0.
    error: str | None

    @classmethod
    def from_wait_status(cls, wait_status: int) -> ProcessExit:
        if os.WIFEXITED(wait_status):
            code = os.WEXITSTATUS(wait_status)
            status = f"exit status {code}"
            return cls(code, True, status, status if code else None)
        if os.WIFSIGNALED(wait_status):
            signum = os.WTERMSIG(wait_status)
            status = f"signal: {_GO_SIGNAL_NAMES.get(signum, f'signal {signum}')}"
            if os.WCOREDUMP(wait_status):
                status += " (core dumped)"
            return cls(-1, False, status, status)
        status = f"unknown wait status {wait_status:#x}"
        return cls(-1, False, status, status)

    @classmethod
    def lost(cls, reason: str) -> ProcessExit:
        return cls(-1, False, reason, reason)


ProcessEvent = ProcessOutput | ProcessExit


@dataclass(frozen=True, slots=True)
class ProcessConfig:
    """The process as the client described it (reported back by List)."""

    cmd: str
    args: tuple[str, ...] = ()
    envs: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None


@dataclass(frozen=True, slots=True)
class PtySize:
    cols: int
    rows: int


@dataclass(frozen=True, slots=True)
class Launch:
    """Everything needed to start a process, already resolved and validated."""

    config: ProcessConfig
    user: OSUser
    #: Absolute working directory.
    cwd: str
    #: The complete environment of the process.
    env: Mapping[str, str]
    stdin: bool = True
    tag: str | None = None
    #: Kill the process (its whole group) this many seconds after it starts.
    timeout_s: float | None = None
    #: Run on a pseudo-terminal of this size instead of pipes.
    pty: PtySize | None = None


def process_environment(
    user: OSUser, sandbox_envs: Mapping[str, str], request_envs: Mapping[str, str]
) -> dict[str, str]:
    """The environment E2B's envd gives a process, in its order of precedence: PATH,
    HOME, USER, LOGNAME, then the sandbox env vars, then the request's own.

    Nothing else of envd's environment is inherited, so its interpreter settings
    (PYTHONHOME, LD_LIBRARY_PATH, ...) never leak into user processes.
    """
    env = {
        "PATH": _user_path(),
        "HOME": user.home,
        "USER": user.name,
        "LOGNAME": user.name,
    }
    env.update(sandbox_envs)
    env.update(request_envs)
    return env


def _user_path() -> str:
    """envd's PATH minus its own interpreter's bin directories."""
    own_bins = {
        os.path.join(prefix, "bin")
        for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}
        if prefix not in ("/", "/usr", "/usr/local")
    }
    path = os.environ.get("PATH") or DEFAULT_PATH
    kept = [p for p in path.split(os.pathsep) if p and os.path.normpath(p) not in own_bins]
    return os.pathsep.join(kept) or DEFAULT_PATH


class Subscription:
    """One reader's view of a process: every event from the moment it subscribed."""

    def __init__(self, process: ManagedProcess) -> None:
        self.process = process
        self._queue: asyncio.Queue[ProcessEvent] = asyncio.Queue()

    def put(self, event: ProcessEvent) -> None:
        self._queue.put_nowait(event)

    async def next(self, timeout: float | None) -> ProcessEvent | None:
        """The next event, or None if ``timeout`` seconds pass without one."""
        try:
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            return None

    def close(self) -> None:
        self.process.unsubscribe(self)


class _OutputPipe(asyncio.Protocol):
    def __init__(self, process: ManagedProcess, stream: OutputStream) -> None:
        self._process = process
        self._stream = stream

    def data_received(self, data: bytes) -> None:
        self._process.publish(ProcessOutput(self._stream, data))

    def connection_lost(self, exc: Exception | None) -> None:
        self._process.pipe_closed(self._stream)


class _StdinPipe(asyncio.BaseProtocol):
    def __init__(self, process: ManagedProcess) -> None:
        self._process = process

    def connection_lost(self, exc: Exception | None) -> None:
        self._process.stdin_lost()


class ManagedProcess:
    """A process envd started, from spawn to the end event."""

    def __init__(
        self, launch: Launch, popen: subprocess.Popen[bytes], registry: ProcessRegistry
    ) -> None:
        self.launch = launch
        self.pid = popen.pid
        self.exit: ProcessExit | None = None
        self._popen = popen
        self._registry = registry
        self._loop = asyncio.get_running_loop()
        self._subscribers: set[Subscription] = set()
        self._open_pipes: set[OutputStream] = set()
        self._read_transports: list[asyncio.BaseTransport] = []
        self._stdin: asyncio.WriteTransport | None = None
        self._wait_status: int | None = None
        self._reaped = False
        self._timers: list[asyncio.TimerHandle] = []
        self._pidfd: int | None = None
        #: The PTY master (the input transport's fd), for resizing.
        self._pty_fd: int | None = None

    @property
    def config(self) -> ProcessConfig:
        return self.launch.config

    @property
    def tag(self) -> str | None:
        return self.launch.tag

    @property
    def running(self) -> bool:
        return self.exit is None

    # -- startup -------------------------------------------------------------------

    async def attach(self, outputs: list[tuple[OutputStream, int]], input_fd: int | None) -> None:
        """Start reading output, connect input and watch for exit. Takes the fds."""
        self._open_pipes = {stream for stream, _ in outputs}
        for stream, fd in outputs:
            pipe = open(fd, "rb", buffering=0)  # noqa: ASYNC230 - wraps an fd, no I/O
            transport, _ = await self._loop.connect_read_pipe(
                lambda s=stream: _OutputPipe(self, s),  # type: ignore[misc]
                pipe,
            )
            self._read_transports.append(transport)
        if input_fd is not None:
            pipe = open(input_fd, "wb", buffering=0)  # noqa: ASYNC230
            self._stdin, _ = await self._loop.connect_write_pipe(lambda: _StdinPipe(self), pipe)
            if self.launch.pty is not None:
                self._pty_fd = input_fd
        if self.launch.timeout_s is not None:
            self._timers.append(self._loop.call_later(self.launch.timeout_s, self._deadline_passed))
        self._watch_exit()

    def _watch_exit(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            # Kernels before 5.3: a thread blocked in waitpid on this one pid.
            thread = threading.Thread(
                target=self._wait_in_thread, name=f"envd-wait-{self.pid}", daemon=True
            )
            thread.start()
            return
        self._loop.add_reader(self._pidfd, self._pidfd_readable)

    def _pidfd_readable(self) -> None:
        assert self._pidfd is not None
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        try:
            _, wait_status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            self._exited(None)
            return
        self._exited(wait_status)

    def _wait_in_thread(self) -> None:
        try:
            _, wait_status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            self._loop.call_soon_threadsafe(self._exited, None)
            return
        self._loop.call_soon_threadsafe(self._exited, wait_status)

    # -- events --------------------------------------------------------------------

    def subscribe(self) -> Subscription:
        """Follow the process from now on; a finished one yields just its end."""
        subscription = Subscription(self)
        if self.exit is not None:
            subscription.put(self.exit)
        else:
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def publish(self, event: ProcessEvent) -> None:
        for subscription in self._subscribers:
            subscription.put(event)

    def pipe_closed(self, stream: OutputStream) -> None:
        self._open_pipes.discard(stream)
        self._maybe_finish()

    def stdin_lost(self) -> None:
        self._stdin = None
        self._pty_fd = None

    def _exited(self, wait_status: int | None) -> None:
        self._reaped = True
        self._wait_status = wait_status
        if wait_status is not None:
            self._popen.returncode = os.waitstatus_to_exitcode(wait_status)
        else:
            self._popen.returncode = -1
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._open_pipes:
            # A background grandchild may hold the pipes open indefinitely.
            self._timers.append(self._loop.call_later(PIPE_DRAIN_GRACE_S, self._stop_reading))
        self._maybe_finish()

    def _stop_reading(self) -> None:
        for transport in self._read_transports:
            transport.close()

    def _maybe_finish(self) -> None:
        if self.exit is not None or not self._reaped or self._open_pipes:
            return
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._wait_status is None:
            self.exit = ProcessExit.lost("exit status unknown")
        else:
            self.exit = ProcessExit.from_wait_status(self._wait_status)
        if self._stdin is not None:
            _abort_stdin(self._stdin)
            self._stdin = None
            self._pty_fd = None
        self.publish(self.exit)
        self._subscribers.clear()
        self._registry.finished(self)

    # -- control -------------------------------------------------------------------

    def send_signal(self, signum: int) -> None:
        """Signal the process's group (it leads its own session), so a shell's children
        go too; raise ProcessGoneError once it has been reaped."""
        if self._reaped:
            raise ProcessGoneError(f"process {self.pid} has exited")
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            # It left its group (setpgid); signal it alone.
            os.kill(self.pid, signum)

    def _deadline_passed(self) -> None:
        logger.info("process %d reached its deadline; killing it", self.pid)
        try:
            self.send_signal(signal.SIGKILL)
        except (ProcessGoneError, ProcessLookupError):
            pass

    def write_stdin(self, data: bytes) -> None:
        """Write to stdin, or to the terminal of a PTY process."""
        if self._stdin is None or self._stdin.is_closing():
            raise StdinUnavailableError(f"process {self.pid} has no open stdin")
        self._stdin.write(data)

    def resize(self, size: PtySize) -> None:
        if self._pty_fd is None:
            raise StdinUnavailableError(f"process {self.pid} has no open terminal")
        _set_window_size(self._pty_fd, size)

    def close_stdin(self) -> None:
        """Close stdin once buffered input is written (the process then reads EOF)."""
        if self._stdin is None:
            raise StdinUnavailableError(f"process {self.pid} has no open stdin")
        self._stdin.close()

    def close(self) -> None:
        """Detach from the process (envd is shutting down); the process keeps running."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        for transport in self._read_transports:
            transport.close()
        if self._stdin is not None:
            _abort_stdin(self._stdin)


def _abort_stdin(stdin: asyncio.WriteTransport) -> None:
    """Drop unwritten input. A pipe transport that already saw its reader go away is
    closing itself; aborting it again makes CPython 3.11 run connection_lost twice."""
    if not stdin.is_closing():
        stdin.abort()


class ProcessRegistry:
    """The processes envd started, by pid: running ones and recently finished ones."""

    def __init__(self, finished_capacity: int = FINISHED_CAPACITY) -> None:
        self._running: dict[int, ManagedProcess] = {}
        self._finished: collections.OrderedDict[int, ManagedProcess] = collections.OrderedDict()
        self._finished_capacity = finished_capacity

    async def start(self, launch: Launch) -> tuple[ManagedProcess, Subscription]:
        """Spawn ``launch`` and subscribe to it before any output can be missed."""
        credentials = _credentials(launch.user)
        child_fds: list[int] = []
        parent_fds: list[int] = []
        outputs: list[tuple[OutputStream, int]] = []
        input_fd: int | None = None
        try:
            if launch.pty is not None:
                master, terminal = os.openpty()
                parent_fds.append(master)
                child_fds.append(terminal)
                _set_window_size(master, launch.pty)
                # Input gets its own fd: each transport closes the fd it owns.
                input_fd = os.dup(master)
                parent_fds.append(input_fd)
                outputs.append(("pty", master))
                stdio = (terminal, terminal, terminal)
            else:
                stdout_r, stdout_w = os.pipe()
                parent_fds.append(stdout_r)
                child_fds.append(stdout_w)
                stderr_r, stderr_w = os.pipe()
                parent_fds.append(stderr_r)
                child_fds.append(stderr_w)
                outputs += [("stdout", stdout_r), ("stderr", stderr_r)]
                stdin: int = subprocess.DEVNULL
                if launch.stdin:
                    stdin, input_fd = os.pipe()
                    child_fds.append(stdin)
                    parent_fds.append(input_fd)
                stdio = (stdin, stdout_w, stderr_w)
            popen = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, does not wait
                [launch.config.cmd, *launch.config.args],
                stdin=stdio[0],
                stdout=stdio[1],
                stderr=stdio[2],
                cwd=launch.cwd,
                env=dict(launch.env),
                start_new_session=True,
                close_fds=True,
                umask=0o022,
                user=credentials[0],
                group=credentials[1],
                extra_groups=credentials[2],
                preexec_fn=_take_controlling_terminal if launch.pty is not None else None,
            )
        except (OSError, subprocess.SubprocessError) as e:
            for fd in parent_fds:
                os.close(fd)
            raise SpawnError(f"error starting process {launch.config.cmd!r}: {e}") from e
        finally:
            for fd in child_fds:
                os.close(fd)

        process = ManagedProcess(launch, popen, self)
        subscription = process.subscribe()
        self._running[process.pid] = process
        try:
            await process.attach(outputs, input_fd)
        except BaseException:
            # Attaching can only fail on fd exhaustion; don't leave an unwatched child.
            process.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            self._running.pop(process.pid, None)
            raise
        logger.info(
            "started pid %d as %s: %s %s",
            process.pid,
            launch.user.name,
            launch.config.cmd,
            " ".join(launch.config.args),
        )
        return process, subscription

    def finished(self, process: ManagedProcess) -> None:
        """Called by a process once its end event is out."""
        self._running.pop(process.pid, None)
        self._finished[process.pid] = process
        self._finished.move_to_end(process.pid)
        while len(self._finished) > self._finished_capacity:
            self._finished.popitem(last=False)

    def running(self) -> list[ManagedProcess]:
        return list(self._running.values())

    def find(self, *, pid: int | None = None, tag: str | None = None) -> ManagedProcess | None:
        """A running process by pid or tag, else a recently finished one."""
        if pid is not None:
            return self._running.get(pid) or self._finished.get(pid)
        if tag is not None:
            for pool in (self._running, self._finished):
                for process in reversed(pool.values()):
                    if process.tag == tag:
                        return process
        return None

    def find_running(
        self, *, pid: int | None = None, tag: str | None = None
    ) -> ManagedProcess | None:
        process = self.find(pid=pid, tag=tag)
        return process if process is not None and process.running else None

    def close(self) -> None:
        """Detach from every process; they keep running (PID 1 reaps them)."""
        for process in list(self._running.values()):
            process.close()
        self._running.clear()
        self._finished.clear()


def _credentials(user: OSUser) -> tuple[int | None, int | None, list[int] | None]:
    """Popen's (user, group, extra_groups) to run the child as ``user``; all None when
    the child simply inherits envd's identity."""
    if os.geteuid() == 0:
        return user.uid, user.gid, list(user.groups)
    if user.uid == os.geteuid():
        return None, None, None
    raise SpawnError(f"envd is not root, so it cannot run processes as {user.name!r}")


def _set_window_size(fd: int, size: PtySize) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0))


def _take_controlling_terminal() -> None:
    """In the child (a new session leader): make the PTY on stdin its controlling terminal,
    so job control and ^C work."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)

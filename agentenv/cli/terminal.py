"""An interactive shell in a sandbox: a PTY started through envd by the SDK, with the
local terminal in raw mode so every byte (Ctrl-C included) goes to the guest.

Three threads share the work. The output pump waits on the PTY's event stream and
writes the bytes to stdout; the input forwarder reads stdin and sends it, and window
resizes, to the PTY; the main thread only waits, so Python can run the SIGWINCH handler
promptly (a handler runs in the main thread between bytecodes, never while it is blocked
in a network read), and keeps the sandbox alive while the session lasts.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType

from e2b import CommandExitException, Sandbox
from e2b.sandbox.commands.command_handle import PtySize

# Seconds between keep-alive calls while a session is attached.
KEEPALIVE_INTERVAL = 30.0
READ_CHUNK = 64 * 1024
# Control-D: what a terminal sends for end of input, given to the guest's shell when
# stdin (a pipe, not a terminal) runs out.
END_OF_INPUT = b"\x04"


@dataclass
class _Session:
    done: threading.Event = field(default_factory=threading.Event)
    resized: threading.Event = field(default_factory=threading.Event)
    # The signal (SIGHUP, SIGTERM) that ended the session from outside, if one did.
    ended_by: int | None = None
    exit_code: int | None = None
    error: BaseException | None = None


def terminal_size() -> PtySize:
    for fd in (sys.stdout.fileno(), sys.stdin.fileno(), sys.stderr.fileno()):
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(fd)
            return PtySize(rows=size.lines, cols=size.columns)
    fallback = shutil.get_terminal_size()
    return PtySize(rows=fallback.lines, cols=fallback.columns)


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """``fd`` in raw mode for the block when it is a terminal; restored afterwards."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _signal_handlers(session: _Session) -> Iterator[None]:
    def on_winch(_signum: int, _frame: FrameType | None) -> None:
        session.resized.set()

    def on_hangup(signum: int, _frame: FrameType | None) -> None:
        session.ended_by = signum
        session.done.set()

    wanted = {signal.SIGWINCH: on_winch, signal.SIGHUP: on_hangup, signal.SIGTERM: on_hangup}
    previous = {signum: signal.signal(signum, handler) for signum, handler in wanted.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def attach_shell(
    sandbox: Sandbox,
    *,
    user: str | None = None,
    cwd: str | None = None,
    keepalive: Callable[[], None] | None = None,
) -> int:
    """Run a login shell in ``sandbox`` on this terminal until it exits; its status.

    Raises what the SDK raises when the PTY cannot be started or the stream breaks."""
    stdin_fd, stdout_fd = sys.stdin.fileno(), sys.stdout.fileno()
    session = _Session()
    handle = sandbox.pty.create(terminal_size(), user=user, cwd=cwd, timeout=0)
    pid = handle.pid

    def pump_output() -> None:
        try:
            result = handle.wait(on_pty=lambda data: _write_all(stdout_fd, data))
            session.exit_code = result.exit_code
        except CommandExitException as exc:
            session.exit_code = exc.exit_code
        except BaseException as exc:
            session.error = exc
        finally:
            session.done.set()

    def apply_resize() -> None:
        if session.resized.is_set():
            session.resized.clear()
            with contextlib.suppress(Exception):
                sandbox.pty.resize(pid, terminal_size())

    def forward_input() -> None:
        # Resizes go from this thread too, so input typed after a resize reaches the
        # guest after it (a command that reads the size sees the new one).
        while not session.done.is_set():
            try:
                apply_resize()
                ready, _, _ = select.select([stdin_fd], [], [], 0.1)
                if not ready:
                    continue
                data = os.read(stdin_fd, READ_CHUNK)
                apply_resize()
                sandbox.pty.send_stdin(pid, data or END_OF_INPUT)
            except Exception:
                # The shell ending races its last input; anything else shows up as the
                # output stream failing, which the pump reports.
                return
            if not data:
                return

    with _signal_handlers(session), raw_terminal(stdin_fd):
        pump = threading.Thread(target=pump_output, name="aenv-pty-output", daemon=True)
        forwarder = threading.Thread(target=forward_input, name="aenv-pty-input", daemon=True)
        pump.start()
        forwarder.start()
        last_keepalive = time.monotonic()
        while not session.done.wait(0.1):
            if keepalive is not None and time.monotonic() - last_keepalive > KEEPALIVE_INTERVAL:
                last_keepalive = time.monotonic()
                with contextlib.suppress(Exception):
                    keepalive()
        forwarder.join(timeout=1.0)

    if session.ended_by is not None:
        # The terminal went away or aenv was told to stop: end the guest's shell too,
        # rather than leave it behind; exit as a shell killed by that signal would.
        with contextlib.suppress(Exception):
            handle.kill()
        return 128 + session.ended_by
    if session.error is not None:
        raise session.error
    return session.exit_code if session.exit_code is not None else 1

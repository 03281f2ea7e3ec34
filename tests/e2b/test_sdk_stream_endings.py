"""A sandbox killed, expired or paused under an open stream: the unmodified SDK raises its
sandbox-not-running error promptly, instead of waiting for its own 60 s deadline or
hanging. Commands (sync and async), PTY, directory watches (both SDK flavours) and file
transfers each get a sandbox of their own, since each test ends it.

Time bounds are generous (the guest runs under TCG on a shared machine): what they rule
out is the SDK's own 60 s request deadline, or no answer at all.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from e2b import (
    E2B,
    AsyncSandbox,
    FilesystemEvent,
    PtySize,
    Sandbox,
    SandboxNotRunningException,
)

pytestmark = pytest.mark.vm

#: Well before the SDK's own 60 s deadline; a cut stream arrives in about a second.
PROMPT_S = 15.0


class Trigger:
    """Runs ``action`` once, in a thread of its own (the test's thread is blocked in the
    SDK), and remembers when it finished."""

    def __init__(self, action: Callable[[], object]) -> None:
        self._action = action
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.done_at: float | None = None
        self.error: BaseException | None = None

    def fire(self, *_: object) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._action()
        except BaseException as exc:  # reported by elapsed()
            self.error = exc
        self.done_at = time.monotonic()

    def elapsed(self) -> float:
        """Seconds from the action's end to now; fails the test if it did not run."""
        assert self._thread is not None, "the trigger never fired"
        self._thread.join(60)
        if self.error is not None:
            raise self.error
        assert self.done_at is not None
        return time.monotonic() - self.done_at


@pytest.fixture
def doomed(e2b: E2B) -> Iterator[Sandbox]:
    sandbox = e2b.Sandbox.create(timeout=120, metadata={"suite": "e2b-stream-endings"})
    yield sandbox
    e2b.Sandbox.kill(sandbox.sandbox_id)


# -- commands -------------------------------------------------------------------------------
def test_kill_ends_a_running_command(e2b: E2B, doomed: Sandbox) -> None:
    kill = Trigger(lambda: e2b.Sandbox.kill(doomed.sandbox_id))
    with pytest.raises(SandboxNotRunningException):
        doomed.commands.run("echo started; sleep 600", on_stdout=kill.fire, timeout=120)
    assert kill.elapsed() < PROMPT_S


def test_pause_ends_a_running_command(e2b: E2B, doomed: Sandbox) -> None:
    pause = Trigger(lambda: e2b.Sandbox.pause(doomed.sandbox_id))
    started = time.monotonic()
    with pytest.raises(SandboxNotRunningException):
        doomed.commands.run("echo started; sleep 600", on_stdout=pause.fire, timeout=120)
    # The stream ends when the pause begins, not when it is done.
    assert time.monotonic() - started < PROMPT_S
    pause.elapsed()
    assert e2b.Sandbox.get_info(doomed.sandbox_id).state.value == "paused"


def test_expiry_ends_a_running_command(doomed: Sandbox) -> None:
    doomed.set_timeout(4)
    started = time.monotonic()
    with pytest.raises(SandboxNotRunningException):
        doomed.commands.run("sleep 600", timeout=120)
    assert time.monotonic() - started < 4 + PROMPT_S


async def test_kill_ends_a_running_command_async(e2b: E2B, doomed: Sandbox) -> None:
    asbx = await e2b.AsyncSandbox.connect(doomed.sandbox_id)
    started = asyncio.Event()

    async def kill_once_started() -> float:
        await started.wait()
        await e2b.AsyncSandbox.kill(doomed.sandbox_id)
        return time.monotonic()

    killer = asyncio.create_task(kill_once_started())
    with pytest.raises(SandboxNotRunningException):
        await asbx.commands.run(
            "echo started; sleep 600", on_stdout=lambda _: started.set(), timeout=120
        )
    assert time.monotonic() - await killer < PROMPT_S


async def test_kill_ends_a_background_command_async(e2b: E2B, doomed: Sandbox) -> None:
    asbx = await e2b.AsyncSandbox.connect(doomed.sandbox_id)
    handle = await asbx.commands.run("sleep 600", background=True, timeout=120)
    await e2b.AsyncSandbox.kill(doomed.sandbox_id)
    killed = time.monotonic()
    with pytest.raises(SandboxNotRunningException):
        await asyncio.wait_for(handle.wait(), PROMPT_S)
    assert time.monotonic() - killed < PROMPT_S


# -- PTY --------------------------------------------------------------------------------------
def test_kill_ends_a_pty(e2b: E2B, doomed: Sandbox) -> None:
    pty = doomed.pty.create(PtySize(rows=24, cols=80), timeout=120)
    kill = Trigger(lambda: e2b.Sandbox.kill(doomed.sandbox_id))
    kill.fire()
    with pytest.raises(SandboxNotRunningException):
        pty.wait()
    assert kill.elapsed() < PROMPT_S


# -- directory watches ------------------------------------------------------------------------
async def test_kill_ends_an_async_watch(e2b: E2B, doomed: Sandbox) -> None:
    asbx = await e2b.AsyncSandbox.connect(doomed.sandbox_id)
    exits: asyncio.Queue[Exception | None] = asyncio.Queue()
    events: list[FilesystemEvent] = []
    handle = await asbx.files.watch_dir(
        "/home/user", on_event=events.append, on_exit=exits.put_nowait, timeout=120
    )
    try:
        await e2b.AsyncSandbox.kill(doomed.sandbox_id)
        error = await asyncio.wait_for(exits.get(), PROMPT_S)
        assert isinstance(error, SandboxNotRunningException)
    finally:
        await handle.stop()  # type: ignore[no-untyped-call]


def test_kill_ends_a_sync_watch(e2b: E2B, doomed: Sandbox) -> None:
    watcher = doomed.files.watch_dir("/home/user")
    e2b.Sandbox.kill(doomed.sandbox_id)
    killed = time.monotonic()
    with pytest.raises(SandboxNotRunningException):
        watcher.get_new_events()
    assert time.monotonic() - killed < PROMPT_S


# -- file transfers ---------------------------------------------------------------------------
def test_kill_ends_a_download(e2b: E2B, doomed: Sandbox) -> None:
    # A pipe whose writer never finishes: the download is in flight until the sandbox ends.
    doomed.commands.run(
        "mkfifo /tmp/feed && (while :; do echo tick; sleep 0.2; done > /tmp/feed) "
        ">/dev/null 2>&1 &",
        timeout=30,
    )
    kill = Trigger(lambda: e2b.Sandbox.kill(doomed.sandbox_id))
    threading.Timer(2.0, kill.fire).start()
    with pytest.raises(SandboxNotRunningException):
        doomed.files.read("/tmp/feed", request_timeout=120)
    assert kill.elapsed() < PROMPT_S


def test_kill_ends_an_upload(e2b: E2B, doomed: Sandbox) -> None:
    kill = Trigger(lambda: e2b.Sandbox.kill(doomed.sandbox_id))

    def slow_body() -> Iterator[bytes]:
        yield b"first chunk\n"
        kill.fire()
        for _ in range(600):
            time.sleep(0.1)
            yield b"more\n"

    with pytest.raises(SandboxNotRunningException):
        doomed.files.write("/home/user/upload.txt", slow_body(), request_timeout=120)
    assert kill.elapsed() < PROMPT_S


async def test_async_sandbox_is_gone_after_the_stream_ends(e2b: E2B, doomed: Sandbox) -> None:
    """What the SDK's error promises: the sandbox is not running any more."""
    asbx: AsyncSandbox = await e2b.AsyncSandbox.connect(doomed.sandbox_id)
    handle = await asbx.commands.run("sleep 600", background=True, timeout=120)
    await e2b.AsyncSandbox.kill(doomed.sandbox_id)
    with pytest.raises(SandboxNotRunningException):
        await asyncio.wait_for(handle.wait(), PROMPT_S)
    assert await asbx.is_running() is False

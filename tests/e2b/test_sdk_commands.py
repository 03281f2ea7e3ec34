"""``sandbox.commands`` and ``sandbox.pty`` through the official SDK, sync and async."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from e2b import E2B, CommandExitException, PtySize, Sandbox

from tests.e2b.support import wait_until

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sbx(e2b: E2B) -> Iterator[Sandbox]:
    sandbox = e2b.Sandbox.create(timeout=600, metadata={"suite": "e2b-commands"})
    yield sandbox
    sandbox.kill()


# -- foreground --------------------------------------------------------------------------
def test_run_foreground_output_and_exit_code(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo out; echo err >&2")
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 0
    assert result.error is None


def test_nonzero_exit_raises_command_exit_exception(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo partial; echo broken >&2; exit 7")
    assert info.value.exit_code == 7
    assert info.value.stdout == "partial\n"
    assert info.value.stderr == "broken\n"
    assert info.value.error == "exit status 7"


def test_streaming_callbacks(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    result = sbx.commands.run(
        "for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.05; done",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "o1\no2\no3\n" == result.stdout
    assert "".join(err) == "e1\ne2\ne3\n" == result.stderr


def test_cwd_envs_and_users(sbx: Sandbox) -> None:
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    env = sbx.commands.run("echo $A-$B", envs={"A": "1", "B": "two words"})
    assert env.stdout == "1-two words\n"

    default = sbx.commands.run("id -un; echo $HOME")
    assert default.stdout == "user\n/home/user\n"
    root = sbx.commands.run("id -un; echo $HOME; ls /root >/dev/null", user="root")
    assert root.stdout == "root\n/root\n"
    # The default user cannot read root's home.
    with pytest.raises(CommandExitException):
        sbx.commands.run("ls /root")


def test_missing_cwd_is_an_error(sbx: Sandbox) -> None:
    from e2b import InvalidArgumentException

    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("true", cwd="/no/such/dir")


def test_sandbox_envs_reach_every_process(e2b: E2B) -> None:
    sandbox = e2b.Sandbox.create(timeout=120, envs={"FROM_CREATE": "yes", "SHADOWED": "create"})
    try:
        assert sandbox.commands.run("echo $FROM_CREATE").stdout == "yes\n"
        assert sandbox.commands.run("echo $FROM_CREATE", user="root").stdout == "yes\n"
        shadowed = sandbox.commands.run("echo $SHADOWED", envs={"SHADOWED": "call"})
        assert shadowed.stdout == "call\n"
    finally:
        sandbox.kill()


# -- background ----------------------------------------------------------------------------
def test_background_wait_list_connect_and_kill(sbx: Sandbox) -> None:
    finite = sbx.commands.run("sleep 0.5; echo done", background=True)
    endless = sbx.commands.run("echo started; sleep 600", background=True)
    assert finite.pid != endless.pid

    listed = {p.pid: p for p in sbx.commands.list()}
    assert endless.pid in listed
    assert listed[endless.pid].cmd == "/bin/bash"
    assert listed[endless.pid].args == ["-l", "-c", "echo started; sleep 600"]

    assert finite.wait().stdout == "done\n"

    # A second client attaches to the running command by pid.
    attached = sbx.commands.connect(endless.pid)
    assert attached.pid == endless.pid
    assert sbx.commands.kill(endless.pid) is True
    with pytest.raises(CommandExitException) as info:
        attached.wait()
    assert info.value.exit_code == -1
    assert "killed" in (info.value.error or "")
    with pytest.raises(CommandExitException):
        endless.wait()

    wait_until(lambda: endless.pid not in {p.pid for p in sbx.commands.list()}, "process gone")
    assert sbx.commands.kill(endless.pid) is False


def test_handle_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 600", background=True)
    assert handle.kill() is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1


def test_connect_to_unknown_pid(sbx: Sandbox) -> None:
    from e2b import NotFoundException

    with pytest.raises(NotFoundException):
        sbx.commands.connect(999_999).wait()


def test_stdin_send_and_close(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat; echo eof", background=True, stdin=True)
    handle.send_stdin("hello ")
    sbx.commands.send_stdin(handle.pid, b"world\n")
    handle.close_stdin()
    result = handle.wait()
    assert result.stdout == "hello world\neof\n"


def test_stdin_closed_by_default(sbx: Sandbox) -> None:
    # Without stdin=True the command sees EOF at once instead of hanging.
    assert sbx.commands.run("cat; echo after", timeout=30).stdout == "after\n"


# -- PTY -----------------------------------------------------------------------------------
def test_pty_session(sbx: Sandbox) -> None:
    pty = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    sbx.pty.send_stdin(pty.pid, b"stty size; echo pty-$((6*7))\n")
    # Resize only once the shell has answered: typed-ahead input would otherwise be run
    # after the resize.
    before = bytearray()
    for _, _, data in pty:
        if data is not None:
            before.extend(data)
        if b"pty-42" in before:
            break
    assert b"24 80" in before
    sbx.pty.resize(pty.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(pty.pid, b"stty size; tty; exit 0\n")
    after = bytearray()
    result = pty.wait(on_pty=after.extend)
    assert result.exit_code == 0
    assert b"40 120" in after
    assert b"/dev/pts/" in after


def test_pty_kill(sbx: Sandbox) -> None:
    pty = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    assert sbx.pty.kill(pty.pid) is True
    with pytest.raises(CommandExitException):
        pty.wait()
    assert sbx.pty.kill(pty.pid) is False


# -- async API ----------------------------------------------------------------------------
async def test_async_commands(e2b: E2B, sbx: Sandbox) -> None:
    asbx = await e2b.AsyncSandbox.connect(sbx.sandbox_id)
    result = await asbx.commands.run("echo async; echo err >&2", user="root", cwd="/tmp")
    assert (result.stdout, result.stderr, result.exit_code) == ("async\n", "err\n", 0)
    assert (await asbx.commands.run("pwd; id -un", user="root", cwd="/tmp")).stdout == (
        "/tmp\nroot\n"
    )

    with pytest.raises(CommandExitException) as info:
        await asbx.commands.run("exit 4")
    assert info.value.exit_code == 4

    chunks: list[str] = []
    background = await asbx.commands.run(
        "cat; echo bye", background=True, stdin=True, on_stdout=chunks.append
    )
    assert background.pid in {p.pid for p in await asbx.commands.list()}
    await asbx.commands.send_stdin(background.pid, "from async\n")
    await asbx.commands.close_stdin(background.pid)
    done = await background.wait()
    assert done.stdout == "from async\nbye\n"
    assert "".join(chunks) == "from async\nbye\n"

    endless = await asbx.commands.run("sleep 600", background=True)
    attached = await asbx.commands.connect(endless.pid)
    assert await asbx.commands.kill(endless.pid) is True
    with pytest.raises(CommandExitException):
        await attached.wait()
    assert await asbx.commands.kill(endless.pid) is False


async def test_async_pty(e2b: E2B, sbx: Sandbox) -> None:
    asbx = await e2b.AsyncSandbox.connect(sbx.sandbox_id)
    output = bytearray()
    pty = await asbx.pty.create(PtySize(rows=24, cols=80), on_data=output.extend, timeout=60)
    await asbx.pty.resize(pty.pid, PtySize(rows=30, cols=100))
    await asbx.pty.send_stdin(pty.pid, b"stty size\n")
    for _ in range(300):
        if b"30 100" in output:
            break
        await asyncio.sleep(0.1)
    assert b"30 100" in output
    assert await asbx.pty.kill(pty.pid) is True
    with pytest.raises(CommandExitException):
        await pty.wait()

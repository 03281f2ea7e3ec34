"""The sandbox commands of ``aenv``: start, connect (cn), exec, ls, pause, resume,
timeout, fork, rm (delete), upload and download, with the interactive shell session
(``terminal``) and file transfers (``transfer``) they run through the ``e2b`` SDK, which
they import only when they run. Lifecycle calls go through ``ControlPlane``. It owns these
commands only; ``main`` adds them to the ``aenv`` app by ``register``. It must not touch
server internals or the template and auth commands."""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from agentenv.cli.command_helpers import (
    Output,
    SandboxId,
    UserOption,
    busy,
    control_plane,
    parse_pairs,
    print_ids,
    remove_each,
)
from agentenv.cli.errors import CliError, translate
from agentenv.cli.output import (
    OutputFormat,
    ago,
    as_sent,
    human_bytes,
    json_requested,
    note,
    print_json,
    table,
    until,
    use_output,
)
from agentenv.limits import MAX_FORK_CHILDREN

if TYPE_CHECKING:
    from e2b import Sandbox

    from agentenv.cli.api import ControlPlane
    from agentenv.cli.transfer import Transferred


# While a shell is attached its sandbox is kept alive this many seconds past the last
# keep-alive (sent every 30 s), so it outlives a short network hiccup but not the session
# by much.
ATTACHED_LIFETIME = 120


class SandboxState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"


def shell_session(
    cp: ControlPlane,
    sandbox_id: str,
    *,
    kill_after: bool,
    user: str | None,
    cwd: str | None,
) -> int:
    """Attach a shell to a running sandbox; its exit status. The sandbox is killed
    afterwards when ``kill_after``, also when attaching fails or is interrupted."""
    from agentenv.cli.terminal import attach_shell

    try:
        sandbox = cp.sandbox(sandbox_id)
        return attach_shell(
            sandbox,
            user=user,
            cwd=cwd,
            keepalive=lambda: cp.refresh(sandbox_id, ATTACHED_LIFETIME),
        )
    except CliError:
        raise
    except Exception as exc:
        raise translate(exc, cp.server) from exc
    finally:
        if kill_after:
            with contextlib.suppress(CliError):
                cp.kill(sandbox_id)


def start(
    template: Annotated[str, typer.Argument(help="template or snapshot")] = "base",
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Print the sandbox id and return.")
    ] = False,
    timeout: Annotated[
        int | None,
        typer.Option("--timeout", "-t", min=0, help="lifetime in seconds (server default)"),
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the sandbox when the shell exits.")
    ] = False,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="KEY=VALUE, repeatable")
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE, repeatable")
    ] = None,
    user: UserOption = None,
    cwd: Annotated[str | None, typer.Option("--cwd", help="shell's directory")] = None,
    output: Output = None,
) -> None:
    """Start a sandbox and attach a shell to it; exits with the shell's status.

    The sandbox is killed when the shell ends, unless --keep or --detach."""
    use_output(output)
    meta = parse_pairs(metadata, "--metadata")
    envs = parse_pairs(env, "--env")
    with control_plane() as cp:
        with busy(f"starting {template}"):
            created = cp.create_sandbox(template, timeout=timeout, metadata=meta, envs=envs)
        sandbox_id = created.sandbox_id
        if detach:
            print_ids([sandbox_id], as_sent(created))
            return
        status = shell_session(cp, sandbox_id, kill_after=not keep, user=user, cwd=cwd)
    if keep:
        note(f"sandbox {sandbox_id} keeps running: `aenv connect {sandbox_id}`")
    raise typer.Exit(status)


def connect(
    sandbox_id: SandboxId,
    timeout: Annotated[
        int | None,
        typer.Option("--timeout", "-t", min=0, help="lifetime in seconds from now"),
    ] = None,
    user: UserOption = None,
    cwd: Annotated[str | None, typer.Option("--cwd", help="shell's directory")] = None,
    output: Output = None,
) -> None:
    """Attach a shell to a sandbox, resuming it if paused (alias: cn)."""
    use_output(output)
    with control_plane() as cp:
        with busy(f"connecting to {sandbox_id}"):
            resumed = cp.connect(sandbox_id, timeout).resumed
        if resumed:
            note(f"resumed {sandbox_id}")
        status = shell_session(cp, sandbox_id, kill_after=False, user=user, cwd=cwd)
    raise typer.Exit(status)


def exec_command(
    sandbox_id: SandboxId,
    command: Annotated[list[str], typer.Argument(metavar="CMD", help="command to run")],
    cwd: Annotated[str | None, typer.Option("--cwd", help="working directory")] = None,
    user: UserOption = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE, repeatable")
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", "-t", min=0, help="seconds; 0 for no limit")
    ] = 0,
    output: Output = None,
) -> None:
    """Run a command in a sandbox; exits with its exit code.

    Its stdout and stderr stream here as they come. One argument is a shell command
    line (`aenv exec ID -- 'ls | wc -l'`); several are an argument vector, quoted as
    given (`aenv exec ID -- ls -la /tmp`)."""
    from e2b import CommandExitException

    use_output(output)
    envs = parse_pairs(env, "--env")
    line = command[0] if len(command) == 1 else shlex.join(command)

    def to_stdout(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def to_stderr(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    with control_plane() as cp:
        cp.connect(sandbox_id)
        sandbox = cp.sandbox(sandbox_id)
        try:
            result = sandbox.commands.run(
                line,
                envs=envs,
                user=user,
                cwd=cwd,
                on_stdout=to_stdout,
                on_stderr=to_stderr,
                timeout=timeout,
                retain_output=False,
            )
            status = result.exit_code
        except CommandExitException as exc:
            status = exc.exit_code
        except Exception as exc:
            raise translate(exc, cp.server) from exc
    raise typer.Exit(status)


def list_sandboxes(
    state: Annotated[
        SandboxState | None, typer.Option("--state", case_sensitive=False, help="filter")
    ] = None,
    metadata: Annotated[
        list[str] | None,
        typer.Option("--metadata", "-m", help="KEY=VALUE filter, repeatable (all must match)"),
    ] = None,
    output: Output = None,
) -> None:
    """List sandboxes."""
    fmt = use_output(output)
    wanted = parse_pairs(metadata, "--metadata")
    with control_plane() as cp:
        items = cp.list_sandboxes(state=state.value if state else None, metadata=wanted)
    if fmt is OutputFormat.JSON:
        # The route leaves unset fields out rather than sending null.
        print_json([as_sent(item, exclude_none=True) for item in items])
        return
    if not items:
        note("no sandboxes")
        return
    table(
        ("ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "CPU", "MEMORY", "PARENT", "METADATA"),
        [
            (
                item.sandbox_id,
                item.template_id,
                item.state,
                ago(item.started_at),
                until(item.end_at),
                str(item.cpu_count),
                f"{item.memory_mb} MiB",
                (item.lineage.parent_id if item.lineage else None) or "-",
                " ".join(f"{k}={v}" for k, v in item.metadata.items()) or "-",
            )
            for item in items
        ],
    )


def pause(sandbox_id: SandboxId, output: Output = None) -> None:
    """Pause a sandbox (memory and disk are kept; resume or connect wakes it)."""
    use_output(output)
    with control_plane() as cp, busy(f"pausing {sandbox_id}"):
        cp.pause(sandbox_id)
    print_ids([sandbox_id], {"sandboxID": sandbox_id, "state": "paused"})


def resume(
    sandbox_id: SandboxId,
    timeout: Annotated[
        int | None, typer.Option("--timeout", "-t", min=0, help="lifetime in seconds from now")
    ] = None,
    output: Output = None,
) -> None:
    """Resume a paused sandbox (nothing to do when it is running)."""
    use_output(output)
    with control_plane() as cp, busy(f"resuming {sandbox_id}"):
        connected = cp.connect(sandbox_id, timeout)
    if not connected.resumed and not json_requested():
        note(f"{sandbox_id} was already running")
    print_ids([sandbox_id], {**as_sent(connected.sandbox), "resumed": connected.resumed})


def set_timeout(
    sandbox_id: SandboxId,
    seconds: Annotated[int, typer.Argument(min=0, help="seconds from now until it is killed")],
    output: Output = None,
) -> None:
    """Set how long a sandbox lives from now on."""
    use_output(output)
    with control_plane() as cp:
        cp.set_timeout(sandbox_id, seconds)
    print_ids([sandbox_id], {"sandboxID": sandbox_id, "timeout": seconds})


def fork(
    sandbox_id: SandboxId,
    count: Annotated[
        int, typer.Option("--count", "-n", min=1, max=MAX_FORK_CHILDREN, help="children")
    ] = 1,
    timeout: Annotated[
        int | None, typer.Option("--timeout", "-t", min=0, help="children's lifetime")
    ] = None,
    output: Output = None,
) -> None:
    """Fork a running sandbox into children; prints their ids.

    The parent keeps running. Exits with 1 when any child failed to start."""
    use_output(output)
    with control_plane() as cp, busy(f"forking {sandbox_id} into {count}"):
        results = cp.fork(sandbox_id, count, timeout)
    children = [r.sandbox.sandbox_id for r in results if r.sandbox]
    failures = [r.error for r in results if r.error]
    # The route leaves out the half (sandbox or error) a child does not have.
    print_ids(children, [as_sent(r, exclude_none=True) for r in results])
    if failures:
        raise CliError(
            f"{len(failures)} of {len(results)} children failed to start: {failures[0].message}",
            json_output=False,
        )


def remove(
    sandbox_ids: Annotated[list[str], typer.Argument(metavar="ID", help="sandbox ids")],
    output: Output = None,
) -> None:
    """Kill sandboxes (alias: delete)."""
    use_output(output)
    with control_plane() as cp:
        remove_each(sandbox_ids, cp.kill)


def upload(
    sandbox_id: SandboxId,
    local: Annotated[str, typer.Argument(help="local file, or - for stdin")],
    remote: Annotated[str, typer.Argument(help="path in the sandbox (a directory: into it)")],
    user: UserOption = None,
    output: Output = None,
) -> None:
    """Copy a local file into a sandbox, streamed."""
    from agentenv.cli.transfer import upload as upload_file

    use_output(output)
    transfer(sandbox_id, lambda sandbox: upload_file(sandbox, local, remote, user=user))


def download(
    sandbox_id: SandboxId,
    remote: Annotated[str, typer.Argument(help="file in the sandbox")],
    local: Annotated[str, typer.Argument(help="local path (a directory: into it), - for stdout")],
    user: UserOption = None,
    output: Output = None,
) -> None:
    """Copy a file out of a sandbox, streamed."""
    from agentenv.cli.transfer import download as download_file

    use_output(output)
    transfer(sandbox_id, lambda sandbox: download_file(sandbox, remote, local, user=user))


def transfer(sandbox_id: str, move: Callable[[Sandbox], Transferred]) -> None:
    """Run one upload or download against a connected (resumed if paused) sandbox."""
    with control_plane() as cp:
        cp.connect(sandbox_id)
        sandbox = cp.sandbox(sandbox_id)
        try:
            done = move(sandbox)
        except CliError:
            raise
        except Exception as exc:
            raise translate(exc, cp.server) from exc
    report_transfer(done)


def report_transfer(done: Transferred) -> None:
    if json_requested() and done.destination != "-":
        print_json({"source": done.source, "destination": done.destination, "size": done.size})
    elif sys.stderr.isatty():
        note(f"{human_bytes(done.size)} copied to {done.destination}")


def register(app: typer.Typer) -> None:
    """Add the sandbox commands, and their hidden aliases, to ``app``."""
    app.command()(start)
    app.command("connect")(connect)
    app.command("cn", hidden=True)(connect)
    app.command("exec")(exec_command)
    app.command("ls")(list_sandboxes)
    app.command()(pause)
    app.command()(resume)
    app.command("timeout")(set_timeout)
    app.command()(fork)
    app.command("rm")(remove)
    app.command("delete", hidden=True)(remove)
    app.command()(upload)
    app.command()(download)

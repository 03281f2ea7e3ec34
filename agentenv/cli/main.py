"""``aenv``'s commands (Typer). Each one resolves the settings, talks to the server
through ``ControlPlane`` (the control-plane routes, by ``agentenv.client``) or an SDK
``Sandbox`` (envd), and prints through ``output``; failures are raised as ``CliError`` and
reported once, by ``main``."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from agentenv import __version__
from agentenv.cli import settings as settings_store
from agentenv.cli.errors import CliError, ExitCode, translate
from agentenv.cli.output import (
    OutputFormat,
    ago,
    as_sent,
    human_bytes,
    json_requested,
    note,
    print_json,
    print_lines,
    report_error,
    stderr_console,
    table,
    until,
    use_output,
)
from agentenv.cli.settings import Settings
from agentenv.limits import MAX_FORK_CHILDREN

# The e2b SDK, and the modules using it (terminal, transfer), are imported by the commands
# that need them: it takes about half a second to import, which `aenv ls` and every shell
# completion would otherwise pay. The control plane (agentenv.client, with Pydantic and
# the API models) is imported once a command talks to the server, which --help and shell
# completion never do.
if TYPE_CHECKING:
    from e2b import Sandbox

    from agentenv.cli.api import ControlPlane
    from agentenv.cli.transfer import Transferred

JsonObject = dict[str, Any]

app = typer.Typer(
    name="aenv",
    help="agentenv: microVM sandboxes for agents. Talks to an agentenv server over HTTP.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)
auth_app = typer.Typer(help="Store and check the server URL and API key.")
template_app = typer.Typer(help="Templates (and snapshots, which start sandboxes too).")
snapshot_app = typer.Typer(help="Persistent snapshots of running sandboxes.", no_args_is_help=True)
app.add_typer(auth_app, name="auth")
app.add_typer(template_app, name="template", no_args_is_help=True)
app.add_typer(snapshot_app, name="snapshot")

# While a shell is attached its sandbox is kept alive this many seconds past the last
# keep-alive (sent every 30 s), so it outlives a short network hiccup but not the session
# by much.
ATTACHED_LIFETIME = 120


class SandboxState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"


Output = Annotated[
    OutputFormat | None,
    typer.Option(
        "--output",
        "-o",
        case_sensitive=False,
        help="table or json (default: table on a terminal, json when piped)",
    ),
]
SandboxId = Annotated[str, typer.Argument(metavar="ID", help="sandbox id")]
UserOption = Annotated[
    str | None, typer.Option("--user", "-u", help="guest user (default: envd's default user)")
]


# -- helpers ------------------------------------------------------------------------------
def control_plane(*, need_key: bool = True, settings: Settings | None = None) -> ControlPlane:
    """The server ``settings`` name (by default the stored ones, under the environment's)."""
    from agentenv.cli.api import ControlPlane

    return ControlPlane(settings or settings_store.load(), need_key=need_key)


def parse_pairs(values: Sequence[str] | None, option: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for value in values or ():
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {value!r}", param_hint=option)
        pairs[key] = val
    return pairs


@contextlib.contextmanager
def busy(message: str) -> Iterator[None]:
    """A spinner on stderr while slow work runs, when stderr is a terminal."""
    if sys.stderr.isatty():
        with stderr_console().status(message):
            yield
    else:
        yield


def print_ids(ids: Sequence[str], objects: Any) -> None:
    """An action's result: the ids, or the full objects with ``--output json``."""
    if json_requested():
        print_json(objects)
    else:
        print_lines(ids)


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


def _version(value: bool) -> None:
    if value:
        print(f"aenv {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """agentenv: microVM sandboxes for agents.

    Configure with `aenv auth` (or AENV_SERVER / AENV_API_KEY). Exit codes: 0 ok,
    1 error, 2 usage, 3 auth, 4 not found, 5 server unreachable, 6 conflict, 7 not
    supported yet; exec, start and connect exit with the guest command's status.
    """


# -- auth ----------------------------------------------------------------------------------
@auth_app.callback(invoke_without_command=True)
def auth(
    ctx: typer.Context,
    server: Annotated[str | None, typer.Option("--server", help="server URL")] = None,
    key: Annotated[str | None, typer.Option("--key", help="API key")] = None,
    show: Annotated[
        bool, typer.Option("--show", help="Show the settings in use and check them.")
    ] = False,
    output: Output = None,
) -> None:
    """Check a server URL and API key with the server, then store them.

    Prompts for what is not given. The file (mode 0600) is
    $XDG_CONFIG_HOME/aenv/config.toml; AENV_SERVER and AENV_API_KEY override it."""
    if ctx.invoked_subcommand is not None:
        return
    fmt = use_output(output)
    if show:
        show_auth(fmt)
        return
    current = settings_store.load()
    if server is None:
        server = (
            typer.prompt("Server URL", default=current.server)
            if sys.stdin.isatty()
            else current.server
        )
    if key is None:
        key = typer.prompt("API key", hide_input=True)
    server = settings_store.normalize_server(server)
    key = key.strip()
    if not key:
        raise CliError("the API key is empty", ExitCode.USAGE)
    with control_plane(settings=Settings(server, key, "argument", "argument")) as cp:
        health = cp.health()
        cp.check_key()
    path = settings_store.save(server, key)
    if json_requested():
        print_json({"server": server, "configFile": str(path), "version": health.version})
    else:
        note(f"authenticated with {server}; stored in {path}")
    overridden = [
        name
        for name, source in (
            (settings_store.SERVER_ENV, current.server_source),
            (settings_store.API_KEY_ENV, current.api_key_source),
        )
        if source == "env"
    ]
    if overridden:
        note(f"{' and '.join(overridden)} in the environment override the stored values")


@auth_app.command("status")
def auth_status(output: Output = None) -> None:
    """Show the settings in use and check them with the server (same as --show)."""
    show_auth(use_output(output))


@auth_app.command("logout")
def auth_logout(output: Output = None) -> None:
    """Forget the stored server URL and API key."""
    use_output(output)
    removed = settings_store.forget()
    path = settings_store.config_path()
    if json_requested():
        print_json({"configFile": str(path), "removed": removed})
    else:
        note(f"removed {path}" if removed else f"nothing stored at {path}")


def show_auth(fmt: OutputFormat) -> None:
    current = settings_store.load()
    path = settings_store.config_path()
    problem: CliError | None = None
    status = "ok"
    try:
        with control_plane(need_key=False, settings=current) as cp:
            health = cp.health()
            current.require_api_key()
            cp.check_key()
        status = f"ok (agentenv {health.version}, {health.vmm}/{health.accel})"
    except CliError as exc:
        problem = exc
        status = {
            ExitCode.AUTH: "not authenticated",
            ExitCode.UNREACHABLE: "unreachable",
        }.get(exc.exit_code, "error")
    masked = settings_store.mask_key(current.api_key) if current.api_key else None
    if fmt is OutputFormat.JSON:
        print_json(
            {
                "server": current.server,
                "serverSource": current.server_source,
                "apiKey": masked,
                "apiKeySource": current.api_key_source,
                "configFile": str(path),
                "status": status,
            }
        )
    else:
        table(
            ("", ""),
            [
                ("server", f"{current.server}  ({current.server_source})"),
                ("api key", f"{masked or '-'}  ({current.api_key_source})"),
                ("config", f"{path}" + ("" if path.exists() else "  (not written)")),
                ("status", status),
            ],
        )
    if problem is not None:
        # The status above already says what is wrong, in the JSON output too.
        raise CliError(problem.message, problem.exit_code, json_output=False)


# -- node and templates --------------------------------------------------------------------
@app.command()
def server(
    listen: Annotated[str | None, typer.Option(help="host:port to listen on")] = None,
    home: Annotated[str | None, typer.Option(help="data directory")] = None,
) -> None:
    """Start a node server here (same as aenv-server)."""
    from agentenv.server import main as server_main

    argv = []
    if listen:
        argv += ["--listen", listen]
    if home:
        argv += ["--home", home]
    server_main(argv)


@app.command()
def health(output: Output = None) -> None:
    """Show the server's health: VMM, accelerator, templates (needs no API key)."""
    fmt = use_output(output)
    with control_plane(need_key=False) as cp:
        status = cp.health()
    if fmt is OutputFormat.JSON:
        print_json(as_sent(status))
        return
    rows = [
        ("status", status.status),
        ("version", status.version),
        ("vmm", f"{status.vmm} ({status.accel})"),
        ("sandboxes", str(status.sandboxes)),
    ]
    if status.mode_reason:
        # Older servers do not say why.
        rows.insert(3, ("mode reason", status.mode_reason))
    rows += [(f"template {name}", state) for name, state in status.templates.items()]
    if status.disk is not None:
        disk = status.disk
        floor = f", floor {_gib(disk.floor_bytes)}" if disk.floor_bytes else ""
        rows.append(("disk", f"{_gib(disk.free_bytes)} free of {_gib(disk.total_bytes)}{floor}"))
    if status.detail:
        rows.append(("detail", status.detail))
    table(("", ""), rows, title=cp.server)


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


@template_app.command("ls")
def template_ls(output: Output = None) -> None:
    """List templates (built in, built from images and Dockerfiles) with their state,
    and the snapshots that serve as templates."""
    fmt = use_output(output)
    with control_plane() as cp:
        health_templates = cp.health().templates
        built = cp.list_templates()
        snapshots = cp.list_snapshots()
    items: list[JsonObject] = [
        {
            "templateID": t.template_id,
            "kind": "template",
            "state": t.build_status,
            "names": [n for n in t.names if n != t.template_id],
            "createdAt": as_sent(t.created_at),
        }
        for t in built
    ]
    listed = {t.template_id for t in built}
    items += [
        {"templateID": name, "kind": "template", "state": state, "names": []}
        for name, state in health_templates.items()
        if name not in listed
    ]
    items += [
        {
            "templateID": snap.snapshot_id,
            "kind": "snapshot",
            "state": "ready",
            "names": snap.names,
            "sandboxID": snap.sandbox_id,
            "createdAt": as_sent(snap.created_at),
        }
        for snap in snapshots
    ]
    if fmt is OutputFormat.JSON:
        print_json(items)
        return
    table(
        ("TEMPLATE", "KIND", "STATE", "NAMES", "FROM SANDBOX", "CREATED"),
        [
            (
                item["templateID"],
                item["kind"],
                item["state"],
                ", ".join(item["names"]) or "-",
                item.get("sandboxID") or "-",
                ago(item.get("createdAt")),
            )
            for item in items
        ],
    )


@template_app.command("rm")
def template_rm(
    names: Annotated[list[str], typer.Argument(metavar="NAME", help="template or snapshot")],
    output: Output = None,
) -> None:
    """Delete templates (snapshots; built-in templates cannot be deleted)."""
    use_output(output)
    with control_plane() as cp:
        remove_each(names, cp.delete_template)


def build_template(
    cp: ControlPlane, template: Any, name: str, cpus: int | None, memory: int | None
) -> JsonObject:
    """Build ``template`` (an SDK ``Template``) on the server under ``name``, printing
    its build log on stderr when that is a terminal; the template's ids."""
    from e2b import Template
    from e2b.exceptions import BuildException

    show_logs = sys.stderr.isatty()

    def on_log(entry: Any) -> None:
        if show_logs:
            print(f"{entry.level:>5} {entry.message}", file=sys.stderr)

    try:
        info = Template.build(
            template,
            name,
            cpu_count=cpus or 2,
            memory_mb=memory or 512,
            on_build_logs=on_log,
            **{k: v for k, v in cp.sdk_options().items() if k != "sandbox_url"},
        )
    except BuildException as exc:
        raise CliError(f"build of {name!r} failed: {exc}") from exc
    except Exception as exc:
        raise translate(exc, cp.server) from exc
    return {"templateID": info.template_id, "buildID": info.build_id, "name": name}


Cpus = Annotated[int | None, typer.Option("--cpu", help="vCPUs of the template's sandboxes")]
MemoryMB = Annotated[int | None, typer.Option("--memory", help="RAM in MiB of its sandboxes")]


@template_app.command("build")
def template_build(
    dockerfile: Annotated[Path, typer.Argument(help="Dockerfile (its directory is the context)")],
    name: Annotated[str, typer.Option("--name", "-n", help="template name")],
    cpu: Cpus = None,
    memory: MemoryMB = None,
    output: Output = None,
) -> None:
    """Build a template from a Dockerfile: FROM, RUN, ENV, WORKDIR, USER, COPY, CMD."""
    use_output(output)
    from e2b import Template

    if not dockerfile.is_file():
        raise CliError(f"{dockerfile}: no such file", ExitCode.NOT_FOUND)
    try:
        template = Template(file_context_path=str(dockerfile.parent)).from_dockerfile(
            str(dockerfile)
        )
    except Exception as exc:
        raise CliError(f"{dockerfile}: {exc}", ExitCode.USAGE) from exc
    with control_plane() as cp, busy(f"building {name}"):
        result = build_template(cp, template, name, cpu, memory)
    print_ids([result["templateID"]], result)


@app.command()
def pull(
    image: Annotated[str, typer.Argument(help="OCI image, e.g. registry:5000/team/app:1")],
    name: Annotated[str, typer.Option("--name", "-n", help="template name")],
    cpu: Cpus = None,
    memory: MemoryMB = None,
    output: Output = None,
) -> None:
    """Make a template from an OCI image (pulled by the server, cached by digest)."""
    use_output(output)
    from e2b import Template

    with control_plane() as cp, busy(f"pulling {image}"):
        result = build_template(cp, Template().from_image(image), name, cpu, memory)
    print_ids([result["templateID"]], result)


# -- sandboxes -----------------------------------------------------------------------------
@app.command()
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


app.command("connect")(connect)
app.command("cn", hidden=True)(connect)


@app.command("exec")
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


@app.command("ls")
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


@app.command()
def pause(sandbox_id: SandboxId, output: Output = None) -> None:
    """Pause a sandbox (memory and disk are kept; resume or connect wakes it)."""
    use_output(output)
    with control_plane() as cp, busy(f"pausing {sandbox_id}"):
        cp.pause(sandbox_id)
    print_ids([sandbox_id], {"sandboxID": sandbox_id, "state": "paused"})


@app.command()
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


@app.command("timeout")
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


@app.command()
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


app.command("rm")(remove)
app.command("delete", hidden=True)(remove)


def remove_each(ids: Sequence[str], delete: Any) -> None:
    """Delete each of ``ids``, printing those done; the failures are reported one line
    each and the last one's exit code ends aenv."""
    done: list[str] = []
    failures: list[CliError] = []
    for item in ids:
        try:
            delete(item)
        except CliError as exc:
            if exc.exit_code in (ExitCode.AUTH, ExitCode.UNREACHABLE):
                raise  # the same for every id
            failures.append(exc)
        else:
            done.append(item)
    print_ids(done, {"removed": done, "failed": [f.message for f in failures]})
    for failure in failures[:-1]:
        note(failure.message)
    if failures:
        last = failures[-1]
        raise CliError(last.message, last.exit_code, json_output=False)


# -- snapshots -----------------------------------------------------------------------------
@snapshot_app.command("create")
def snapshot_create(
    sandbox_id: SandboxId,
    name: Annotated[str | None, typer.Option("--name", help="name to start sandboxes by")] = None,
    output: Output = None,
) -> None:
    """Snapshot a running sandbox (it keeps running); prints the snapshot id."""
    use_output(output)
    with control_plane() as cp, busy(f"snapshotting {sandbox_id}"):
        snapshot = cp.create_snapshot(sandbox_id, name)
    print_ids([snapshot.snapshot_id], as_sent(snapshot))


@snapshot_app.command("ls")
def snapshot_ls(
    sandbox_id: Annotated[
        str | None, typer.Option("--sandbox", help="only this sandbox's snapshots")
    ] = None,
    output: Output = None,
) -> None:
    """List snapshots."""
    fmt = use_output(output)
    with control_plane() as cp:
        items = cp.list_snapshots(sandbox_id)
    if fmt is OutputFormat.JSON:
        print_json([as_sent(item) for item in items])
        return
    if not items:
        note("no snapshots")
        return
    table(
        ("SNAPSHOT", "NAMES", "SANDBOX", "TEMPLATE", "CREATED"),
        [
            (
                item.snapshot_id,
                ", ".join(item.names) or "-",
                item.sandbox_id or "-",
                item.template_id or "-",
                ago(item.created_at),
            )
            for item in items
        ],
    )


@snapshot_app.command("rm")
def snapshot_rm(
    snapshot_ids: Annotated[list[str], typer.Argument(metavar="SNAPSHOT", help="id or name")],
    output: Output = None,
) -> None:
    """Delete snapshots (their files go once no sandbox uses them)."""
    use_output(output)
    with control_plane() as cp:
        remove_each(snapshot_ids, cp.delete_snapshot)


# -- files ---------------------------------------------------------------------------------
@app.command()
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


@app.command()
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


# -- entry point ---------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run aenv; its exit status. Errors are reported here, once, as one line."""
    try:
        result = app(
            args=list(argv) if argv is not None else None,
            prog_name="aenv",
            standalone_mode=False,
        )
    except SystemExit as exc:  # shell completion exits on its own
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else ExitCode.ERROR)
    except typer.TyperException as exc:
        # Typer's own (vendored click) errors: usage problems exit with 2.
        if type(exc).__name__ == "NoArgsIsHelpError":
            return ExitCode.USAGE  # the help text is already printed
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        code = ExitCode.USAGE if exc.exit_code == ExitCode.USAGE else ExitCode.ERROR
        report_error(CliError(f"{exc.format_message()}{where}", code))
        return code
    except typer.Abort:
        report_error(CliError("aborted"))
        return ExitCode.ERROR
    except CliError as exc:
        report_error(exc)
        return exc.exit_code
    except BrokenPipeError:
        # The reader of our stdout went away (`aenv ls | head`): nothing left to say.
        # Point fd 1 at /dev/null so the interpreter's final flush has nowhere to fail.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.ERROR
    except Exception as exc:
        error = translate(exc, _server_for_errors())
        report_error(error)
        return error.exit_code
    # Without standalone mode, click hands back the exit code of a typer.Exit.
    return result if isinstance(result, int) else ExitCode.OK


def _server_for_errors() -> str:
    try:
        return settings_store.load().server
    except CliError:
        return settings_store.DEFAULT_SERVER

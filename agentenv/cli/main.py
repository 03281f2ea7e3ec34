"""``aenv``'s Typer app and entry point. It owns the root of the command line (the app,
``--version`` and the root help), the node commands ``server`` and ``health``, the order
in which the command modules (``auth_commands``, ``template_commands``,
``sandbox_commands``) are added, and ``main``, which runs the app and reports every
failure once, as one line with its exit code.

Each command resolves the settings, talks to the server through ``ControlPlane`` (the
control-plane routes, by ``agentenv.client``) or an SDK ``Sandbox`` (envd), and prints
through ``output``; failures are raised as ``CliError`` and reported by ``main``. The
commands themselves live in their modules, not here."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Annotated

import typer

from agentenv import __version__
from agentenv.cli import auth_commands, sandbox_commands, template_commands
from agentenv.cli import settings as settings_store
from agentenv.cli.command_helpers import Output, control_plane
from agentenv.cli.errors import CliError, ExitCode, translate
from agentenv.cli.output import OutputFormat, as_sent, print_json, report_error, table, use_output

# The e2b SDK, and the modules using it (terminal, transfer), are imported by the commands
# that need them: it takes about half a second to import, which `aenv ls` and every shell
# completion would otherwise pay. The control plane (agentenv.client, with Pydantic and
# the API models) is imported once a command talks to the server, which --help and shell
# completion never do. The command modules keep to this too.

app = typer.Typer(
    name="aenv",
    help="agentenv: microVM sandboxes for agents. Talks to an agentenv server over HTTP.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


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
    """Show the server's health: VMM, accelerator, templates."""
    fmt = use_output(output)
    with control_plane() as cp:
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


# `aenv --help` lists the commands (server and health above first), then the groups
# (auth, template, snapshot), each in the order they are added here.
auth_commands.register(app)
template_commands.register(app)
sandbox_commands.register(app)


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

"""``aenv auth``: checking a server URL and API key with the server, storing them in the
user's config file (through ``settings``), showing the settings in use and forgetting
them. It owns that group only; ``main`` adds it to the ``aenv`` app by ``register``.
Like every command it reaches the server only through ``ControlPlane`` and must not
touch server internals."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from agentenv.cli import settings as settings_store
from agentenv.cli.command_helpers import Output, control_plane
from agentenv.cli.errors import CliError, ExitCode
from agentenv.cli.output import OutputFormat, json_requested, note, print_json, table, use_output
from agentenv.cli.settings import Settings

auth_app = typer.Typer(help="Store and check the server URL and API key.")


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
        current.require_api_key()
        with control_plane(settings=current) as cp:
            health = cp.health()
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


def register(app: typer.Typer) -> None:
    """Add the ``auth`` group to ``app``."""
    app.add_typer(auth_app, name="auth")

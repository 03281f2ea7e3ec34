"""``aenv``: the command line for people. For now it starts the server and shows the
node's health; the full sandbox commands build on the HTTP API."""

from __future__ import annotations

import json
import os

import httpx
import typer

app = typer.Typer(help="agentenv: microVM sandboxes for agents.", no_args_is_help=True)


def _server() -> str:
    return os.environ.get("AENV_SERVER", "http://127.0.0.1:8000").rstrip("/")


@app.command()
def server(
    listen: str | None = typer.Option(None, help="host:port to listen on"),
    home: str | None = typer.Option(None, help="data directory"),
) -> None:
    """Start a node server (same as aenv-server)."""
    from agentenv.server import main as server_main

    argv = []
    if listen:
        argv += ["--listen", listen]
    if home:
        argv += ["--home", home]
    server_main(argv)


@app.command()
def health() -> None:
    """Show the server's health (VMM, accelerator, templates)."""
    try:
        response = httpx.get(f"{_server()}/health", timeout=10)
    except httpx.HTTPError as exc:
        typer.echo(f"aenv: cannot reach {_server()}: {exc}", err=True)
        raise typer.Exit(3) from exc
    typer.echo(json.dumps(response.json(), indent=2))


def main() -> None:
    app()

"""What every group of ``aenv`` commands shares: the option types (``--output``,
``--user``, the sandbox ``ID`` argument), opening the control plane, ``KEY=VALUE``
parsing, the spinner, printing an action's ids and removing several things at once.

It holds no command and adds nothing to the Typer apps (``main`` has the command modules
do that), so the command modules import it and never each other. Like them it must not
import the ``e2b`` SDK or ``agentenv.client`` at import time: ``--help`` and shell
completion load it too."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer

from agentenv.cli import settings as settings_store
from agentenv.cli.errors import CliError, ExitCode
from agentenv.cli.output import (
    OutputFormat,
    json_requested,
    note,
    print_json,
    print_lines,
    stderr_console,
)
from agentenv.cli.settings import Settings

# The control plane (agentenv.client, with Pydantic and the API models) is imported once
# a command talks to the server, which --help and shell completion never do.
if TYPE_CHECKING:
    from agentenv.cli.api import ControlPlane

JsonObject = dict[str, Any]

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

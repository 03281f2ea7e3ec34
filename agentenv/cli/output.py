"""How aenv prints: Rich tables for people, JSON for programs, one line per error.

Listings print a table when stdout is a terminal and JSON otherwise (``--output``
decides explicitly). Commands whose result is an id (``start --detach``, ``fork``,
``snapshot create``, ``pause``, ...) print just the id(s), one per line, so
``ID=$(aenv start -d base)`` works; ``--output json`` gives the full objects instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.table import Table

from agentenv.cli.errors import CliError


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"


class _State:
    # The format the running command was asked for explicitly; errors are also given
    # as JSON on stdout when it is JSON.
    requested: OutputFormat | None = None


def use_output(requested: OutputFormat | None) -> OutputFormat:
    """Record the command's ``--output`` and resolve the format for listings."""
    _State.requested = requested
    if requested is not None:
        return requested
    return OutputFormat.TABLE if sys.stdout.isatty() else OutputFormat.JSON


def json_requested() -> bool:
    return _State.requested is OutputFormat.JSON


def stdout_console() -> Console:
    return Console(soft_wrap=False)


def stderr_console() -> Console:
    return Console(stderr=True)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")
    sys.stdout.flush()


def as_sent(value: object, *, exclude_none: bool = False) -> Any:
    """``value`` (an API model, or a field of one) as the server's JSON has it, field
    aliases and ISO times, for ``--output json``; ``exclude_none`` for the routes that
    leave unset fields out rather than send null."""
    import pydantic_core  # only commands that had an answer from the server need it

    return pydantic_core.to_jsonable_python(value, by_alias=True, exclude_none=exclude_none)


def print_lines(lines: Iterable[str]) -> None:
    for line in lines:
        sys.stdout.write(line + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    """A remark for the person at the terminal (stderr, so stdout stays parseable)."""
    sys.stderr.write(f"aenv: {message}\n")
    sys.stderr.flush()


def report_error(error: CliError) -> None:
    """One human line on stderr; with ``--output json`` also ``{"error", "code"}`` on
    stdout, where a program reading the JSON output looks."""
    sys.stderr.write(f"aenv: {error.message}\n")
    sys.stderr.flush()
    if json_requested() and error.json_output:
        try:
            print_json({"error": error.message, "code": int(error.exit_code)})
        except OSError:
            pass  # stdout closed: the stderr line is what is left


def table(columns: Sequence[str], rows: Iterable[Sequence[str]], title: str | None = None) -> None:
    """A borderless table; one without column names (all empty) has no header row."""
    view = Table(
        title=title, box=None, header_style="bold", pad_edge=False, show_header=any(columns)
    )
    for column in columns:
        view.add_column(column, overflow="fold")
    for row in rows:
        view.add_row(*row)
    stdout_console().print(view)


def parse_time(value: object) -> datetime | None:
    """An API model's time, or one as JSON gives it (ISO 8601); naive ones are UTC."""
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    else:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def human_duration(seconds: float) -> str:
    seconds = int(abs(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def ago(value: object) -> str:
    moment = parse_time(value)
    if moment is None:
        return "-"
    return human_duration((datetime.now(UTC) - moment).total_seconds()) + " ago"


def until(value: object) -> str:
    moment = parse_time(value)
    if moment is None:
        return "-"
    left = (moment - datetime.now(UTC)).total_seconds()
    return "now" if left <= 0 else "in " + human_duration(left)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"

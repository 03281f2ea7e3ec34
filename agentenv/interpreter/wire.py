"""The NDJSON lines of a streamed ``POST /execute`` answer, as the SDK's ``parse_output``
reads them: one JSON object per line with a ``type`` of ``stdout``, ``stderr``,
``result``, ``error`` or ``number_of_executions`` (others are ignored by the SDK: the
stream ends with ``end_of_execution``, and a silent stretch carries ``keepalive`` lines).

A Jupyter MIME bundle becomes a ``result``: the MIME types the SDK's ``Result`` names get
its fields (``text/plain`` → ``text``, ``image/png`` → ``png``, ...), any other goes to
``extra``. No single field may exceed ``MAX_FIELD_CHARS``: a longer text is cut with a
marker saying so; a longer image or JSON value is left out and named in ``extra``.
"""

from __future__ import annotations

import json
import time
from typing import Any

# Per field of a line: 16 MiB of characters, far above any figure or table a notebook
# shows, low enough that a runaway print cannot exhaust the guest or the client.
MAX_FIELD_CHARS = 16 * 1024 * 1024
TRUNCATED_MARKER = "\n[agentenv: output truncated: {dropped} characters over the {limit} limit]"

MIME_FIELDS: dict[str, str] = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
# Fields whose value cannot be cut and stay meaningful.
_UNCUTTABLE = {"svg", "png", "jpeg", "pdf", "json", "javascript"}


def now_ns() -> int:
    return time.time_ns()


def line(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"type": kind, **fields}) + "\n").encode()


def cut(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + TRUNCATED_MARKER.format(dropped=len(text) - limit, limit=limit)


def stream(name: str, text: str) -> bytes:
    """A chunk of stdout or stderr."""
    return line(name, text=cut(text), timestamp=now_ns())


def error(name: str, value: str, traceback: str) -> bytes:
    return line("error", name=name, value=cut(value), traceback=cut(traceback))


def execution_count(count: int) -> bytes:
    return line("number_of_executions", execution_count=count)


def keepalive() -> bytes:
    """A line the SDK ignores (unknown type), sent while code runs silently: writing it
    is how a client that went away is noticed, here and by any proxy on the way."""
    return line("keepalive")


def end() -> bytes:
    return line("end_of_execution")


def result(bundle: dict[str, Any], *, is_main_result: bool, limit: int = MAX_FIELD_CHARS) -> bytes:
    """A Jupyter MIME bundle (execute_result or display_data ``data``) as a result line."""
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        name = MIME_FIELDS.get(mime)
        size = len(value) if isinstance(value, str) else len(json.dumps(value))
        if size > limit and (name is None or name in _UNCUTTABLE):
            extra.setdefault("agentenv_omitted", []).append(
                f"{mime}: {size} characters, over the {limit} limit"
            )
            continue
        if name is None:
            extra[mime] = value
        else:
            fields[name] = cut(value, limit) if isinstance(value, str) else value
    if extra:
        fields["extra"] = extra
    return line("result", is_main_result=is_main_result, **fields)

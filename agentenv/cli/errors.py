"""Exit codes and the one error type the commands raise: every failure, whether from
the HTTP API, the ``e2b`` SDK, the network or the local filesystem, becomes a
``CliError`` carrying one human line and the documented exit code.

Exit codes (also in the README):

====  ==============================================================================
code  meaning
====  ==============================================================================
0     success
1     error (the server refused the request, a fork child failed, a transfer broke)
2     usage: bad arguments or options
3     authentication: no API key configured, or the server rejected it
4     not found: unknown sandbox, snapshot, template or file
5     server unreachable: connection refused, DNS failure, connect timeout
6     conflict: e.g. pausing a paused sandbox, deleting a built-in template
7     not supported yet: the server lacks the feature (template build, pull)
====  ==============================================================================

``aenv exec`` and ``aenv start``/``connect`` exit with the guest command's or shell's
own status once it ran, so those codes can overlap the ones above.
"""

from __future__ import annotations

from enum import IntEnum

import httpx


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    AUTH = 3
    NOT_FOUND = 4
    UNREACHABLE = 5
    CONFLICT = 6
    NOT_SUPPORTED = 7


class CliError(Exception):
    """A failure to report as one line on stderr, ending aenv with ``exit_code``."""

    def __init__(
        self, message: str, exit_code: ExitCode = ExitCode.ERROR, *, json_output: bool = True
    ) -> None:
        # One line, whatever the source put into it (server messages, SDK errors).
        self.message = " ".join(message.split())
        self.exit_code = exit_code
        # False when the command already printed its JSON result, failures included, so
        # stdout does not get a second document.
        self.json_output = json_output
        super().__init__(self.message)


def exit_code_for_status(status: int) -> ExitCode:
    """The exit code for an HTTP error status from the API."""
    if status == 401 or status == 403:
        return ExitCode.AUTH
    if status == 404:
        return ExitCode.NOT_FOUND
    if status == 409:
        return ExitCode.CONFLICT
    if status == 501:
        return ExitCode.NOT_SUPPORTED
    return ExitCode.ERROR


def unreachable(server: str, exc: BaseException) -> CliError:
    reason = str(exc).split(": ")[-1] or type(exc).__name__
    return CliError(
        f"cannot reach the server at {server} ({reason}); is it running? "
        "Set AENV_SERVER or run `aenv auth`",
        ExitCode.UNREACHABLE,
    )


def translate(exc: BaseException, server: str) -> CliError:
    """A ``CliError`` for an exception raised by httpx, the ``e2b`` SDK or the OS."""
    # Imported here: the SDK takes half a second to import, which commands that never
    # use it (and shell completion) should not pay.
    from e2b.exceptions import (
        AuthenticationException,
        NotFoundException,
        SandboxException,
        TimeoutException,
    )

    if isinstance(exc, CliError):
        return exc
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.UnsupportedProtocol):
        return unreachable(server, exc)
    if isinstance(exc, httpx.TimeoutException):
        return CliError(f"the server at {server} did not answer in time ({exc})")
    if isinstance(exc, httpx.HTTPError):
        return CliError(f"connection to {server} failed: {exc or type(exc).__name__}")
    if isinstance(exc, AuthenticationException):
        return CliError(f"the server rejected the API key: {exc}", ExitCode.AUTH)
    if isinstance(exc, NotFoundException):
        return CliError(str(exc) or "not found", ExitCode.NOT_FOUND)
    if isinstance(exc, TimeoutException):
        return CliError(f"timed out: {exc}")
    if isinstance(exc, SandboxException):
        status = getattr(exc, "status_code", None)
        code = exit_code_for_status(status) if isinstance(status, int) else ExitCode.ERROR
        return CliError(str(exc) or type(exc).__name__, code)
    if isinstance(exc, FileNotFoundError):
        return CliError(f"{exc.filename}: no such file or directory", ExitCode.NOT_FOUND)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return CliError(f"{where}{exc.strerror or exc}")
    return CliError(f"unexpected error: {type(exc).__name__}: {exc}")

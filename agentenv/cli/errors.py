"""Exit codes and the one error type the commands raise: every failure, whether from
the HTTP API (as ``agentenv.client`` reports it), the ``e2b`` SDK, the network or the
local filesystem, becomes a ``CliError`` carrying one human line and the documented exit
code.

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
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from agentenv.client.errors import AgentEnvError


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


def exit_code_for(error: AgentEnvError) -> ExitCode:
    """The exit code for a failure ``agentenv.client`` reported; the client maps HTTP
    statuses to its error classes, this maps the classes to exit codes."""
    # The client (and with it Pydantic and the API models) is imported where it is used,
    # so that what needs no server (--help, shell completion) does not pay for it.
    from agentenv.client.errors import (
        AuthError,
        ConflictError,
        NotFoundError,
        NotSupportedError,
        UnreachableError,
    )

    exit_codes: tuple[tuple[type[AgentEnvError], ExitCode], ...] = (
        (AuthError, ExitCode.AUTH),
        (NotFoundError, ExitCode.NOT_FOUND),
        (ConflictError, ExitCode.CONFLICT),
        (NotSupportedError, ExitCode.NOT_SUPPORTED),
        (UnreachableError, ExitCode.UNREACHABLE),
    )
    for cls, code in exit_codes:
        if isinstance(error, cls):
            return code
    return ExitCode.ERROR


def unreachable(server: str, exc: BaseException) -> CliError:
    reason = str(exc).split(": ")[-1] or type(exc).__name__
    return CliError(
        f"cannot reach the server at {server} ({reason}); is it running? "
        "Set AENV_SERVER or run `aenv auth`",
        ExitCode.UNREACHABLE,
    )


def client_error(error: AgentEnvError, server: str, what: str | None = None) -> CliError:
    """A ``CliError`` for a failure ``agentenv.client`` reported: the server's message,
    prefixed by ``what`` failed when given; a rejected key says how to fix it."""
    from agentenv.client.errors import NoAnswerError, UnreachableError

    # The transport's own exception words why no answer came better than the client's
    # summary of it.
    cause = error.__cause__ if isinstance(error.__cause__, httpx.HTTPError) else error
    reason = str(cause) or type(cause).__name__
    if isinstance(error, UnreachableError):
        return unreachable(server, cause)
    if isinstance(error, NoAnswerError):
        return CliError(f"the server at {server} did not answer in time ({reason})")
    if error.status is None and cause is not error:
        return CliError(f"connection to {server} failed: {reason}")
    message = error.message
    if error.status == 401:
        message = f"the server at {server} rejected the API key ({message}); run `aenv auth`"
    elif what:
        message = f"{what}: {message}"
    return CliError(message, exit_code_for(error))


def translate(exc: BaseException, server: str, what: str | None = None) -> CliError:
    """A ``CliError`` for an exception raised by ``agentenv.client`` (with ``what`` as
    ``client_error`` has it), httpx, the ``e2b`` SDK or the OS."""
    from agentenv.client.errors import AgentEnvError, error_for

    if isinstance(exc, CliError):
        return exc
    if isinstance(exc, AgentEnvError):
        return client_error(exc, server, what)
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.UnsupportedProtocol):
        return unreachable(server, exc)
    if isinstance(exc, httpx.TimeoutException):
        return CliError(f"the server at {server} did not answer in time ({exc})")
    if isinstance(exc, httpx.HTTPError):
        return CliError(f"connection to {server} failed: {exc or type(exc).__name__}")
    # Imported here, after the client's errors: the SDK takes half a second to import,
    # which commands that never use it (and shell completion) should not pay.
    from e2b.exceptions import (
        AuthenticationException,
        NotFoundException,
        SandboxException,
        TimeoutException,
    )

    if isinstance(exc, AuthenticationException):
        return CliError(f"the server rejected the API key: {exc}", ExitCode.AUTH)
    if isinstance(exc, NotFoundException):
        return CliError(str(exc) or "not found", ExitCode.NOT_FOUND)
    if isinstance(exc, TimeoutException):
        return CliError(f"timed out: {exc}")
    if isinstance(exc, SandboxException):
        status = getattr(exc, "status_code", None)
        code = exit_code_for(error_for(status, "")) if isinstance(status, int) else ExitCode.ERROR
        return CliError(str(exc) or type(exc).__name__, code)
    if isinstance(exc, FileNotFoundError):
        return CliError(f"{exc.filename}: no such file or directory", ExitCode.NOT_FOUND)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return CliError(f"{where}{exc.strerror or exc}")
    return CliError(f"unexpected error: {type(exc).__name__}: {exc}")

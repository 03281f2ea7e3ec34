"""One exception hierarchy for everything the client reports: HTTP errors mapped from the
server's JSON ``{"code", "message"}`` body, transport failures, and the SDK's exceptions
from the control-plane calls the client makes through it (create, connect). The classes,
not status numbers, are what callers (the ``aenv`` CLI among them) branch on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx


class AgentEnvError(Exception):
    """A request failed. ``status`` is the HTTP status (or the ``code`` of a fork child's
    error), ``None`` when no response arrived."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message if self.status is None else f"{self.status}: {self.message}"


class InvalidRequestError(AgentEnvError):
    """400: the server rejected the request (unknown template, bad body, ...)."""


class AuthError(AgentEnvError):
    """401 or 403: the API key is missing or wrong."""


class NotFoundError(AgentEnvError):
    """404: no such sandbox or snapshot."""


class ConflictError(AgentEnvError):
    """409: the sandbox is not in a state that allows the operation."""


class NotSupportedError(AgentEnvError):
    """501: the server lacks the feature."""


class UnreachableError(AgentEnvError):
    """No connection to the server could be made."""


class NoAnswerError(AgentEnvError):
    """Connected, but no answer came in time; the request may still have taken effect."""


_BY_STATUS: dict[int, type[AgentEnvError]] = {
    400: InvalidRequestError,
    401: AuthError,
    403: AuthError,
    404: NotFoundError,
    409: ConflictError,
    501: NotSupportedError,
}


def error_for(status: int, message: str) -> AgentEnvError:
    return _BY_STATUS.get(status, AgentEnvError)(status, message)


def error_from_response(response: httpx.Response) -> AgentEnvError:
    """The exception for a non-2xx response. agentenv always answers ``{code, message}``;
    anything else (a proxy's HTML page, say) is reported by its status and text."""
    message = ""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        message = body["message"]
    if not message:
        message = response.text.strip()[:300] or response.reason_phrase
    return error_for(response.status_code, message)


def error_from_transport(exc: httpx.TransportError, url: str) -> AgentEnvError:
    """Failing to connect (or a URL no connection can be made to, such as ``ftp://``)
    means the server is unreachable; a failure once connected (a read timeout during a
    long fork, a dropped connection) is reported as such, since the request may have
    taken effect."""
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.UnsupportedProtocol):
        return UnreachableError(None, f"cannot reach {url}: {reason}")
    if isinstance(exc, httpx.TimeoutException):
        return NoAnswerError(None, f"no answer from {url} in time: {reason}")
    return AgentEnvError(None, f"request to {url} failed: {reason}")


@contextlib.contextmanager
def translated_sdk_errors(server: str) -> Iterator[None]:
    """Raise the SDK's control-plane exceptions inside the block as this client's, so a
    caller handles one hierarchy whichever way a call went. (Works around ``await`` too.)"""
    # Imported here: the SDK takes most of a second to import, which callers of the HTTP
    # routes alone (most ``aenv`` commands) should not pay.
    import e2b

    try:
        yield
    except httpx.TransportError as exc:
        raise error_from_transport(exc, server) from exc
    except e2b.AuthenticationException as exc:
        raise AuthError(401, _without_status(str(exc), 401)) from exc
    except e2b.NotFoundException as exc:
        raise NotFoundError(404, _without_status(str(exc), 404)) from exc
    except e2b.InvalidArgumentException as exc:
        raise InvalidRequestError(exc.status_code or 400, str(exc)) from exc
    except e2b.ServiceBusyException as exc:
        raise AgentEnvError(503, _without_status(str(exc), 503)) from exc
    except e2b.SandboxException as exc:
        status = exc.status_code
        if status is None:
            raise AgentEnvError(None, str(exc)) from exc
        raise error_for(status, _without_status(str(exc), status)) from exc


def _without_status(message: str, status: int) -> str:
    # The SDK prefixes its messages with the status, which AgentEnvError shows already.
    return message.removeprefix(f"{status}: ")

"""Signed ``/files`` URLs that name no sandbox.

With ``E2B_SANDBOX_URL`` (and in the SDK's debug mode) every sandbox's envd is reached at
one URL, and the SDK names the sandbox in ``E2b-Sandbox-Id`` headers. A signed download
or upload URL (``download_url``/``upload_url``) is ``{that URL}/files?path=…&signature=…``
and is meant for clients that send no such header (browsers, curl), so the URL names no
sandbox. The signature does identify one, though: it is a hash over the sandbox's access
token (``agentenv.envd.signatures``). The proxy finds the sandbox whose token produced it
and forwards the request there, where envd checks the signature again; a URL whose
signature no sandbox's token produced is refused here (401, as envd would), and so is an
expired one, before a paused sandbox would be woken for it. A cluster gateway asks each
node which of them holds the signer (:data:`SIGNER_PATH`) and relays the URL there.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterable

from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from agentenv.envd.signatures import (
    SignatureRefused,
    SignedFileRequest,
    operation_of,
    query_params,
)
from agentenv.proxy.paths import PathRefused, RequestPath

FILES_PATH = "/files"
#: Where a cluster gateway, which holds no tokens, asks a node whether one of its
#: sandboxes signed a ``/files`` URL: GET with the URL's query and ``method`` (the
#: method the URL is used with). Unauthenticated like the URL itself: it names the
#: sandbox only to whoever holds a valid signature for it.
SIGNER_PATH = "/signed-files/signer"
SIGNER_METHOD_PARAM = "method"


class FilesNotRouted(Exception):
    """A ``/files`` request that names no sandbox and cannot be routed by its signature."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def signed_files_sandbox(
    scope: Scope, sandbox_tokens: Callable[[], Iterable[tuple[str, str | None]]]
) -> str | None:
    """The sandbox an HTTP request that names none is for: for ``/files``, the one whose
    access token (of ``sandbox_tokens()``' (sandbox id, token) pairs) signed the URL.
    None for any other path (the control plane's). Raises :class:`FilesNotRouted`: 400
    for an unsigned ``/files`` request, 401 for an expired URL or one no token signed."""
    if not is_files_request(scope.get("raw_path") or scope["path"].encode()):
        return None
    params = query_params(scope.get("query_string", b""))
    return _signer(params, scope["method"], sandbox_tokens)


def signer_response(
    scope: Scope, sandbox_tokens: Callable[[], Iterable[tuple[str, str | None]]]
) -> Response:
    """The answer to a :data:`SIGNER_PATH` request: 200 ``{"sandboxID": ...}``, or the
    400 or 401 the URL itself would get here."""
    params = query_params(scope.get("query_string", b""))
    try:
        sandbox_id = _signer(params, params.get(SIGNER_METHOD_PARAM, "GET"), sandbox_tokens)
    except FilesNotRouted as exc:
        return JSONResponse({"code": exc.status, "message": str(exc)}, status_code=exc.status)
    return JSONResponse({"sandboxID": sandbox_id})


def signer_query(query_string: bytes, method: str) -> bytes:
    """The :data:`SIGNER_PATH` query asking about a ``/files`` URL with this query, used
    with ``method``."""
    probe = urllib.parse.urlencode({SIGNER_METHOD_PARAM: method}).encode()
    # Last, so it wins over a parameter of the same name in the URL.
    return query_string + b"&" + probe if query_string else probe


def _signer(
    params: dict[str, str],
    method: str,
    sandbox_tokens: Callable[[], Iterable[tuple[str, str | None]]],
) -> str:
    signed = SignedFileRequest.of(params, operation_of(method.upper()))
    if signed is None:
        raise FilesNotRouted(
            400,
            "this /files request names no sandbox: send E2b-Sandbox-Id, use the "
            "{port}-{sandboxID}.{domain} host, or a signed URL (download_url or upload_url "
            "of a secured sandbox)",
        )
    try:
        return signer_of(signed, sandbox_tokens())
    except SignatureRefused as exc:
        raise FilesNotRouted(401, str(exc)) from None


def is_files_request(raw_path: bytes) -> bool:
    """Whether the request is for envd's ``/files`` (the raw path, checked as the proxy
    checks envd's paths)."""
    try:
        return RequestPath.parse(raw_path).decoded == FILES_PATH
    except PathRefused:
        return False


def signer_of(signed: SignedFileRequest, tokens: Iterable[tuple[str, str | None]]) -> str:
    """The id of the sandbox whose access token signed the URL, of ``(sandbox id, token)``
    pairs. Raises :class:`SignatureRefused` for an expired URL or one no token signed."""
    signed.check_expiration()
    for sandbox_id, token in tokens:
        # Each comparison takes constant time; a sandbox without a token accepts no
        # signature.
        if token and signed.signed_with(token):
            return sandbox_id
    raise SignatureRefused("invalid signature (made for no sandbox on this server)")

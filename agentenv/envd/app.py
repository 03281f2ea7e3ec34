"""envd's ASGI application: a small router in front of connectrpc's applications.

On the public port, ``/process.Process/*`` and ``/filesystem.Filesystem/*`` go to the
Connect services, ``/files`` to the file transfer handler, and ``/health``, ``/envs`` and
``/metrics`` are answered here. Once /init has set an access token every request must carry
it in ``X-Access-Token``, except /health and /files (which also accepts a URL signature,
checked by the handler).

``/init`` is served on the control port only, and that port serves nothing else: it is
the orchestrator's, and the node's proxy never forwards to it (see ``server``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .files import FileTransfer, send_json
from .metrics import MetricsSampler
from .processes import ProcessRegistry
from .state import EnvdState, InitError, InitRequest
from .version import ENVD_VERSION

logger = logging.getLogger("agentenv.envd")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PROCESS_PREFIX = "/process.Process/"
FILESYSTEM_PREFIX = "/filesystem.Filesystem/"
#: Public-port paths that never need the access token (matched exactly).
TOKEN_EXEMPT_PATHS = frozenset({"/health", "/files"})
#: /init bodies are a few env vars and a token; anything this large is a mistake.
MAX_INIT_BODY = 1 << 20


class EnvdApp:
    """Routes requests to the Connect services or the HTTP endpoints."""

    def __init__(
        self,
        state: EnvdState,
        registry: ProcessRegistry,
        *,
        process_app: ASGIApp,
        filesystem_app: ASGIApp,
        control_port: int,
    ) -> None:
        self.state = state
        self.control_port = control_port
        self.registry = registry
        self._process_app = process_app
        self._filesystem_app = filesystem_app
        self._files = FileTransfer(state)
        self._metrics = MetricsSampler()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._route(scope, receive, tracking_send)
        except Exception:
            # One bad request must never take envd down or leave the client hanging.
            logger.exception("unhandled error serving %s %s", scope["method"], scope["path"])
            if not started:
                await send_json(send, 500, {"code": 500, "message": "internal error"})

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        server = scope.get("server") or (None, None)
        if server[1] == self.control_port:
            await self._route_control(path, method, receive, send)
            return
        is_rpc = path.startswith((PROCESS_PREFIX, FILESYSTEM_PREFIX))

        if path not in TOKEN_EXEMPT_PATHS and not self.state.token_matches(
            _header(scope, b"x-access-token")
        ):
            if is_rpc:
                await send_json(
                    send, 401, {"code": "unauthenticated", "message": "invalid access token"}
                )
            else:
                await send_json(send, 401, {"code": 401, "message": "invalid access token"})
            return

        if path.startswith(PROCESS_PREFIX):
            await self._process_app(scope, receive, _connect_error_bodies(send, path))
        elif path.startswith(FILESYSTEM_PREFIX):
            await self._filesystem_app(scope, receive, _connect_error_bodies(send, path))
        elif path == "/health":
            if method not in ("GET", "HEAD"):
                await _method_not_allowed(send, "GET, HEAD")
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": [(b"x-envd-version", ENVD_VERSION.encode())],
                }
            )
            await send({"type": "http.response.body", "body": b""})
        elif path == "/envs":
            if method != "GET":
                await _method_not_allowed(send, "GET")
                return
            await send_json(send, 200, self.state.env_vars)
        elif path == "/files":
            await self._files(scope, receive, send)
        elif path == "/metrics":
            if method != "GET":
                await _method_not_allowed(send, "GET")
                return
            await send_json(send, 200, self._metrics.sample())
        else:
            await send_json(send, 404, {"code": 404, "message": f"no route for {path}"})

    async def _route_control(self, path: str, method: str, receive: Receive, send: Send) -> None:
        if path != "/init":
            await send_json(send, 404, {"code": 404, "message": f"no route for {path}"})
        elif method != "POST":
            await _method_not_allowed(send, "POST")
        else:
            await self._init(receive, send)

    async def _init(self, receive: Receive, send: Send) -> None:
        try:
            body = await _read_body(receive, MAX_INIT_BODY)
            try:
                decoded = json.loads(body) if body.strip() else None
            except (ValueError, UnicodeDecodeError):
                raise InitError("body is not valid JSON") from None
            self.state.apply_init(InitRequest.from_json(decoded))
        except InitError as e:
            await send_json(send, 400, {"code": 400, "message": str(e)})
            return
        await _send_empty(send, 204)


#: Bodyless rejections connectrpc's router sends, as Connect error codes.
_ROUTER_ERRORS = {
    404: ("unimplemented", "unknown procedure {path}"),
    405: ("unimplemented", "{path} only accepts POST"),
    415: ("invalid_argument", "unsupported content type for {path}"),
}


def _connect_error_bodies(send: Send, path: str) -> Send:
    """Give connectrpc's empty routing rejections (unknown method, wrong HTTP method or
    content type) a Connect JSON error body, so every client sees a proper code."""
    pending: list[Message] = []

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            has_type = any(k.lower() == b"content-type" for k, _ in message.get("headers", ()))
            if message["status"] in _ROUTER_ERRORS and not has_type:
                pending.append(message)
                return
        elif pending and message["type"] == "http.response.body":
            start = pending.pop()
            if not message.get("body") and not message.get("more_body", False):
                code, text = _ROUTER_ERRORS[start["status"]]
                await send_json(
                    send, start["status"], {"code": code, "message": text.format(path=path)}
                )
                return
            await send(start)
        await send(message)

    return wrapped


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InitError("client disconnected")
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise InitError(f"body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            decoded: str = value.decode("latin-1")
            return decoded
    return None


async def _send_empty(send: Send, status: int) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def _method_not_allowed(send: Send, allow: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 405,
            "headers": [(b"allow", allow.encode()), (b"content-length", b"0")],
        }
    )
    await send({"type": "http.response.body", "body": b""})


def create_app(state: EnvdState, registry: ProcessRegistry, *, control_port: int) -> EnvdApp:
    """Build envd's application with both Connect services mounted. Requests arriving on
    ``control_port`` are the orchestrator's (``/init``)."""
    # Imported here so `python -m agentenv.envd --help` never pays for connectrpc.
    from .filesystem_service import FilesystemService
    from .gen.filesystem_connect import FilesystemASGIApplication
    from .gen.process_connect import ProcessASGIApplication
    from .process_service import ProcessService
    from .rpc import DeadlineInterceptor, EnvelopeCheck, strict_codecs

    interceptors = (DeadlineInterceptor(),)
    return EnvdApp(
        state,
        registry,
        control_port=control_port,
        process_app=EnvelopeCheck(
            ProcessASGIApplication(
                ProcessService(state, registry),
                interceptors=interceptors,
                compressions=(),
                codecs=strict_codecs(),
            )
        ),
        filesystem_app=EnvelopeCheck(
            FilesystemASGIApplication(
                FilesystemService(state),
                interceptors=interceptors,
                compressions=(),
                codecs=strict_codecs(),
            )
        ),
    )

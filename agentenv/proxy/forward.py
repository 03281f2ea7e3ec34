"""Forwarding HTTP requests to a port inside a sandbox.

A request is sandbox traffic when it carries ``E2b-Sandbox-Id`` (and optionally
``E2b-Sandbox-Port``, default envd's port) or its Host is ``{port}-{sandboxID}.{domain}``.
Bodies stream in both directions without buffering, so Connect server streams and large
uploads pass through as they are produced.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from agentenv.network.addresses import ENVD_PORT
from agentenv.orchestrator.errors import SandboxNotFound
from agentenv.orchestrator.orchestrator import Orchestrator

_HOST_RE = re.compile(r"^(?P<port>\d{1,5})-(?P<sandbox>[a-z0-9]+)\.")
# Connection-scoped headers (RFC 9110 §7.6.1) are never forwarded.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_ROUTING_HEADERS = frozenset({"e2b-sandbox-id", "e2b-sandbox-port"})


@dataclass(frozen=True)
class ProxyTarget:
    sandbox_id: str
    port: int


class SandboxProxy:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        # One connection pool per sandbox: addresses are reused when a slot is reused, and
        # a kept-alive connection to a killed sandbox must never carry a new one's traffic.
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def _client_for(self, sandbox_id: str) -> httpx.AsyncClient:
        client = self._clients.get(sandbox_id)
        if client is None:
            self._drop_stale_clients()
            # No overall timeout: streams (process output, downloads) may run for long.
            client = httpx.AsyncClient(
                trust_env=False,
                timeout=httpx.Timeout(connect=10.0, read=None, write=None, pool=None),
                limits=httpx.Limits(max_connections=200, max_keepalive_connections=20),
            )
            self._clients[sandbox_id] = client
        return client

    def _drop_stale_clients(self) -> None:
        live = {v.sandbox_id for v in self.orchestrator.list_sandboxes()}
        for sandbox_id in [s for s in self._clients if s not in live]:
            client = self._clients.pop(sandbox_id)
            task = asyncio.get_running_loop().create_task(client.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    def target_of(self, request: Request) -> ProxyTarget | None:
        sandbox_id = request.headers.get("e2b-sandbox-id")
        if sandbox_id:
            port_text = request.headers.get("e2b-sandbox-port") or str(ENVD_PORT)
            port = int(port_text) if port_text.isdigit() else -1
            return ProxyTarget(sandbox_id.strip(), port)
        host = request.headers.get("host", "")
        match = _HOST_RE.match(host)
        if match:
            return ProxyTarget(match["sandbox"], int(match["port"]))
        return None

    async def forward(self, request: Request, target: ProxyTarget) -> Response:
        if not 0 < target.port < 65536:
            return _error(400, "E2b-Sandbox-Port must be a port number")
        if target.port == ENVD_PORT and request.url.path.rstrip("/") == "/init":
            # /init sets the sandbox's token, clock and identity: only the orchestrator,
            # which reaches envd directly, may call it.
            return _error(403, "envd /init is not reachable through the proxy")
        try:
            view = self.orchestrator.get(target.sandbox_id)
        except SandboxNotFound:
            # E2B's edge answers unknown sandboxes with 502 and this body; the SDK maps it
            # to "sandbox not found / not running".
            return _error(502, f"The sandbox {target.sandbox_id} was not found")
        if view.state != "running":
            return _error(502, f"The sandbox {target.sandbox_id} is not running")
        headers = [
            (k, v)
            for k, v in request.headers.items()
            if k.lower() not in _HOP_BY_HOP and k.lower() not in _ROUTING_HEADERS
        ]
        url = httpx.URL(
            scheme="http",
            host=view.guest_address,
            port=target.port,
            path=request.url.path,
        )
        if request.url.query:
            url = url.copy_with(query=request.url.query.encode())
        has_body = request.method not in ("GET", "HEAD", "OPTIONS") or (
            "content-length" in request.headers or "transfer-encoding" in request.headers
        )
        client = self._client_for(target.sandbox_id)
        upstream_request = client.build_request(
            request.method,
            url,
            headers=headers,
            content=request.stream() if has_body else None,
        )
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.ConnectError:
            return _error(502, f"port {target.port} in sandbox {target.sandbox_id} is not open")
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            return _error(502, f"sandbox {target.sandbox_id} did not answer: {reason}")
        response_headers = {
            k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP
        }
        return StreamingResponse(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            headers=response_headers,
            background=BackgroundTask(upstream.aclose),
        )


def _error(status: int, message: str) -> Response:
    return JSONResponse({"code": status, "message": message}, status_code=status)


class SandboxTrafficMiddleware:
    """Pure ASGI middleware: sandbox traffic goes to the proxy, everything else to the
    wrapped application. (Pure ASGI rather than ``BaseHTTPMiddleware`` so streamed bodies
    are never buffered.)"""

    def __init__(self, app: ASGIApp, proxy: SandboxProxy) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope, receive)
            target = self.proxy.target_of(request)
            if target is not None:
                response = await self.proxy.forward(request, target)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

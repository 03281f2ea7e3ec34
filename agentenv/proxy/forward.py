"""Forwarding HTTP and WebSocket traffic to a port inside a sandbox.

A request is sandbox traffic when it carries ``E2b-Sandbox-Id`` (and optionally
``E2b-Sandbox-Port``, default envd's port) or its Host is ``{port}-{sandboxID}.{domain}``
for the configured domain exactly (any other Host is the control plane's; without a
configured domain, only the headers route, since a server that does not know its domain
cannot tell its own names from anyone else's). A signed ``/files`` URL that names no
sandbox goes to the sandbox whose token signed it (see ``signed``).

Every port but envd's is open to anyone who can reach the proxy, unless the sandbox was
created with ``allowPublicTraffic: false``: then they need its traffic access token in
``e2b-traffic-access-token`` (403 otherwise, checked before a paused sandbox is woken).
A sandbox created with ``maskRequestHost`` gets that Host (``${PORT}`` replaced by the
port) on every request to those ports.

Requests for envd's port are checked against the sandbox's access token unless their path
is exactly one of envd's public routes; their raw path is parsed once (see ``paths``) and
forwarded byte for byte, so the guest sees the path that was checked. envd's control port
(``/init``) is never forwarded. Paths for other ports are forwarded as the client sent them
(refused only where the HTTP client would change what they mean).
Bodies stream in both directions without buffering (each side waits for the other to
drain, so a slow reader slows the writer instead of filling memory), which is what Connect
server streams, large uploads and downloads need. When a sandbox is killed, expires or is
paused, every exchange open into it ends at once (see ``endings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http.cookiejar
import logging
import re
import socket
from asyncio.trsock import TransportSocket
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import websockets
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from websockets.asyncio.client import connect as ws_connect

from agentenv.network.addresses import ENVD_CONTROL_PORT, ENVD_PORT
from agentenv.orchestrator.errors import Conflict, OrchestratorError, SandboxNotFound
from agentenv.orchestrator.network_options import traffic_token_matches
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.views import SandboxView
from agentenv.proxy.endings import (
    ConnectFraming,
    Ending,
    TrafficEndings,
    end_stream_error,
    gone_message,
    is_connect_stream,
)
from agentenv.proxy.paths import PathRefused, RequestPath
from agentenv.proxy.relay import (
    HOP_BY_HOP,
    Refusal,
    deny_websocket,
    has_body,
    oversized_head,
    pump_websocket,
    refuse,
    response_headers,
)
from agentenv.proxy.signed import (
    SIGNER_PATH,
    FilesNotRouted,
    signed_files_sandbox,
    signer_response,
)

log = logging.getLogger("agentenv.proxy")

T = TypeVar("T")

_HOST_RE = re.compile(r"^(?P<port>\d{1,5})-(?P<sandbox>[a-z0-9]+)\.(?P<domain>.+)$")
_TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
# Read by the proxy, never passed on to the sandbox.
_ROUTING_HEADERS = frozenset({"e2b-sandbox-id", "e2b-sandbox-port", _TRAFFIC_TOKEN_HEADER})
# envd routes that authenticate themselves, matched exactly: /health is public, /files
# accepts signed URLs (envd checks the signature, or the token when one is sent).
_ENVD_PUBLIC_ROUTES = frozenset({"/health", "/files"})
# Routes envd serves to the orchestrator only; refused here even though envd no longer
# answers them on its public port.
_ENVD_NODE_ROUTES = frozenset({"/init"})


@dataclass(frozen=True)
class ProxyTarget:
    sandbox_id: str
    port: int


def target_of(headers: Headers, domain: str | None) -> ProxyTarget | None:
    """The sandbox port a request is for, or None for the control plane. Host names
    route only when they are ``{port}-{id}.{domain}`` for `domain` (case-insensitive;
    the ports of the Host and of `domain` are not compared)."""
    sandbox_id = headers.get("e2b-sandbox-id")
    if sandbox_id:
        port_text = headers.get("e2b-sandbox-port") or str(ENVD_PORT)
        port = int(port_text) if port_text.isdigit() else -1
        return ProxyTarget(sandbox_id.strip(), port)
    if not domain:
        return None
    match = _HOST_RE.match(_host_name(headers.get("host", "")))
    if match and match["domain"] == _host_name(domain):
        return ProxyTarget(match["sandbox"], int(match["port"]))
    return None


def _host_name(host: str) -> str:
    """`host` without its port and final dot, lower case."""
    name, colon, port = host.strip().rpartition(":")
    if not colon or not port.isdigit():
        name = host.strip()
    return name.lower().removesuffix(".")


def _forwarded_headers(
    headers: Headers, *, websocket: bool = False, host: str | None = None
) -> list[tuple[str, str]]:
    """The client's headers to send on; with `host`, that Host instead of the one the
    HTTP client derives from the guest's address."""
    forwarded = [
        (k, v)
        for k, v in headers.items()
        if k not in HOP_BY_HOP
        and k not in _ROUTING_HEADERS
        and not (websocket and k.startswith("sec-websocket-"))
    ]
    if host is not None:
        forwarded.append(("host", host))
    return forwarded


class KeepNoCookies(http.cookiejar.DefaultCookiePolicy):
    """The proxy's HTTP clients store no cookie and send none of their own: ``Cookie``
    and ``Set-Cookie`` travel between a caller and the sandbox as headers, untouched."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False

    def domain_return_ok(self, domain: str, request: Any) -> bool:
        return False

    def path_return_ok(self, path: str, request: Any) -> bool:
        return False


class SandboxProxy:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        self.domain = orchestrator.config.domain
        # One connection pool per sandbox: addresses are reused when a slot is reused, and
        # a kept-alive connection to a killed sandbox must never carry a new one's traffic.
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._endings = TrafficEndings()
        orchestrator.on_traffic_end(self._traffic_ended)

    def _traffic_ended(self, sandbox_id: str, reason: str) -> None:
        """The sandbox is being killed or paused: end its exchanges and drop its
        connection pool now, while the lifecycle goes on."""
        self._endings.end(sandbox_id, reason)
        client = self._clients.pop(sandbox_id, None)
        if client is not None:
            self._close_later(client)

    def _close_later(self, client: httpx.AsyncClient) -> None:
        task = asyncio.get_running_loop().create_task(client.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _client_for(self, sandbox_id: str) -> httpx.AsyncClient:
        client = self._clients.get(sandbox_id)
        if client is None:
            self._drop_stale_clients()
            # No overall timeout: streams (process output, downloads) may run for long.
            client = httpx.AsyncClient(
                trust_env=False,
                # One client serves every caller of the sandbox: cookies one caller's
                # answer set must reach that caller only, never the next one's request.
                cookies=http.cookiejar.CookieJar(policy=KeepNoCookies()),
                timeout=httpx.Timeout(connect=10.0, read=None, write=None, pool=None),
                limits=httpx.Limits(max_connections=200, max_keepalive_connections=20),
            )
            self._clients[sandbox_id] = client
        return client

    def _drop_stale_clients(self) -> None:
        live = {v.sandbox_id for v in self.orchestrator.list_sandboxes()}
        for sandbox_id in [s for s in self._clients if s not in live]:
            self._close_later(self._clients.pop(sandbox_id))

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    def sandbox_tokens(self) -> list[tuple[str, str | None]]:
        """Each live sandbox's id and envd access token."""
        return [(v.sandbox_id, v.record.envd_token) for v in self.orchestrator.list_sandboxes()]

    # -- admission ----------------------------------------------------------------------
    async def admit(
        self, target: ProxyTarget, path: RequestPath, headers: Headers
    ) -> SandboxView | Refusal:
        """The sandbox to forward to, or why not. Waits while the sandbox is being
        resumed (or settles after one), and wakes a paused sandbox that asked for it."""
        if not 0 < target.port < 65536:
            return Refusal(400, "E2b-Sandbox-Port must be a port number")
        if target.port == ENVD_CONTROL_PORT:
            return Refusal(403, f"port {ENVD_CONTROL_PORT} is reachable by the node only")
        if target.port != ENVD_PORT and not self._public_traffic_admitted(target, headers):
            # Before the sandbox is woken: a request that may not reach it must not
            # resume it either.
            return Refusal(403, f"missing or invalid {_TRAFFIC_TOKEN_HEADER} for this sandbox")
        try:
            view = await self.orchestrator.ready_for_traffic(target.sandbox_id)
        except SandboxNotFound:
            # E2B's edge answers unknown sandboxes with 502; the SDK reads that as "the
            # sandbox is not running" (is_running() -> False).
            return Refusal(502, f"The sandbox {target.sandbox_id} was not found")
        except Conflict as exc:
            # Paused (and not resumed on traffic). E2B's edge does not find a paused
            # sandbox either, and the SDK's health probe counts only "was not found"
            # as the sandbox not running.
            return Refusal(502, f"The sandbox {target.sandbox_id} was not found ({exc})")
        except OrchestratorError as exc:
            return Refusal(502, f"The sandbox {target.sandbox_id} is not running: {exc}")
        if target.port != ENVD_PORT:
            return view
        if path.decoded in _ENVD_NODE_ROUTES:
            # /init sets the sandbox's token, clock and identity: only the orchestrator,
            # which reaches envd's control port directly, may call it.
            return Refusal(403, f"envd {path.decoded} is not reachable through the proxy")
        token = view.record.envd_token
        if token and path.decoded not in _ENVD_PUBLIC_ROUTES:
            presented = headers.get("x-access-token") or ""
            if not hmac.compare_digest(presented.encode(), token.encode()):
                return Refusal(401, "missing or invalid X-Access-Token for this sandbox")
        return view

    def _public_traffic_admitted(self, target: ProxyTarget, headers: Headers) -> bool:
        """Whether traffic to a port other than envd's may pass: always, unless the
        sandbox refuses public traffic and the request lacks its traffic access token."""
        rec = self.orchestrator.store.get_sandbox(target.sandbox_id)
        if rec is None or rec.network.allow_public_traffic:
            return True  # an unknown sandbox is refused as such by the caller
        return traffic_token_matches(rec.traffic_token, headers.get(_TRAFFIC_TOKEN_HEADER))

    # -- HTTP ---------------------------------------------------------------------------
    async def forward(self, request: Request, target: ProxyTarget) -> Response:
        path = request_path(request.scope, target)
        if isinstance(path, Refusal):
            return path.response()
        admitted = await self.admit(target, path, request.headers)
        if isinstance(admitted, Refusal):
            return admitted.response()
        # In the same step as admit's last look at the sandbox (no await in between).
        ending = self._endings.current(target.sandbox_id)
        url = upstream_url(admitted.guest_address, target.port, path, request.scope)
        if isinstance(url, Refusal):
            return url.response()
        client = self._client_for(target.sandbox_id)
        upstream_request = client.build_request(
            request.method,
            url,
            headers=_forwarded_headers(request.headers, host=_masked_host(admitted, target)),
            content=request.stream() if has_body(request.method, request.headers) else None,
        )
        try:
            sent = await _until_ended(client.send(upstream_request, stream=True), ending)
        except httpx.ConnectError:
            return Refusal(
                502, f"port {target.port} in sandbox {target.sandbox_id} is not open"
            ).response()
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            return Refusal(502, f"sandbox {target.sandbox_id} did not answer: {reason}").response()
        if sent is None:
            return Refusal(502, gone_message(target.sandbox_id, ending.reason or "")).response()
        upstream = sent[0]
        content_type = upstream.headers.get("content-type")
        framing = ConnectFraming() if is_connect_stream(content_type) else None
        return StreamingResponse(
            _relay_body(upstream, target, ending, framing),
            status_code=upstream.status_code,
            headers=response_headers(upstream),
            background=BackgroundTask(upstream.aclose),
        )

    # -- WebSocket ----------------------------------------------------------------------
    async def forward_websocket(
        self, scope: Scope, receive: Receive, send: Send, target: ProxyTarget
    ) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        headers = Headers(scope=scope)
        path = request_path(scope, target)
        if isinstance(path, Refusal):
            await deny_websocket(send, path)
            return
        admitted = await self.admit(target, path, headers)
        if isinstance(admitted, Refusal):
            await deny_websocket(send, admitted)
            return
        ending = self._endings.current(target.sandbox_id)  # the same step as admit's check
        query = scope.get("query_string", b"").decode("latin-1")
        masked = _masked_host(admitted, target)
        # The client sends the URL's host as Host: a masked Host goes in the URL and the
        # connection is pointed at the guest explicitly.
        url = f"ws://{masked or f'{admitted.guest_address}:{target.port}'}"
        url += path.raw.decode("latin-1")
        if query:
            url += "?" + query
        direct: dict[str, Any] = {
            "host": admitted.guest_address,
            "port": target.port,
            "proxy": None,
        }
        try:
            upstream = await ws_connect(
                url,
                **(direct if masked else {}),
                additional_headers=_forwarded_headers(headers, websocket=True),
                subprotocols=scope.get("subprotocols") or None,
                open_timeout=10,
                max_size=None,
                compression=None,
            )
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
            await deny_websocket(send, Refusal(502, f"WebSocket to sandbox failed: {exc}"))
            return
        async with upstream:
            await pump_websocket(receive, send, upstream, until=ending.future())
            if ending.reason is not None:
                # 1001: the endpoint is going away. The guest is not waited for: it will
                # not answer a close handshake.
                reason = gone_message(target.sandbox_id, ending.reason)
                with contextlib.suppress(Exception):
                    await send({"type": "websocket.close", "code": 1001, "reason": reason})
                upstream.close_timeout = 0


def _masked_host(view: SandboxView, target: ProxyTarget) -> str | None:
    """The Host the sandbox asked its ports to see (``maskRequestHost``), or None. envd's
    port keeps the client's: it is the platform's agent, not the user's service."""
    if target.port == ENVD_PORT:
        return None
    return view.record.network.forwarded_host(target.port)


def request_path(scope: Scope, target: ProxyTarget) -> RequestPath | Refusal:
    """The raw path the client sent, checked once. envd's port gets the strict parse its
    access rules rely on; other ports' paths decide nothing here and go through as sent
    (an application may give ``//`` or ``%2F`` a meaning of its own)."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    if target.port != ENVD_PORT:
        if not raw.startswith(b"/"):
            return Refusal(400, "the request path must start with '/'")
        return RequestPath(raw, scope["path"])
    try:
        return RequestPath.parse(raw)
    except PathRefused as exc:
        return Refusal(400, str(exc))


def upstream_url(address: str, port: int, path: RequestPath, scope: Scope) -> httpx.URL | Refusal:
    """The guest URL for the path that was checked. httpx normalises dot segments and
    percent-encodes a few characters (``"<>{}`` and the like) on the way: envd's port
    must get the checked path byte for byte, other ports the same decoded path. The query
    may be re-encoded, which changes no parameter."""
    query: bytes = scope.get("query_string", b"")
    raw = path.raw + (b"?" + query if query else b"")
    try:
        url = httpx.URL(scheme="http", host=address, port=port).copy_with(raw_path=raw)
    except (httpx.InvalidURL, UnicodeError):
        return Refusal(400, "the request target is not a valid URL")
    sent_path = url.raw_path.partition(b"?")[0]
    unchanged = sent_path == path.raw if port == ENVD_PORT else url.path == path.decoded
    if not unchanged:
        return Refusal(400, "the request path cannot be forwarded unchanged")
    return url


class ExchangeCut(Exception):
    """A response cannot be finished: the client's connection is to be dropped, so it
    sees a broken transfer rather than a complete but short one."""


async def _until_ended(work: Awaitable[T], ending: Ending) -> tuple[T] | None:
    """``(result,)`` of ``work``, or None if the sandbox's traffic ends first (``work``
    is cancelled then)."""
    if ending.reason is not None:
        if asyncio.iscoroutine(work):
            work.close()
        return None
    task = asyncio.ensure_future(work)
    try:
        waiters: list[asyncio.Future[Any]] = [task, ending.future()]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return None
    return (task.result(),)


async def _relay_body(
    upstream: httpx.Response,
    target: ProxyTarget,
    ending: Ending,
    framing: ConnectFraming | None,
) -> AsyncIterator[bytes]:
    """The upstream body as it arrives, until it ends or the sandbox's traffic does.

    The status line is already on its way to the client, so a body that cannot be
    finished (the sandbox was killed or paused, or the guest dropped the connection)
    ends a Connect stream with an error message when it stopped between messages, and
    otherwise raises :class:`ExchangeCut`: a clean end would pass a truncated download
    or an unfinished command off as complete."""
    chunks = upstream.aiter_raw()
    finished = False
    try:
        while True:
            try:
                step = await _until_ended(anext(chunks, None), ending)
            except httpx.HTTPError as exc:
                reason = str(exc) or type(exc).__name__
                log.warning(
                    "sandbox %s port %d closed mid-response: %s",
                    target.sandbox_id,
                    target.port,
                    reason,
                )
                message = (
                    f"the connection to sandbox {target.sandbox_id} ended before the "
                    f"stream completed: {reason}"
                )
            else:
                if step is not None:
                    chunk = step[0]
                    if chunk is None:
                        finished = True
                        return
                    if framing is not None:
                        framing.feed(chunk)
                    yield chunk
                    continue
                message = gone_message(target.sandbox_id, ending.reason or "")
            if framing is not None and framing.between_messages:
                if not framing.ended:
                    yield end_stream_error(message)
                return
            raise ExchangeCut(message)
    finally:
        if not finished:
            # The client went away (or the exchange was cut): the guest must see its
            # connection end now, as it would have seen the client's, not when it next
            # writes or finishes (a code interpreter interrupts the call it was running).
            # Closing the response alone does not reliably get there while the
            # cancelled read is still unwinding.
            _shut_down(upstream)
        await asyncio.shield(upstream.aclose())


def _shut_down(upstream: httpx.Response) -> None:
    stream = upstream.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    # asyncio hands its sockets out wrapped (TransportSocket), shutdown included.
    if isinstance(sock, socket.socket | TransportSocket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class SandboxTrafficMiddleware:
    """Pure ASGI middleware: sandbox traffic goes to the proxy, everything else to the
    wrapped application. (Pure ASGI rather than ``BaseHTTPMiddleware`` so streamed bodies
    are never buffered, and WebSockets pass too.)"""

    def __init__(self, app: ASGIApp, proxy: SandboxProxy) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            refusal = oversized_head(scope)
            if refusal is not None:
                # Refused here for the API and the guest alike.
                await refuse(scope, receive, send, refusal)
                return
            target = target_of(Headers(scope=scope), self.proxy.domain)
            if target is None and scope["type"] == "http":
                if scope["path"] == SIGNER_PATH and scope["method"] == "GET":
                    answer = signer_response(scope, self.proxy.sandbox_tokens)
                    await answer(scope, receive, send)
                    return
                try:
                    signer = signed_files_sandbox(scope, self.proxy.sandbox_tokens)
                except FilesNotRouted as exc:
                    await Refusal(exc.status, str(exc)).response()(scope, receive, send)
                    return
                if signer is not None:
                    target = ProxyTarget(signer, ENVD_PORT)
            if target is not None:
                if scope["type"] == "http":
                    request = Request(scope, receive)
                    response = await self.proxy.forward(request, target)
                    try:
                        await response(scope, receive, send)
                    except ExchangeCut as cut:
                        # Returning with the response unfinished makes the server drop
                        # the connection (uvicorn logs one line saying so).
                        log.info("sandbox %s: response cut short: %s", target.sandbox_id, cut)
                else:
                    await self.proxy.forward_websocket(scope, receive, send, target)
                return
        await self.app(scope, receive, send)

"""``aenv-gateway``: the one URL clients use (``E2B_API_URL`` and ``E2B_SANDBOX_URL``),
default ``127.0.0.1:8080``. It holds no state: where a sandbox lives comes from the
scheduler, so several gateways can run against one scheduler.

- Creates ask the scheduler for a node, go there, and bind the new sandbox to it.
- Sandbox-scoped routes (``/sandboxes/{id}/...``, v2 too) go to the owning node; fork
  children are bound to their parent's node; a kill unbinds. A connect of a sandbox bound
  to no node, or to a node that is gone, goes to another node, which adopts it from the
  repository if it was paused and committed, and it is bound there.
- Listings (``GET /sandboxes``, ``/v2/sandboxes``) merge every up node's, paged as one
  node would page them (``listing``); ``X-Aenv-Nodes-Down`` names the down nodes whose
  sandboxes are missing. Snapshot, template and other routes go to one
  healthy node (the same one while it is up, so a template build's polls find it).
- Sandbox traffic (``E2b-Sandbox-Id`` headers, ``{port}-{id}.{domain}`` hosts) is relayed
  to the owning node's proxy as it came (headers and Host kept), streaming both ways,
  WebSockets included, by the gateway's front (``front``), byte for byte over pooled
  keep-alive connections (``upstreams``), before this app: the front asks it only where
  a sandbox is (:meth:`Gateway.traffic_route`, the route cache) and times what it relays
  in its metrics. The node's proxy checks tokens and reaches the guest. This app is
  served behind the front (``gateway_server``) and answers everything else; served
  alone, it refuses a sandbox's traffic (421). A signed ``/files`` URL naming no sandbox
  goes to the node whose sandbox signed it (``signed_files``), relayed by this app
  (``traffic``).
- A sandbox whose node is down (or does not answer) is a 503 "node unavailable", not a
  404; a scheduler that cannot be reached is a 503 too.
- Nodes serving TLS (reporting ``https://`` URLs) are reached over HTTPS and WebSockets
  over TLS, verified against ``ca_file`` (else the system's trusted certificates).

The gateway checks the API key only on what it answers itself (``/nodes``, ``/metrics``);
nodes check everything they are sent. ``GET /nodes`` lists every node the scheduler
knows as E2B's ``Node`` (``unhealthy`` while down); ``GET /nodes/{id}`` is that node's
own answer, or its last heartbeat's when it cannot be asked. ``/metrics`` has the
gateway's request latencies, to the response head (``route`` is a class: create, listing,
sandbox-control, sandbox-traffic (the front's), nodes, health, other) and
``aenv_gateway_upstream_seconds{node, outcome}``, the time nodes took to answer what the
gateway sent them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Histogram
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from agentenv import __version__
from agentenv.api.listing import DEFAULT_ORDER, DEFAULT_SANDBOX_PAGE_SIZE, Order
from agentenv.cluster.answers import (
    capacity_refused,
    field_of,
    fork_children,
    mode_mismatch,
    read_bounded,
    replay,
)
from agentenv.cluster.listing import (
    NEXT_TOKEN_HEADER,
    e2b_node,
    e2b_node_detail,
    merge_pages,
    sandbox_key,
)
from agentenv.cluster.models import NodeInfo, NodeState, PlacementRequest
from agentenv.cluster.node_transport import AiohttpNodeTransport
from agentenv.cluster.routes import RouteCache
from agentenv.cluster.scheduler_client import (
    SchedulerClient,
    SchedulerRefused,
    SchedulerUnavailable,
)
from agentenv.cluster.signed_files import signer_node
from agentenv.cluster.tls import client_context
from agentenv.cluster.traffic import (
    NODE_TIMEOUT,
    NodeUnavailable,
    RelayedAnswer,
    node_headers,
    send_to_node,
)
from agentenv.limits import MAX_REQUEST_BODY_BYTES
from agentenv.observability import (
    LATENCY_BUCKETS,
    RequestMetrics,
    key_matches,
    presented_key,
    request_histogram,
)
from agentenv.proxy.forward import ProxyTarget, target_of
from agentenv.proxy.relay import (
    Refusal,
    deny_websocket,
    has_body,
    oversized_head,
    refuse,
)
from agentenv.proxy.signed import is_files_request

log = logging.getLogger("agentenv.cluster.gateway")

DEFAULT_LISTEN = "127.0.0.1:8080"
# As the node server's (agentenv.server.KEEP_ALIVE_S): longer than the SDK keeps idle
# connections, so the client always closes first.
KEEP_ALIVE_S = 330

_SANDBOX_ROUTE = re.compile(r"^/(?:v2/)?sandboxes/(?P<id>[^/]+)(?P<rest>/[^?]*)?$")
_LISTING = frozenset({"/sandboxes", "/v2/sandboxes"})
# On listings: the nodes that are down, whose sandboxes the listing lacks.
_MISSING_NODES_HEADER = "X-Aenv-Nodes-Down"


def _error(status: int, message: str) -> Response:
    return Refusal(status, message).response()


class Gateway:
    """The gateway as an ASGI application."""

    def __init__(
        self,
        scheduler: SchedulerClient,
        api_key: str,
        domain: str | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        route_cache_s: float = 1.0,
        ca_file: Path | str | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.api_key = api_key
        self.domain = domain
        # Where sandbox traffic goes (``routes``): only up owners are kept; what this
        # gateway itself changes (kill, connect elsewhere) drops its entry, another
        # gateway's change is seen within `route_cache_s` (twice that at most, see
        # ``routes``) or at once when the old node says it no longer holds the sandbox
        # (see _traffic), and a node that stops answering is a 503 either way.
        self.route_cache_s = route_cache_s
        self._routes = RouteCache(self._owner, route_cache_s)
        self.registry = CollectorRegistry()
        self.upstream_seconds = Histogram(
            "aenv_gateway_upstream_seconds",
            "Time a node took to answer the gateway (to its response head)",
            ["node", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # Requests timed to their response head, by the app and by the front alike.
        self.request_seconds = request_histogram(self.registry)
        self._timed = RequestMetrics(
            self._serve,
            component="gateway",
            registry=self.registry,
            api_key=api_key,
            route_of=lambda scope: scope.get("aenv.route"),
            histogram=self.request_seconds,
        )
        # What https:// nodes are verified with, for HTTP and WebSockets alike.
        self.node_tls: ssl.SSLContext = client_context(ca_file)
        # One connection pool for every node (aiohttp's, see ``node_transport``). Relayed
        # requests go to it directly (``traffic``); what the gateway asks nodes itself
        # goes through a client on it.
        self.transport = transport or AiohttpNodeTransport(self.node_tls)
        self.http = httpx.AsyncClient(
            trust_env=False, timeout=NODE_TIMEOUT, transport=self.transport
        )
        # Parsed node URLs, by the URL text a node reports.
        self._node_urls: dict[str, httpx.URL] = {}

    async def aclose(self) -> None:
        await self._routes.aclose()
        await self.http.aclose()
        await self.scheduler.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self._timed(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = oversized_head(scope)
        if refusal is not None:
            await refuse(scope, receive, send, refusal)
            return
        headers = Headers(scope=scope)
        target = target_of(headers, self.domain)
        response: ASGIApp
        try:
            if scope["type"] == "websocket":
                await self._websocket(scope, receive, send, target)
                return
            if target is not None:
                # A sandbox's traffic is the front's (``front``): the app behind it sees
                # none, and alone (in process) it relays none.
                scope["aenv.route"] = "sandbox-traffic"
                response = _error(421, "a sandbox's traffic is relayed by the gateway's front")
            else:
                response = await self._http(Request(scope, receive))
        except NodeUnavailable as exc:
            response = _error(503, str(exc))
        except SchedulerUnavailable as exc:
            response = _error(503, str(exc))
        except SchedulerRefused as exc:
            response = _error(exc.status, exc.message)
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- what the front asks ------------------------------------------------------------
    async def traffic_route(self, sandbox_id: str) -> tuple[NodeInfo | None, bool]:
        """The up node holding ``sandbox_id`` (None: bound to none), and whether it came
        from the route cache. Raises :class:`NodeUnavailable` (its node is down) or
        :class:`SchedulerUnavailable`."""
        return await self._routes.owner(sandbox_id)

    def forget_route(self, sandbox_id: str) -> None:
        self._routes.forget(sandbox_id)

    def observe_upstream(self, node_id: str, started: float, outcome: str) -> None:
        """The time a node took to answer (to its response head), since ``started``."""
        elapsed = time.perf_counter() - started
        self.upstream_seconds.labels(node_id, outcome).observe(elapsed)

    # -- where things are ----------------------------------------------------------------
    async def _owner(self, sandbox_id: str) -> NodeInfo | None:
        """The up node holding ``sandbox_id``; None when it is bound to none. Raises
        :class:`NodeUnavailable` when its node is down or unknown."""
        binding = await self.scheduler.lookup(sandbox_id)
        if binding is None:
            return None
        if binding.node is None:
            raise NodeUnavailable(binding.node_id, "the scheduler does not know", sandbox_id)
        if binding.node.state is not NodeState.UP:
            raise NodeUnavailable(binding.node_id, "stopped heartbeating", sandbox_id)
        return binding.node

    async def _up_nodes(self) -> list[NodeInfo]:
        return [n for n in await self.scheduler.nodes() if n.state is NodeState.UP]

    async def _any_node(self) -> NodeInfo:
        """The first up node by id: the same one for every request while it is up."""
        nodes = await self._up_nodes()
        if not nodes:
            raise NodeUnavailable("(any)", "is not there: no node is up")
        return nodes[0]

    # -- HTTP ----------------------------------------------------------------------------
    async def _http(self, request: Request) -> ASGIApp:
        request.scope["aenv.route"] = _route_class(request)
        path = request.url.path
        if is_files_request(request.scope.get("raw_path") or path.encode()):
            query: bytes = request.scope.get("query_string", b"")
            found = await signer_node(self.http, await self._up_nodes(), query, request.method)
            return (
                found.response()
                if isinstance(found, Refusal)
                else await self._relay(request, found)
            )
        if path == "/health":
            return await self._health(request.headers)
        if path == "/nodes" or path.startswith("/nodes/"):
            return await self._nodes(request)
        if path in _LISTING and request.method == "GET":
            return await self._listing(request)
        if path in _LISTING and request.method == "POST":
            return await self._create(request)
        match = _SANDBOX_ROUTE.match(path)
        if match:
            return await self._sandbox_route(request, match["id"], match["rest"] or "")
        return await self._relay(request, await self._any_node())

    async def _send(
        self, request: Request, node: NodeInfo, body: bytes | None = None
    ) -> httpx.Response:
        """The request sent on to ``node`` as it came (raw path, query, headers, body
        streamed unless given), its response head read."""
        content: Any = body
        if body is None and has_body(request.method, request.headers):
            content = request.stream()
        return await self._send_raw(request.scope, request.headers, node, content)

    async def _send_raw(
        self, scope: Scope, headers: Headers, node: NodeInfo, content: Any
    ) -> httpx.Response:
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        query: bytes = scope.get("query_string", b"")
        base = self._node_urls.get(node.report.url)
        if base is None:
            if len(self._node_urls) > 10_000:
                self._node_urls.clear()
            base = self._node_urls[node.report.url] = httpx.URL(node.report.url)
        url = base.copy_with(raw_path=raw_path + (b"?" + query if query else b""))
        started = time.perf_counter()
        try:
            answer = await send_to_node(
                self.transport,
                scope["method"],
                url,
                node_headers(headers, body=content is not None),
                content,
            )
        except httpx.HTTPError as exc:
            self._upstream(node, started, "error")
            raise NodeUnavailable(
                node.node_id, f"did not answer ({str(exc) or type(exc).__name__})"
            ) from exc
        self._upstream(node, started, "ok")
        return answer

    def _upstream(self, node: NodeInfo, started: float, outcome: str) -> None:
        self.observe_upstream(node.node_id, started, outcome)

    async def _relay(
        self, request: Request, node: NodeInfo, sandbox_id: str | None = None
    ) -> ASGIApp:
        try:
            upstream = await self._send(request, node)
        except NodeUnavailable as exc:
            raise NodeUnavailable(exc.node_id, exc.reason, sandbox_id) from exc
        return RelayedAnswer(upstream, node.node_id)

    async def _buffered(
        self, request: Request, node: NodeInfo, body: bytes | None = None
    ) -> tuple[httpx.Response, bytes]:
        """For answers the gateway reads (sandbox ids to bind): small JSON bodies."""
        upstream = await self._send(request, node, body)
        try:
            data = await upstream.aread()
        except httpx.HTTPError as exc:
            raise NodeUnavailable(node.node_id, f"broke off its answer ({exc})") from exc
        finally:
            await upstream.aclose()
        return upstream, data

    @staticmethod
    async def _record(change: Coroutine[Any, Any, None]) -> None:
        """Tell the scheduler what a node just did. The node's answer goes to the client
        whatever happens here: a client told a create failed would retry it and make a
        second sandbox, while a binding the scheduler missed is made by the node's next
        heartbeat (its roster), and a reservation not released expires."""
        try:
            await change
        except (SchedulerUnavailable, SchedulerRefused) as exc:
            log.warning("left to the next heartbeat: %s", exc)

    async def _create(self, request: Request) -> Response:
        body = await read_bounded(request)
        if body is None:
            return _error(413, f"request body exceeds {MAX_REQUEST_BODY_BYTES} bytes")
        try:
            template = json.loads(body or b"{}").get("templateID") or "base"
        except (ValueError, AttributeError):
            template = None  # not JSON: a node answers the 400 it deserves
        if not isinstance(template, str):
            upstream, data = await self._buffered(request, await self._any_node(), body)
            return replay(upstream, data)
        # A node whose mode (VMM, accelerator) is not the one the template was saved
        # under refuses it (409 mode_mismatch) before starting anything, and so does a
        # node whose host cannot hold one more sandbox now (503 capacity_exhausted): the
        # create is placed again without it, until a node takes it or none is left to
        # ask (then the last refusal is the answer).
        refused: tuple[httpx.Response, bytes] | None = None
        tried: list[str] = []
        while True:
            try:
                placement = await self.scheduler.place(
                    PlacementRequest(templateID=template, excludeNodes=tried)
                )
            except SchedulerRefused:
                if refused is None:
                    raise
                return replay(*refused)  # every node that could take it refused it
            node = placement.node
            try:
                upstream, data = await self._buffered(request, node, body)
            except NodeUnavailable:
                await self._record(self.scheduler.release(placement.placement_id))
                raise
            sandbox_id = field_of(data, "sandboxID") if upstream.status_code == 201 else None
            if sandbox_id:
                await self._record(
                    self.scheduler.bind(sandbox_id, node.node_id, placement.placement_id)
                )
                return replay(upstream, data)
            await self._record(self.scheduler.release(placement.placement_id))
            if not (mode_mismatch(upstream, data) or capacity_refused(upstream, data)):
                return replay(upstream, data)
            refused = (upstream, data)
            tried.append(node.node_id)

    async def _sandbox_route(self, request: Request, sandbox_id: str, rest: str) -> ASGIApp:
        method = request.method
        self._routes.forget(sandbox_id)  # a control-plane call may move or end it
        if method == "POST" and rest == "/connect":
            return await self._connect(request, sandbox_id)
        node = await self._owner(sandbox_id)
        if node is None:
            return _error(404, f"sandbox {sandbox_id} not found")
        if method == "POST" and rest == "/fork":
            upstream, data = await self._buffered(request, node)
            if upstream.status_code == 201:
                for child in fork_children(data):
                    await self._record(self.scheduler.bind(child, node.node_id))
            return replay(upstream, data)
        if method == "DELETE" and not rest:
            upstream, data = await self._buffered(request, node)
            if upstream.status_code in (204, 404):
                await self._record(self.scheduler.unbind(sandbox_id))
            return replay(upstream, data)
        return await self._relay(request, node, sandbox_id)

    async def _connect(self, request: Request, sandbox_id: str) -> Response:
        """Connect on the owning node; if the sandbox is bound to no node, or to one that
        is gone, on another node, which adopts it from the repository when it was paused
        and committed there (and answers 404 otherwise: then a gone node is the answer)."""
        body = await read_bounded(request)
        if body is None:
            return _error(413, f"request body exceeds {MAX_REQUEST_BODY_BYTES} bytes")
        gone: NodeUnavailable | None = None
        refused: tuple[httpx.Response, bytes] | None = None
        skip: str | None = None
        try:
            owner = await self._owner(sandbox_id)
            if owner is not None:
                upstream, data = await self._buffered(request, owner, body)
                if not mode_mismatch(upstream, data):
                    return replay(upstream, data)
                # Its node now runs another mode: one of the saved mode may adopt it.
                refused, skip = (upstream, data), owner.node_id
        except NodeUnavailable as exc:
            gone = NodeUnavailable(exc.node_id, exc.reason, sandbox_id)
            skip = exc.node_id
        others = [n for n in await self._up_nodes() if n.node_id != skip]
        if not others:
            if refused is not None:
                return replay(*refused)
            raise gone or NodeUnavailable("(any)", "is not there: no node is up", sandbox_id)
        # Every node reads the same repository: the first that answers decides, unless it
        # runs another mode than the sandbox was paused under.
        unreachable: NodeUnavailable | None = None
        for adopter in others:
            try:
                upstream, data = await self._buffered(request, adopter, body)
            except NodeUnavailable as exc:
                unreachable = exc
                continue
            if not mode_mismatch(upstream, data):
                break
            refused = (upstream, data)
        else:
            if refused is not None:
                return replay(*refused)
            assert unreachable is not None
            raise gone or unreachable
        if upstream.status_code in (200, 201):
            await self._record(self.scheduler.bind(sandbox_id, adopter.node_id))
        elif upstream.status_code == 404 and gone is not None:
            raise gone  # not paused and committed: it was running on the gone node
        return replay(upstream, data)

    async def _listing(self, request: Request) -> Response:
        every = await self.scheduler.nodes()
        nodes = [n for n in every if n.state is NodeState.UP]
        # Down nodes' sandboxes cannot be listed; the answer says whose are missing.
        missing = {
            _MISSING_NODES_HEADER: ",".join(n.node_id for n in every if n.state is not NodeState.UP)
        }
        query = request.url.query
        headers = node_headers(request.headers)

        async def one(node: NodeInfo) -> httpx.Response:
            url = node.report.url.rstrip("/") + request.url.path + (f"?{query}" if query else "")
            started = time.perf_counter()
            try:
                answer = await self.http.get(url, headers=headers)
                self._upstream(node, started, "ok")
                return answer
            except httpx.HTTPError as exc:
                self._upstream(node, started, "error")
                raise NodeUnavailable(
                    node.node_id, f"did not answer a listing ({str(exc) or type(exc).__name__})"
                ) from exc

        # All or nothing: a listing missing a node's sandboxes would look complete.
        answers = await asyncio.gather(*(one(node) for node in nodes))
        for answer in answers:
            if answer.status_code != 200:
                return replay(answer, answer.content)
        pages = [answer.json() for answer in answers]
        headers_out = missing if missing[_MISSING_NODES_HEADER] else {}
        if request.url.path == "/sandboxes":
            listed = [item for page in pages for item in page]
            listed.sort(key=sandbox_key, reverse=True)
            return JSONResponse(listed, headers=headers_out)
        # The nodes answered, so the query is valid: the same defaults as theirs.
        limit_text = request.query_params.get("limit")
        limit = DEFAULT_SANDBOX_PAGE_SIZE
        if limit_text and limit_text.isdigit():
            limit = int(limit_text)
        order: Order = "asc" if request.query_params.get("order") == "asc" else DEFAULT_ORDER
        more = any(NEXT_TOKEN_HEADER in answer.headers for answer in answers)
        items, token = merge_pages(pages, order, limit, more)
        if token:
            headers_out["X-Next-Token"] = token
        return JSONResponse(items, headers=headers_out)

    async def _nodes(self, request: Request) -> Response:
        if not key_matches(request.headers, self.api_key):
            return _error(401, "missing or invalid API key")
        node_id = request.url.path.removeprefix("/nodes").strip("/")
        if not node_id:
            known = await self.scheduler.nodes()
            return JSONResponse([e2b_node(n).model_dump(mode="json", by_alias=True) for n in known])
        node = await self.scheduler.node(node_id)
        if node is None:
            return _error(404, f"node {node_id!r} not found")
        if node.state is NodeState.UP:
            try:
                upstream, data = await self._buffered(request, node)
                if upstream.status_code == 200:
                    return replay(upstream, data)
            except NodeUnavailable as exc:
                log.info("GET /nodes/%s answered from its heartbeat: %s", node_id, exc)
        return JSONResponse(e2b_node_detail(node).model_dump(mode="json", by_alias=True))

    async def _health(self, headers: Headers) -> Response:
        """A node's ``/health`` (what ``aenv`` reads: version, VMM, templates), from the
        first up node, with the cluster's sandbox count; degraded, naming them, while
        nodes are down. 503 when no node is up or the scheduler is unreachable. Without
        an API key only ``status`` and ``version``, as a node answers; a wrong key is a
        401."""
        anonymous = presented_key(headers) is None
        if not anonymous and not key_matches(headers, self.api_key):
            return _error(401, "missing or invalid API key")
        nodes = await self.scheduler.nodes()
        up = [n for n in nodes if n.state is NodeState.UP]
        if not up:
            return _error(503, f"no node is up ({len(nodes)} known)")
        down = [n.node_id for n in nodes if n.state is not NodeState.UP]
        if anonymous:
            status = "degraded" if down else "ok"
            return JSONResponse({"status": status, "version": __version__})
        try:
            answer = await self.http.get(
                up[0].report.url.rstrip("/") + "/health", headers={"X-API-Key": self.api_key}
            )
            health = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise NodeUnavailable(up[0].node_id, f"did not answer /health ({exc})") from exc
        if not isinstance(health, dict) or "vmm" not in health:
            raise NodeUnavailable(up[0].node_id, f"answered /health with {answer.status_code}")
        health["sandboxes"] = sum(len(n.report.sandboxes) for n in up)
        health["node"] = None
        if down:
            health["status"] = "degraded"
            health["detail"] = f"nodes down: {', '.join(down)}"
        return JSONResponse(health)

    # -- WebSocket -----------------------------------------------------------------------
    async def _websocket(
        self, scope: Scope, receive: Receive, send: Send, target: ProxyTarget | None
    ) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        if target is not None:  # the front's, as a sandbox's HTTP traffic is
            await deny_websocket(
                send, Refusal(421, "a sandbox's traffic is relayed by the gateway's front")
            )
            return
        await deny_websocket(send, Refusal(404, "WebSockets go to sandboxes only"))


def _route_class(request: Request) -> str:
    """The class of a request that is not a sandbox's traffic, the ``route`` label of the
    gateway's latency metrics."""
    path = request.url.path
    if path in _LISTING:
        return "listing" if request.method == "GET" else "create"
    if _SANDBOX_ROUTE.match(path):
        return "sandbox-control"
    if path == "/nodes" or path.startswith("/nodes/"):
        return "nodes"
    return "health" if path == "/health" else "other"

"""Prometheus plumbing every component shares (node, gateway, scheduler): a registry of
its own per component (so several in one process, as in tests, never collide), the
request latency middleware, and the ``GET /metrics`` answer.

``/metrics`` sits beside each component's API and is authenticated as the rest of it:
the API key as ``X-API-Key`` or ``Authorization: Bearer`` (what Prometheus's
``authorization`` scrape setting sends). E2B's API has no ``/metrics`` route, so nothing
an SDK calls collides with it; on a node, sandbox traffic (``E2b-Sandbox-Id`` headers or
``{port}-{id}.{domain}`` hosts) goes to the sandbox, never here, as every such request.

What the components record is named ``aenv_*``; the request histogram is
``aenv_http_request_duration_seconds{component, method, route, status}``, where
``route`` is the route's template (``/sandboxes/{sandbox_id}``), never a raw path, so
the series stay few.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

METRICS_PATH = "/metrics"
# Seconds: from a cached envd call (a millisecond) to a cold create (a minute).
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


def request_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "aenv_http_request_duration_seconds",
        "Time to answer an HTTP request (to its response head; streamed bodies excluded)",
        ["component", "method", "route", "status"],
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )


def presented_key(headers: Headers) -> str | None:
    """The API key a request presents: ``X-API-Key``, else a Bearer token."""
    presented = headers.get("x-api-key")
    authorization = headers.get("authorization") or ""
    if presented is None and authorization.lower().startswith("bearer "):
        presented = authorization[7:].strip()
    return presented


def key_matches(headers: Headers, api_key: str) -> bool:
    presented = presented_key(headers)
    return presented is not None and secrets.compare_digest(presented.encode(), api_key.encode())


def metrics_response(registry: CollectorRegistry, headers: Headers, api_key: str) -> Response:
    """``GET /metrics``: the registry in Prometheus's text format, to a caller with the
    API key; a JSON 401 as every other refusal otherwise."""
    if not key_matches(headers, api_key):
        return JSONResponse({"code": 401, "message": "missing or invalid API key"}, 401)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def route_template(scope: Scope) -> str | None:
    """The template of the route Starlette matched (set in the scope by routing)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else None


class RequestMetrics:
    """ASGI middleware timing every HTTP request to its response head.

    ``route_of(scope)`` names the route once the request was answered (the matched
    template for routed apps, a class of request for the gateway); None falls back to
    the matched template, else ``sandbox-traffic`` for a sandbox's traffic, else
    ``other``. ``/metrics`` itself is answered here."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        component: str,
        registry: CollectorRegistry,
        api_key: str,
        route_of: Callable[[Scope], str | None] = route_template,
        histogram: Histogram | None = None,
    ) -> None:
        self.app = app
        self.component = component
        self.registry = registry
        self.api_key = api_key
        self.route_of = route_of
        self.histogram = histogram or request_histogram(registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        traffic = "e2b-sandbox-id" in headers or _sandbox_host(headers)
        scope["aenv.traffic"] = traffic
        if scope["path"] == METRICS_PATH and scope["method"] == "GET" and not traffic:
            await metrics_response(self.registry, headers, self.api_key)(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self._observe(scope, status, started)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        except BaseException:
            self._observe(scope, status, started)
            raise

    def _observe(self, scope: Scope, status: int, started: float) -> None:
        if scope.get("aenv.timed"):
            return
        scope["aenv.timed"] = True
        route = (
            self.route_of(scope)
            or route_template(scope)
            or ("sandbox-traffic" if scope.get("aenv.traffic") else "other")
        )
        self.histogram.labels(self.component, scope["method"], route, str(status)).observe(
            time.perf_counter() - started
        )


def _sandbox_host(headers: Headers) -> bool:
    """``{port}-{id}.{domain}``: a sandbox's name, whichever the domain."""
    host = (headers.get("host") or "").split(":", 1)[0]
    first = host.split(".", 1)[0]
    port, dash, _ = first.partition("-")
    return bool(dash) and port.isdigit() and "." in host

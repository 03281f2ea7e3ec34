"""``aenv-scheduler``: the cluster's node registry, placement and sandbox→node bindings,
served over HTTP (default ``127.0.0.1:9090``, HTTPS with ``--tls-cert``/``--tls-key``) to
nodes (heartbeats) and gateways (placements, binding lookups). What it knows lives in
Redis with ``--redis``, else in memory (``store``); bindings are rebuilt from the nodes'
heartbeat rosters either way (``registry``).

With Redis, several replicas may serve one cluster: every one reads and writes the same
nodes, bindings and reservations, and placements are atomic across them, so nodes and
gateways are given all their URLs (``AENV_SCHEDULER_URL=http://a:9090,http://b:9090``)
or one address in front of them, and a replica that dies (kill -9 included) costs only
the requests it had in flight, which its clients send again to another replica
(``scheduler_client``). Without Redis, run one.

``/metrics`` (with the API key) has its request latencies, placement decisions
(``aenv_scheduler_placements_total{node, outcome}``) and nodes by state. With
``--discovery`` (``discovery``), nodes that leave a static list or a Kubernetes
Service's EndpointSlices are marked down at once.

It runs as a process of its own, never inside a gateway: gateways are stateless and
several may run against one scheduler, so the registry (which holds the live node list
and the reservations placements make between heartbeats) must be one, reachable by all
of them and by every node. A scheduler inside one gateway would give each gateway its own
view of load and reservations and make nodes heartbeat to every gateway. For a small
setup, run one scheduler beside one gateway on the same host; it costs one more process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agentenv import __version__
from agentenv.api.http_protocol import JsonErrorsHttpToolsProtocol
from agentenv.cluster.discovery import Discovery, DiscoveryError, open_discovery
from agentenv.cluster.models import (
    Binding,
    BindRequest,
    ClusterError,
    NodeInfo,
    NodeReport,
    NodeState,
    Placement,
    PlacementRequest,
)
from agentenv.cluster.placement import Demand, LeastLoaded, PlacementStrategy
from agentenv.cluster.registry import NoCapacity, NodeRegistry, UnknownNode
from agentenv.cluster.store import StoreUnavailable, open_store
from agentenv.cluster.tls import add_server_arguments, check_server_arguments
from agentenv.observability import RequestMetrics

log = logging.getLogger("agentenv.cluster.scheduler")

DEFAULT_LISTEN = "127.0.0.1:9090"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(ClusterError(code=status, message=message).model_dump(), status)


class _NodesCollector(Collector):
    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        nodes = GaugeMetricFamily(
            "aenv_scheduler_nodes",
            "Nodes by state, as this replica last saw them",
            labels=["state"],
        )
        known = self.registry.states_seen().values()
        for state in NodeState:
            nodes.add_metric([state.value], sum(1 for seen in known if seen is state))
        yield nodes
        yield GaugeMetricFamily(
            "aenv_scheduler_discovered_nodes",
            "Node URLs discovery listed at its last look",
            value=len(self.registry.discovered()),
        )


def create_scheduler_app(
    registry: NodeRegistry,
    api_key: str,
    *,
    sweep_interval: float = 1.0,
    discovery: Discovery | None = None,
    discovery_interval: float = 5.0,
) -> FastAPI:
    """The scheduler's API over ``registry``; its lifespan logs nodes going silent (looking
    every ``sweep_interval`` seconds) and, with ``discovery``, marks nodes that left its
    list down every ``discovery_interval`` seconds."""
    metrics = CollectorRegistry()
    placements = Counter(
        "aenv_scheduler_placements",
        "Placement decisions: the node chosen, or no_capacity",
        ["node", "outcome"],
        registry=metrics,
    )
    metrics.register(_NodesCollector(registry))

    async def sweep() -> None:
        while True:
            await asyncio.sleep(sweep_interval)
            try:
                for node_id in await registry.newly_down():
                    log.warning("node %s stopped heartbeating: down", node_id)
            except StoreUnavailable as exc:
                log.debug("nodes not looked at: %s", exc)

    async def discover(discovery: Discovery) -> None:
        failing = False
        while True:
            try:
                urls = await discovery.node_urls()
                downed = await registry.follow_discovery(urls)
            except (DiscoveryError, StoreUnavailable) as exc:
                if not failing:
                    log.warning("discovery failed (nodes kept as they are): %s", exc)
                failing = True
            else:
                failing = False
                for node_id in downed:
                    log.warning("node %s left discovery: marked down", node_id)
            await asyncio.sleep(discovery_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(sweep())]
        if discovery is not None:
            tasks.append(loop.create_task(discover(discovery)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await registry.store.aclose()

    async def require_api_key(x_api_key: Annotated[str | None, Header()] = None) -> None:
        if x_api_key is None or not secrets.compare_digest(x_api_key.encode(), api_key.encode()):
            raise _Refused(401, "missing or invalid X-API-Key")

    app = FastAPI(title="agentenv scheduler", version=__version__, lifespan=lifespan)
    app.add_middleware(RequestMetrics, component="scheduler", registry=metrics, api_key=api_key)
    authed = [Depends(require_api_key)]

    @app.exception_handler(_Refused)
    async def refused(request: Request, exc: _Refused) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(StoreUnavailable)
    async def store_down(request: Request, exc: StoreUnavailable) -> JSONResponse:
        return _error(503, str(exc))

    @app.get("/health")
    async def health(x_api_key: Annotated[str | None, Header()] = None) -> dict[str, object]:
        # Probes ask without the key and learn that it answers; how many nodes it knows
        # is for the key holder, as on the nodes and the gateway.
        answer: dict[str, object] = {"status": "ok", "version": __version__}
        if x_api_key is None:
            return answer
        await require_api_key(x_api_key)
        return answer | {
            "nodes": len(registry.states_seen()),
            "discovered": len(registry.discovered()),
        }

    @app.post("/heartbeats", response_model=NodeInfo, dependencies=authed)
    async def heartbeat(report: NodeReport) -> NodeInfo:
        return await registry.heartbeat(report)

    @app.get("/nodes", response_model=list[NodeInfo], dependencies=authed)
    async def list_nodes() -> list[NodeInfo]:
        return await registry.nodes()

    @app.get("/nodes/{node_id}", response_model=NodeInfo, dependencies=authed)
    async def get_node(node_id: str) -> NodeInfo:
        node = await registry.node(node_id)
        if node is None:
            raise _Refused(404, f"node {node_id!r} not found")
        return node

    @app.delete("/nodes/{node_id}", status_code=204, dependencies=authed)
    async def node_left(node_id: str) -> Response:
        await registry.forget(node_id)
        return Response(status_code=204)

    @app.post("/placements", response_model=Placement, dependencies=authed)
    async def place(body: PlacementRequest) -> Placement:
        demand = Demand(
            body.template_id, body.vcpus, body.memory_mib, frozenset(body.exclude_nodes)
        )
        try:
            placement_id, node = await registry.place(demand)
        except NoCapacity as exc:
            placements.labels("", "no_capacity").inc()
            raise _Refused(503, str(exc)) from exc
        placements.labels(node.node_id, "placed").inc()
        log.info("placed a sandbox of %s on %s", body.template_id, node.node_id)
        return Placement(placementID=placement_id, node=node)

    @app.delete("/placements/{placement_id}", status_code=204, dependencies=authed)
    async def release(placement_id: str) -> Response:
        await registry.release(placement_id)
        return Response(status_code=204)

    @app.put("/bindings/{sandbox_id}", response_model=Binding, dependencies=authed)
    async def bind(sandbox_id: str, body: BindRequest) -> Binding:
        try:
            return await registry.bind(sandbox_id, body.node_id, body.placement_id)
        except UnknownNode as exc:
            raise _Refused(404, str(exc)) from exc

    @app.get("/bindings/{sandbox_id}", response_model=Binding, dependencies=authed)
    async def lookup(sandbox_id: str) -> Binding:
        binding = await registry.lookup(sandbox_id)
        if binding is None:
            raise _Refused(404, f"sandbox {sandbox_id} is bound to no node")
        return binding

    @app.delete("/bindings/{sandbox_id}", status_code=204, dependencies=authed)
    async def unbind(sandbox_id: str) -> Response:
        await registry.unbind(sandbox_id)
        return Response(status_code=204)

    return app


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def build_registry(
    redis_url: str | None,
    *,
    overcommit: float,
    node_timeout: float,
    binding_grace: float,
    strategy: PlacementStrategy | None = None,
) -> NodeRegistry:
    return NodeRegistry(
        open_store(redis_url),
        strategy or LeastLoaded(overcommit=overcommit),
        node_timeout=node_timeout,
        binding_grace=binding_grace,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="aenv-scheduler", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help=f"host:port ({DEFAULT_LISTEN})")
    parser.add_argument(
        "--redis",
        help="redis://host:port/db for nodes, bindings and reservations, shared by every "
        "replica (default: memory, one scheduler)",
    )
    parser.add_argument(
        "--overcommit",
        type=float,
        default=4.0,
        help="how far allocations may exceed a node's CPUs and memory (default 4.0)",
    )
    parser.add_argument(
        "--node-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat after which a node is down (default 10)",
    )
    parser.add_argument(
        "--binding-grace",
        type=float,
        default=30.0,
        help="seconds a new binding is kept though its node's roster lacks it (default 30)",
    )
    parser.add_argument(
        "--discovery",
        default=os.environ.get("AENV_DISCOVERY"),
        help="static:URL,... or kubernetes:NAMESPACE/SERVICE[:PORT] (env AENV_DISCOVERY): "
        "nodes leaving that list are marked down at once (default: heartbeats only)",
    )
    add_server_arguments(parser, "nodes and gateways then verify it with their AENV_CA_FILE")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    check_server_arguments("aenv-scheduler", args)
    api_key = os.environ.get("AENV_API_KEY")
    if not api_key:
        sys.exit("aenv-scheduler: set AENV_API_KEY (the key nodes and gateways present)")
    try:
        discovery = open_discovery(args.discovery)
    except ValueError as exc:
        sys.exit(f"aenv-scheduler: {exc}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    registry = build_registry(
        args.redis,
        overcommit=args.overcommit,
        node_timeout=args.node_timeout,
        binding_grace=args.binding_grace,
    )
    app = create_scheduler_app(
        registry,
        api_key,
        sweep_interval=min(1.0, args.node_timeout / 4),
        discovery=discovery,
    )
    host, _, port = args.listen.rpartition(":")
    uvicorn.run(
        app,
        host=host,
        port=int(port),
        log_level="warning",
        http=JsonErrorsHttpToolsProtocol,
        loop="uvloop",
        ssl_certfile=args.tls_cert,
        ssl_keyfile=args.tls_key,
    )


if __name__ == "__main__":
    main()

"""The FastAPI application: routes, API-key check and JSON error bodies.

``create_app`` takes a started-or-not orchestrator; the application's lifespan runs the
orchestrator's startup and shutdown, so the same object serves tests and the real server.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Query, Response

from agentenv import __version__
from agentenv.api.body_limit import BodyLimitMiddleware
from agentenv.api.errors import (
    ERROR_RESPONSES,
    ApiError,
    http_status,
    install_error_handlers,
)
from agentenv.api.links import add_links
from agentenv.api.listing import listing_routes
from agentenv.api.models import (
    ConnectRequest,
    ErrorBody,
    ForkRequest,
    ForkResult,
    Health,
    Lifecycle,
    Lineage,
    NetworkUpdate,
    NewSandbox,
    NodeCacheInfo,
    NodeDiskInfo,
    PauseRequest,
    PublicHealth,
    RefreshRequest,
    Sandbox,
    SandboxDetail,
    SandboxMetric,
    SnapshotInfo,
    SnapshotRequest,
    TimeoutRequest,
    VolumeMountBody,
)
from agentenv.api.network import create_options, network_info, updated_egress
from agentenv.api.nodes import NodeBook, node_routes
from agentenv.api.params import SandboxId, TemplateRef
from agentenv.api.secrets import secret_routes
from agentenv.api.telemetry import NodeTelemetry
from agentenv.api.template_listing import template_listing_routes
from agentenv.api.template_tags import template_tag_routes
from agentenv.api.templates import UPLOAD_PATH, template_routes
from agentenv.api.volumes import VOLUME_UPLOAD_PATH, volume_routes
from agentenv.cluster.heartbeat import Heartbeat
from agentenv.limits import (
    MAX_PAGE_SIZE,
    MAX_REQUEST_BODY_BYTES,
)
from agentenv.observability import RequestMetrics
from agentenv.orchestrator.builds import BuildManager
from agentenv.orchestrator.errors import (
    Conflict,
    OrchestratorError,
    SandboxNotFound,
    SnapshotNotFound,
    TemplateAliasNotFound,
)
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.templates import BUILTIN_TEMPLATES
from agentenv.orchestrator.views import SandboxView, SnapshotView
from agentenv.orchestrator.volumes import Requested
from agentenv.proxy.forward import SandboxProxy, SandboxTrafficMiddleware

log = logging.getLogger("agentenv.api")

# The last second a datetime holds (9999-12-31T23:59:58, so that end + 1 fits too).
_LAST_UNIX_SECOND = 253_402_300_798


def create_app(
    orchestrator: Orchestrator, api_key: str, *, manage_lifecycle: bool = True
) -> FastAPI:
    builds = BuildManager(orchestrator)
    book = NodeBook(orchestrator)
    telemetry = NodeTelemetry(orchestrator, book)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await orchestrator.startup()
        heartbeat = None
        if orchestrator.config.scheduler_url:
            heartbeat = Heartbeat(orchestrator, orchestrator.config, api_key, book.node)
            heartbeat.start()
        try:
            yield
        finally:
            if heartbeat is not None:
                await heartbeat.stop()
            await proxy.aclose()
            await builds.shutdown()
            if manage_lifecycle:
                await orchestrator.shutdown()

    app = FastAPI(
        title="agentenv",
        version=__version__,
        description="E2B-compatible microVM sandboxes",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
    )
    proxy = SandboxProxy(orchestrator)
    app.state.orchestrator = orchestrator
    app.state.builds = builds
    app.state.telemetry = telemetry

    install_error_handlers(app)
    documented = app.openapi

    def openapi_with_links() -> dict[str, Any]:
        if app.openapi_schema is None:
            add_links(documented())  # the document is made once and kept
        return documented()

    app.openapi = openapi_with_links  # type: ignore[method-assign]
    # Bodies of control-plane requests are bound; template uploads stream archives and
    # are not. Added first, so it runs inside the proxy's middleware: sandbox traffic
    # (envd file uploads) never reaches it.
    app.add_middleware(
        BodyLimitMiddleware,
        limit=MAX_REQUEST_BODY_BYTES,
        exempt=re.compile(f"(?:{UPLOAD_PATH})|(?:{VOLUME_UPLOAD_PATH})"),
    )
    # Sandbox traffic goes to the proxy before routing and authentication.
    app.add_middleware(SandboxTrafficMiddleware, proxy=proxy)
    # Outermost: times sandbox traffic too, and answers /metrics (observability).
    app.add_middleware(
        RequestMetrics, component="node", registry=telemetry.registry, api_key=api_key
    )

    # -- auth ----------------------------------------------------------------------------
    async def require_api_key(
        x_api_key: Annotated[str | None, Header()] = None,
        authorization: Annotated[str | None, Header()] = None,
    ) -> None:
        presented = x_api_key
        if presented is None and authorization and authorization.lower().startswith("bearer "):
            presented = authorization[7:].strip()
        if presented is None:
            raise ApiError(401, "missing API key: send it in the X-API-Key header")
        if not secrets.compare_digest(presented.encode(), api_key.encode()):
            raise ApiError(401, "invalid API key")

    authed = [Depends(require_api_key)]
    app.include_router(template_routes(orchestrator, builds, api_key, authed))
    app.include_router(template_tag_routes(orchestrator, authed))
    # After the routes under /templates/{id}/...: its {id:ref} would match their paths.
    app.include_router(template_listing_routes(orchestrator, builds, authed))
    app.include_router(node_routes(book, authed))
    app.include_router(secret_routes(orchestrator, authed))
    app.include_router(volume_routes(orchestrator, authed))

    def sandbox_body(view: SandboxView) -> Sandbox:
        rec = view.record
        return Sandbox(
            templateID=rec.template_id,
            sandboxID=rec.sandbox_id,
            envdVersion=rec.envd_version,
            envdAccessToken=rec.envd_token,
            trafficAccessToken=rec.traffic_token,
            domain=orchestrator.config.domain,
        )

    def detail_body(view: SandboxView) -> SandboxDetail:
        rec = view.record
        return SandboxDetail(
            templateID=rec.template_id,
            sandboxID=rec.sandbox_id,
            startedAt=rec.started_at,
            endAt=rec.end_at,
            cpuCount=rec.vcpus,
            memoryMB=rec.memory_mib,
            diskSizeMB=rec.disk_size_mib,
            state="paused" if view.state == "paused" else "running",
            envdVersion=rec.envd_version,
            metadata=rec.metadata,
            envdAccessToken=rec.envd_token,
            domain=orchestrator.config.domain,
            lifecycle=Lifecycle(
                autoResume=rec.auto_resume, onTimeout="pause" if rec.auto_pause else "kill"
            ),
            pauseMode=(
                ("filesystem" if rec.pause_mode == "filesystem" else "full")
                if view.state == "paused"
                else None
            ),
            pauseCommitted=(orchestrator.pause_committed(rec) if view.state == "paused" else None),
            lineage=Lineage(
                parentID=rec.parent_id,
                sourceID=rec.template_id,
                snapshotID=rec.snapshot_id,
                children=list(view.children),
            ),
            allowInternetAccess=rec.network.egress.allow_internet,
            network=network_info(rec.network),
            volumeMounts=[VolumeMountBody(name=m.name, path=m.path) for m in rec.volumes] or None,
        )

    def snapshot_body(view: SnapshotView) -> SnapshotInfo:
        rec = view.record
        return SnapshotInfo(
            snapshotID=rec.snapshot_id,
            names=view.names,
            sandboxID=rec.sandbox_id,
            templateID=rec.template_id,
            parentID=rec.parent_id,
            createdAt=rec.created_at,
        )

    app.include_router(listing_routes(orchestrator, authed, detail_body, snapshot_body))

    # -- routes --------------------------------------------------------------------------
    @app.get("/health", response_model=Health | PublicHealth, tags=["node"])
    async def health(
        x_api_key: Annotated[str | None, Header()] = None,
        authorization: Annotated[str | None, Header()] = None,
    ) -> Health | PublicHealth:
        """Without a key, only whether the node is up (probes send none); with the key,
        what it runs and holds. A wrong key is refused like everywhere else."""
        node = orchestrator.node_status()
        status: Literal["ok", "degraded"] = "degraded" if node.problem else "ok"
        if x_api_key is None and not authorization:
            return PublicHealth(status=status, version=__version__)
        await require_api_key(x_api_key, authorization)
        return Health(
            status=status,
            version=__version__,
            vmm=node.vmm,
            accel=node.accel,
            mode=f"{node.vmm}/{node.accel}",
            modeReason=node.mode_reason or None,
            templates=node.templates,
            sandboxes=node.sandboxes,
            detail=node.problem,
            node=node.node,
            repository=node.repository,
            cache=NodeCacheInfo(
                usedBytes=node.cache_used_bytes,
                limitBytes=node.cache_limit_bytes,
                entries=node.cache_entries,
            ),
            sandboxesByState=node.sandboxes_by_state,
            allocatedVcpus=node.allocated_vcpus,
            allocatedMemoryMib=node.allocated_memory_mib,
            memoryMode=node.memory_mode,
            disk=NodeDiskInfo(
                freeBytes=node.disk.free_bytes,
                totalBytes=node.disk.total_bytes,
                floorBytes=node.disk.floor_bytes,
            ),
        )

    creates = IdempotentCreates()

    async def _create(body: NewSandbox, secure: bool, idempotency_key: str | None) -> Sandbox:
        network = create_options(body)
        await orchestrator.secrets.require(network.egress.secret_names)

        async def create() -> Sandbox:
            started = orchestrator.create(
                body.template_id,
                timeout=body.timeout,
                metadata=body.metadata,
                env_vars=body.env_vars,
                secure=secure,
                network=network,
                auto_pause=body.auto_pause,
                auto_resume=body.auto_resume is not None and body.auto_resume.enabled,
                volume_mounts=[Requested(m.name, m.path) for m in body.volume_mounts],
                # Clients reach envd through the proxy, which waits for its /init.
                envd_in_background=True,
            )
            view = await telemetry.timed("create", started)
            return sandbox_body(view)

        if idempotency_key:
            return await creates.run(idempotency_key, create)
        return await create()

    @app.post(
        "/sandboxes",
        status_code=201,
        response_model=Sandbox,
        response_model_by_alias=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def create_sandbox_v1(
        body: NewSandbox,
        idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
    ) -> Sandbox:
        # E2B's v1 secures only on request; here it is always secured unless the server
        # was told to honour the flag (config honour_v1_secure_flag).
        secure = body.secure or not orchestrator.config.honour_v1_secure_flag
        return await _create(body, secure, idempotency_key)

    @app.post(
        "/v2/sandboxes",
        status_code=201,
        response_model=Sandbox,
        response_model_by_alias=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def create_sandbox_v2(
        body: NewSandbox,
        idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
    ) -> Sandbox:
        # V2 has no `secure` field: its sandboxes are always secured with a token.
        return await _create(body, True, idempotency_key)

    @app.get(
        # Before /sandboxes/{sandbox_id}, which would take "metrics" for an id.
        "/sandboxes/metrics",
        response_model=dict[str, dict[str, SandboxMetric]],
        response_model_by_alias=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def sandboxes_metrics(
        sandbox_ids: Annotated[list[str], Query()],
    ) -> dict[str, dict[str, SandboxMetric]]:
        """E2B's ``SandboxesWithMetrics``: the latest sample of each sandbox named
        (comma-separated, or the parameter repeated); those unknown or not sampled yet
        are left out."""
        wanted = {i.strip() for value in sandbox_ids for i in value.split(",") if i.strip()}
        if len(wanted) > MAX_PAGE_SIZE:
            raise ApiError(400, f"at most {MAX_PAGE_SIZE} sandbox_ids")
        latest = orchestrator.latest_metrics(wanted)
        return {
            "sandboxes": {
                sandbox_id: metric_body(sample.at, sample.figures, vcpus)
                for sandbox_id, (sample, vcpus) in latest.items()
            }
        }

    @app.get(
        "/sandboxes/{sandbox_id}",
        response_model=SandboxDetail,
        response_model_by_alias=True,
        # Optional fields are left out rather than null: the SDK parses a present
        # `pauseMode` (and others) as a value.
        response_model_exclude_none=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def get_sandbox(sandbox_id: SandboxId) -> SandboxDetail:
        return detail_body(orchestrator.get(sandbox_id))

    @app.delete("/sandboxes/{sandbox_id}", status_code=204, dependencies=authed, tags=["sandboxes"])
    async def kill_sandbox(sandbox_id: SandboxId) -> Response:
        await orchestrator.kill(sandbox_id)
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/timeout",
        status_code=204,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def set_timeout(sandbox_id: SandboxId, body: TimeoutRequest) -> Response:
        await orchestrator.set_timeout(sandbox_id, body.timeout)
        return Response(status_code=204)

    @app.put(
        "/sandboxes/{sandbox_id}/network",
        status_code=204,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def update_network(sandbox_id: SandboxId, body: NetworkUpdate) -> Response:
        """Replace a running sandbox's egress rules (e2b's ``Sandbox.update_network``);
        what the body leaves out is cleared. 409 while the sandbox is paused."""
        egress = updated_egress(body)
        await orchestrator.secrets.require(egress.secret_names)
        await orchestrator.update_network(sandbox_id, egress)
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/refreshes",
        status_code=204,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def refresh(sandbox_id: SandboxId, body: RefreshRequest | None = None) -> Response:
        duration = body.duration if body and body.duration else orchestrator.config.default_timeout
        await orchestrator.set_timeout(sandbox_id, duration, only_extend=True)
        return Response(status_code=204)

    @app.get(
        "/sandboxes/{sandbox_id}/metrics",
        response_model=list[SandboxMetric],
        response_model_by_alias=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def sandbox_metrics(
        sandbox_id: SandboxId,
        start: Annotated[int | None, Query(ge=0, le=_LAST_UNIX_SECOND)] = None,
        end: Annotated[int | None, Query(ge=0, le=_LAST_UNIX_SECOND)] = None,
    ) -> list[SandboxMetric]:
        """The samples taken (every 5 s while the sandbox runs) between ``start`` and
        ``end``, unix seconds, both included; by default its whole life. A sandbox that
        is not running records none, so a window of a pause is empty, not an error."""
        view = orchestrator.get(sandbox_id)
        samples = await orchestrator.metrics(
            sandbox_id,
            datetime.fromtimestamp(start, UTC) if start is not None else None,
            # The SDK sends whole seconds: the end's second is all in the window.
            datetime.fromtimestamp(end + 1, UTC) if end is not None else None,
        )
        return [metric_body(s.at, s.figures, view.record.vcpus) for s in samples]

    async def _connect(sandbox_id: str, body: ConnectRequest | None, response: Response) -> Sandbox:
        """200 with a running sandbox (its lifetime only extended); 201 when it was paused
        and has been resumed."""
        timeout = body.timeout if body and body.timeout is not None else None
        try:
            # Settled first: a sandbox whose VMM just exited is paused, and resumed here.
            current = await orchestrator.get_settled(sandbox_id)
        except SandboxNotFound:
            # Perhaps paused on another node that shares the repository.
            response.status_code = 201
            return sandbox_body(
                await telemetry.timed("resume", orchestrator.adopt(sandbox_id, timeout))
            )
        if current.state == "paused":
            try:
                view = await telemetry.timed("resume", orchestrator.resume(sandbox_id, timeout))
            except Conflict:
                pass  # a concurrent connect resumed it first
            else:
                response.status_code = 201
                return sandbox_body(view)
        if timeout is not None:
            view = await orchestrator.set_timeout(sandbox_id, timeout, only_extend=True)
        else:
            view = orchestrator.get(sandbox_id)
        return sandbox_body(view)

    connect_route: dict[str, Any] = {
        "response_model": Sandbox,
        "response_model_by_alias": True,
        "responses": {
            201: {"model": Sandbox, "description": "The sandbox was paused and is resumed"},
        },
        "dependencies": authed,
        "tags": ["sandboxes"],
    }

    @app.post("/sandboxes/{sandbox_id}/connect", **connect_route)  # SDK 2.6-2.50
    @app.post("/v2/sandboxes/{sandbox_id}/connect", **connect_route)
    async def connect(
        sandbox_id: SandboxId, response: Response, body: ConnectRequest | None = None
    ) -> Sandbox:
        return await _connect(sandbox_id, body, response)

    @app.post(
        "/sandboxes/{sandbox_id}/pause", status_code=204, dependencies=authed, tags=["sandboxes"]
    )
    async def pause_sandbox(sandbox_id: SandboxId, body: PauseRequest | None = None) -> Response:
        # `memory: false` keeps the disk only; the guest boots from it on resume.
        memory = body is None or body.memory
        await telemetry.timed("pause", orchestrator.pause(sandbox_id, memory=memory))
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/resume",
        status_code=201,
        response_model=Sandbox,
        response_model_by_alias=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def resume_sandbox(sandbox_id: SandboxId, body: ConnectRequest | None = None) -> Sandbox:
        """The pre-2.6 SDKs' resume: 409 when the sandbox is already running."""
        timeout = body.timeout if body and body.timeout is not None else None
        resumed = await telemetry.timed("resume", orchestrator.resume(sandbox_id, timeout))
        return sandbox_body(resumed)

    # -- snapshots and forks ---------------------------------------------------------------
    @app.post(
        "/sandboxes/{sandbox_id}/snapshots",
        status_code=201,
        response_model=SnapshotInfo,
        response_model_by_alias=True,
        dependencies=authed,
        tags=["snapshots"],
    )
    async def create_snapshot(
        sandbox_id: SandboxId, body: SnapshotRequest | None = None
    ) -> SnapshotInfo:
        """Snapshot a running sandbox, which keeps running. The snapshot's id or name is
        accepted wherever a template is."""
        if body is not None and body.memory is False:
            raise ApiError(400, "memory: filesystem-only snapshots are not supported")
        name = body.name if body else None
        return snapshot_body(await orchestrator.snapshot(sandbox_id, name))

    @app.get(
        "/snapshots/{snapshot_id:ref}",
        response_model=SnapshotInfo,
        response_model_by_alias=True,
        dependencies=authed,
        tags=["snapshots"],
    )
    async def get_snapshot(snapshot_id: TemplateRef) -> SnapshotInfo:
        return snapshot_body(await orchestrator.get_snapshot(snapshot_id))

    @app.delete(
        "/snapshots/{snapshot_id:ref}", status_code=204, dependencies=authed, tags=["snapshots"]
    )
    async def delete_snapshot(snapshot_id: TemplateRef) -> Response:
        await orchestrator.delete_snapshot(snapshot_id)
        return Response(status_code=204)

    @app.delete(
        "/templates/{template_id:ref}", status_code=204, dependencies=authed, tags=["templates"]
    )
    async def delete_template(template_id: TemplateRef) -> Response:
        """The SDK deletes snapshots through this route (they are templates to E2B)."""
        if template_id in BUILTIN_TEMPLATES or orchestrator.store.get_template(template_id):
            raise ApiError(409, f"template {template_id!r} is built in and cannot be deleted")
        try:
            # By name (or name:tag): the template with all its builds and tags.
            await orchestrator.delete_template(template_id)
        except (SnapshotNotFound, TemplateAliasNotFound):
            try:
                await orchestrator.delete_snapshot(template_id)
            except SnapshotNotFound:
                raise ApiError(404, f"template or snapshot {template_id!r} not found") from None
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/fork",
        status_code=201,
        response_model=list[ForkResult],
        response_model_by_alias=True,
        response_model_exclude_none=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def fork_sandbox(
        sandbox_id: SandboxId, body: ForkRequest | None = None
    ) -> list[ForkResult]:
        """Fork a running sandbox into ``count`` children on this node; the parent keeps
        running. One item per child: its sandbox or the error that stopped it."""
        body = body or ForkRequest()
        results = await telemetry.timed(
            "fork", orchestrator.fork(sandbox_id, body.count, body.timeout)
        )
        out = []
        for result in results:
            if isinstance(result, SandboxView):
                out.append(ForkResult(sandbox=sandbox_body(result)))
            else:
                status = http_status(result)
                code = result.code.value if isinstance(result, OrchestratorError) else None
                out.append(
                    ForkResult(error=ErrorBody(code=status, message=str(result), error_code=code))
                )
        return out

    return app


class IdempotentCreates:
    """Remembers sandbox creates by ``Idempotency-Key`` so a retried POST (the SDK retries
    creates on 502/503/504) returns the sandbox the first attempt made instead of a second
    one. A repeat while the first is running joins it; failed attempts are forgotten."""

    def __init__(self, ttl: float = 600.0) -> None:
        self.ttl = ttl
        self._entries: dict[str, tuple[float, asyncio.Task[Sandbox]]] = {}

    async def run(self, key: str, create: Callable[[], Coroutine[Any, Any, Sandbox]]) -> Sandbox:
        now = time.monotonic()
        for stale in [k for k, (expires, _) in self._entries.items() if expires < now]:
            del self._entries[stale]
        entry = self._entries.get(key)
        if entry is not None and not _failed(entry[1]):
            return await asyncio.shield(entry[1])
        task = asyncio.get_running_loop().create_task(create())
        self._entries[key] = (now + self.ttl, task)
        # Shielded: a client that disconnects must not abort a create others may join.
        return await asyncio.shield(task)


def _failed(task: asyncio.Task[Sandbox]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


def metric_body(at: datetime, figures: dict[str, object], vcpus: int) -> SandboxMetric:
    """One sample in E2B's shape (envd's figures; the host's time, which windows use)."""

    def number(key: str, default: float = 0) -> float:
        value = figures.get(key, default)
        return float(value) if isinstance(value, int | float) else default

    return SandboxMetric(
        timestamp=at,
        timestampUnix=int(at.timestamp()),
        cpuCount=int(number("cpu_count", vcpus)),
        cpuUsedPct=number("cpu_used_pct"),
        memUsed=int(number("mem_used")),
        memTotal=int(number("mem_total")),
        memCache=int(number("mem_cache")),
        diskUsed=int(number("disk_used")),
        diskTotal=int(number("disk_total")),
    )

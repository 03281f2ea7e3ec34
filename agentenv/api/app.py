"""The FastAPI application: routes, API-key check and JSON error bodies.

``create_app`` takes a started-or-not orchestrator; the application's lifespan runs the
orchestrator's startup and shutdown, so the same object serves tests and the real server.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentenv import __version__
from agentenv.api.errors import http_status
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
    RefreshRequest,
    Sandbox,
    SandboxDetail,
    SandboxMetric,
    SnapshotInfo,
    SnapshotRequest,
    TimeoutRequest,
)
from agentenv.api.network import create_options, network_info, updated_egress
from agentenv.api.templates import template_routes
from agentenv.limits import MAX_PAGE_SIZE
from agentenv.orchestrator.builds import BuildManager
from agentenv.orchestrator.errors import (
    Conflict,
    OrchestratorError,
    SandboxNotFound,
    SnapshotNotFound,
)
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.templates import BASE_TEMPLATE
from agentenv.orchestrator.views import SandboxView, SnapshotView
from agentenv.proxy.forward import SandboxProxy, SandboxTrafficMiddleware

log = logging.getLogger("agentenv.api")

ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 409, 500, 503)
}


# Routes that write new files to the data directory (create, resume, snapshot, fork)
# refuse to while it is below its free-space floor, or when a write finds no space.
INSUFFICIENT_STORAGE: dict[int | str, dict[str, Any]] = {
    507: {
        "model": ErrorBody,
        "description": "No room on the node: below its free-space floor, or a write found none",
    }
}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def create_app(
    orchestrator: Orchestrator, api_key: str, *, manage_lifecycle: bool = True
) -> FastAPI:
    builds = BuildManager(orchestrator)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await orchestrator.startup()
        try:
            yield
        finally:
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

    # -- errors: always JSON {code, message} ---------------------------------------------
    @app.exception_handler(OrchestratorError)
    async def _orchestrator_error(_: Request, exc: OrchestratorError) -> JSONResponse:
        return error_response(http_status(exc), str(exc))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        return error_response(400, "; ".join(problems) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    # Sandbox traffic goes to the proxy before routing and authentication.
    app.add_middleware(SandboxTrafficMiddleware, proxy=proxy)

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

    # -- routes --------------------------------------------------------------------------
    @app.get("/health", response_model=Health, tags=["node"])
    async def health() -> Health:
        node = orchestrator.node_status()
        return Health(
            status="degraded" if node.problem else "ok",
            version=__version__,
            vmm=node.vmm,
            accel=node.accel,
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

        async def create() -> Sandbox:
            view = await orchestrator.create(
                body.template_id,
                timeout=body.timeout,
                metadata=body.metadata,
                env_vars=body.env_vars,
                secure=secure,
                network=network,
                auto_pause=body.auto_pause,
                auto_resume=body.auto_resume is not None and body.auto_resume.enabled,
            )
            return sandbox_body(view)

        if idempotency_key:
            return await creates.run(idempotency_key, create)
        return await create()

    @app.post(
        "/sandboxes",
        status_code=201,
        responses=INSUFFICIENT_STORAGE,
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
        responses=INSUFFICIENT_STORAGE,
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
        "/sandboxes",
        response_model=list[SandboxDetail],
        response_model_by_alias=True,
        # Optional fields are left out rather than null: the SDK parses a present
        # `pauseMode` (and others) as a value.
        response_model_exclude_none=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def list_sandboxes_v1() -> list[SandboxDetail]:
        return [detail_body(v) for v in orchestrator.list_sandboxes()]

    @app.get(
        "/v2/sandboxes",
        response_model=list[SandboxDetail],
        response_model_by_alias=True,
        # Optional fields are left out rather than null: the SDK parses a present
        # `pauseMode` (and others) as a value.
        response_model_exclude_none=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def list_sandboxes_v2(
        response: Response,
        metadata: str | None = None,
        state: str | None = None,
        limit: Annotated[int | None, Query(ge=1, le=MAX_PAGE_SIZE)] = None,
        next_token: Annotated[str | None, Query(alias="nextToken")] = None,
    ) -> list[SandboxDetail]:
        views = orchestrator.list_sandboxes()
        if state:
            wanted = {s.strip() for s in state.split(",") if s.strip()}
            unknown = wanted - {"running", "paused"}
            if unknown:
                raise ApiError(400, f"state: unknown value(s) {', '.join(sorted(unknown))}")
            views = [v for v in views if v.state in wanted]
        if metadata:
            # The SDK quotes keys and values, then encodes the whole string once more.
            wanted_meta = {
                urllib.parse.unquote(k): urllib.parse.unquote(v)
                for k, v in urllib.parse.parse_qsl(metadata, keep_blank_values=True)
            }
            views = [
                v
                for v in views
                if all(v.record.metadata.get(k) == val for k, val in wanted_meta.items())
            ]
        views.sort(key=lambda v: (v.record.started_at, v.sandbox_id))
        page = _page(views, _page_key, next_token, limit, response)
        return [detail_body(v) for v in page]

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
    async def get_sandbox(sandbox_id: str) -> SandboxDetail:
        return detail_body(orchestrator.get(sandbox_id))

    @app.delete("/sandboxes/{sandbox_id}", status_code=204, dependencies=authed, tags=["sandboxes"])
    async def kill_sandbox(sandbox_id: str) -> Response:
        await orchestrator.kill(sandbox_id)
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/timeout",
        status_code=204,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def set_timeout(sandbox_id: str, body: TimeoutRequest) -> Response:
        await orchestrator.set_timeout(sandbox_id, body.timeout)
        return Response(status_code=204)

    @app.put(
        "/sandboxes/{sandbox_id}/network",
        status_code=204,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def update_network(sandbox_id: str, body: NetworkUpdate) -> Response:
        """Replace a running sandbox's egress rules (e2b's ``Sandbox.update_network``);
        what the body leaves out is cleared. 409 while the sandbox is paused."""
        await orchestrator.update_network(sandbox_id, updated_egress(body))
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/refreshes",
        status_code=204,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def refresh(sandbox_id: str, body: RefreshRequest | None = None) -> Response:
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
    async def sandbox_metrics(sandbox_id: str) -> list[SandboxMetric]:
        view = orchestrator.get(sandbox_id)
        data = await orchestrator.guest_metrics(sandbox_id)
        if data is None:
            # Not running (paused, or its VMM just exited). E2B answers with the metrics
            # recorded in a time range, and the SDK returns that list; a sandbox that
            # is not running records none, so the list is empty rather than an error.
            return []
        ts = float(str(data.get("ts", time.time())))
        return [
            SandboxMetric(
                timestamp=datetime.fromtimestamp(ts, UTC),
                timestampUnix=int(ts),
                cpuCount=int(str(data.get("cpu_count", view.record.vcpus))),
                cpuUsedPct=float(str(data.get("cpu_used_pct", 0.0))),
                memUsed=int(str(data.get("mem_used", 0))),
                memTotal=int(str(data.get("mem_total", 0))),
                memCache=int(str(data.get("mem_cache", 0))),
                diskUsed=int(str(data.get("disk_used", 0))),
                diskTotal=int(str(data.get("disk_total", 0))),
            )
        ]

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
            return sandbox_body(await orchestrator.adopt(sandbox_id, timeout))
        if current.state == "paused":
            try:
                view = await orchestrator.resume(sandbox_id, timeout)
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
            **INSUFFICIENT_STORAGE,
        },
        "dependencies": authed,
        "tags": ["sandboxes"],
    }

    @app.post("/sandboxes/{sandbox_id}/connect", **connect_route)  # SDK 2.6-2.50
    @app.post("/v2/sandboxes/{sandbox_id}/connect", **connect_route)
    async def connect(
        sandbox_id: str, response: Response, body: ConnectRequest | None = None
    ) -> Sandbox:
        return await _connect(sandbox_id, body, response)

    @app.post(
        "/sandboxes/{sandbox_id}/pause", status_code=204, dependencies=authed, tags=["sandboxes"]
    )
    async def pause_sandbox(sandbox_id: str, body: PauseRequest | None = None) -> Response:
        # `memory: false` keeps the disk only; the guest boots from it on resume.
        await orchestrator.pause(sandbox_id, memory=body is None or body.memory)
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/resume",
        status_code=201,
        responses=INSUFFICIENT_STORAGE,
        response_model=Sandbox,
        response_model_by_alias=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def resume_sandbox(sandbox_id: str, body: ConnectRequest | None = None) -> Sandbox:
        """The pre-2.6 SDKs' resume: 409 when the sandbox is already running."""
        timeout = body.timeout if body and body.timeout is not None else None
        return sandbox_body(await orchestrator.resume(sandbox_id, timeout))

    # -- snapshots and forks ---------------------------------------------------------------
    @app.post(
        "/sandboxes/{sandbox_id}/snapshots",
        status_code=201,
        responses=INSUFFICIENT_STORAGE,
        response_model=SnapshotInfo,
        response_model_by_alias=True,
        dependencies=authed,
        tags=["snapshots"],
    )
    async def create_snapshot(sandbox_id: str, body: SnapshotRequest | None = None) -> SnapshotInfo:
        """Snapshot a running sandbox, which keeps running. The snapshot's id or name is
        accepted wherever a template is."""
        if body is not None and body.memory is False:
            raise ApiError(400, "memory: filesystem-only snapshots are not supported")
        name = body.name if body else None
        return snapshot_body(await orchestrator.snapshot(sandbox_id, name))

    @app.get(
        "/snapshots",
        response_model=list[SnapshotInfo],
        response_model_by_alias=True,
        dependencies=authed,
        tags=["snapshots"],
    )
    async def list_snapshots(
        response: Response,
        sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
        name: str | None = None,
        limit: Annotated[int | None, Query(ge=1, le=MAX_PAGE_SIZE)] = None,
        next_token: Annotated[str | None, Query(alias="nextToken")] = None,
    ) -> list[SnapshotInfo]:
        views = await orchestrator.list_snapshots(sandbox_id)
        if name:
            views = [v for v in views if name in v.names]
        page = _page(views, _snapshot_page_key, next_token, limit, response)
        return [snapshot_body(v) for v in page]

    @app.get(
        "/snapshots/{snapshot_id:path}",
        response_model=SnapshotInfo,
        response_model_by_alias=True,
        dependencies=authed,
        tags=["snapshots"],
    )
    async def get_snapshot(snapshot_id: str) -> SnapshotInfo:
        return snapshot_body(await orchestrator.get_snapshot(snapshot_id))

    @app.delete(
        "/snapshots/{snapshot_id:path}", status_code=204, dependencies=authed, tags=["snapshots"]
    )
    async def delete_snapshot(snapshot_id: str) -> Response:
        await orchestrator.delete_snapshot(snapshot_id)
        return Response(status_code=204)

    @app.delete(
        "/templates/{template_id:path}", status_code=204, dependencies=authed, tags=["templates"]
    )
    async def delete_template(template_id: str) -> Response:
        """The SDK deletes snapshots through this route (they are templates to E2B)."""
        if template_id == BASE_TEMPLATE or orchestrator.store.get_template(template_id):
            raise ApiError(409, f"template {template_id!r} is built in and cannot be deleted")
        try:
            await orchestrator.delete_snapshot(template_id, type_="template")
        except SnapshotNotFound:
            try:
                await orchestrator.delete_snapshot(template_id)
            except SnapshotNotFound:
                raise ApiError(404, f"template or snapshot {template_id!r} not found") from None
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/fork",
        status_code=201,
        responses=INSUFFICIENT_STORAGE,
        response_model=list[ForkResult],
        response_model_by_alias=True,
        response_model_exclude_none=True,
        dependencies=authed,
        tags=["sandboxes"],
    )
    async def fork_sandbox(sandbox_id: str, body: ForkRequest | None = None) -> list[ForkResult]:
        """Fork a running sandbox into ``count`` children on this node; the parent keeps
        running. One item per child: its sandbox or the error that stopped it."""
        body = body or ForkRequest()
        results = await orchestrator.fork(sandbox_id, body.count, body.timeout)
        out = []
        for result in results:
            if isinstance(result, SandboxView):
                out.append(ForkResult(sandbox=sandbox_body(result)))
            else:
                status = http_status(result)
                out.append(ForkResult(error=ErrorBody(code=status, message=str(result))))
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


V = TypeVar("V")


def _page(
    items: list[V],
    key: Callable[[V], str],
    next_token: str | None,
    limit: int | None,
    response: Response,
) -> list[V]:
    """One page of ``items`` (sorted by ``key``): those after ``next_token``, at most
    ``limit``, with the token of the next page in ``X-Next-Token`` when there is one."""
    if next_token:
        items = [item for item in items if key(item) > next_token]
    if limit is not None and len(items) > limit:
        items = items[:limit]
        response.headers["X-Next-Token"] = key(items[-1])
    return items


def _snapshot_page_key(view: SnapshotView) -> str:
    return view.record.created_at.isoformat() + "|" + view.snapshot_id


def _page_key(view: SandboxView) -> str:
    return view.record.started_at.isoformat() + "|" + view.sandbox_id

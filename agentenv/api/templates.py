"""E2B's template build API: register a build, upload COPY sources, start the build, poll
its status and logs, and resolve a name (``/templates/aliases/{alias}``). Listings and
look-ups are :mod:`agentenv.api.template_listing`, tags :mod:`agentenv.api.template_tags`;
deleting a template is in ``app.py`` (snapshots are deleted through the same route).

Upload links carry a token (an HMAC of the template id and files hash under the node's
API key), because the SDK sends the upload without its API key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.params import Depends

from agentenv.api.errors import ApiError, error_responses
from agentenv.api.models import (
    BuildLogEntry,
    BuildStatusReason,
    TemplateAliasResponse,
    TemplateBuildInfo,
    TemplateBuildRequest,
    TemplateFileUpload,
    TemplateRequestResponse,
)
from agentenv.api.params import BuildRecordId, FilesHash, TemplateRef
from agentenv.api.template_tags import not_snapshots
from agentenv.limits import MAX_PAGE_SIZE, MAX_TOKEN_LENGTH
from agentenv.orchestrator.build_plan import PlanError, parse_build
from agentenv.orchestrator.builds import BuildManager
from agentenv.orchestrator.errors import (
    InvalidRequest,
    SnapshotNotFound,
    TemplateAliasNotFound,
)
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.tags import DEFAULT_TAG, normalize_tags, split_name
from agentenv.orchestrator.templates import BUILTIN_TEMPLATES

LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}
# Where the SDK uploads a COPY step's files: with an upload token instead of the API key,
# and a body as large as the archive (not bound like other requests').
UPLOAD_PATH = r"^/templates/[^/]+/files/[^/]+/upload$"


def template_routes(
    orchestrator: Orchestrator, builds: BuildManager, api_key: str, authed: Sequence[Depends]
) -> APIRouter:
    router = APIRouter(tags=["templates"])

    def upload_token(template_id: str, files_hash: str) -> str:
        message = f"{template_id}:{files_hash}".encode()
        return hmac.new(api_key.encode(), message, hashlib.sha256).hexdigest()

    @router.post(
        "/v3/templates",
        status_code=202,
        response_model=TemplateRequestResponse,
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def request_build(body: TemplateBuildRequest) -> TemplateRequestResponse:
        given = body.name or body.alias
        if not given:
            raise InvalidRequest("name is required")
        # "name:tag" is the name with one more tag; no tag at all is the default tag.
        name, tag = split_name(given)
        tags = normalize_tags(([tag] if tag else []) + (body.tags or [])) or [DEFAULT_TAG]
        # As in E2B, a template's name builds it again (the new build takes the name, or
        # its tags, when it is ready); a snapshot's name is not a template's to take.
        await not_snapshots(
            orchestrator, [name] + [f"{name}:{t}" for t in tags if t != DEFAULT_TAG]
        )
        build = builds.register(name, body.cpu_count, body.memory_mb, tags)
        return TemplateRequestResponse(
            templateID=build.template_id,
            buildID=build.build_id,
            names=[name],
            aliases=[name],
            tags=tags,
        )

    @router.get(
        "/templates/{template_id}/files/{files_hash}",
        status_code=201,
        response_model=TemplateFileUpload,
        response_model_exclude_none=True,
        dependencies=list(authed),
    )
    async def file_upload_link(
        template_id: BuildRecordId, files_hash: FilesHash, request: Request
    ) -> TemplateFileUpload:
        builds.get(template_id)
        path = builds.upload_path(files_hash)
        if path.exists():
            return TemplateFileUpload(present=True)
        url = request.url_for("upload_files", template_id=template_id, files_hash=files_hash)
        token = upload_token(template_id, files_hash)
        return TemplateFileUpload(present=False, url=f"{url}?token={token}")

    @router.put(
        "/templates/{template_id}/files/{files_hash}/upload",
        name="upload_files",
        responses={
            200: {"description": "Uploaded (or already there)"},
            **error_responses(403),
        },
    )
    async def upload_files(
        template_id: BuildRecordId,
        files_hash: FilesHash,
        request: Request,
        token: Annotated[str, Query(max_length=MAX_TOKEN_LENGTH)] = "",
    ) -> Response:
        # Compared as bytes: compare_digest refuses str with non-ASCII characters.
        expected = upload_token(template_id, files_hash).encode()
        if not hmac.compare_digest(token.encode(), expected):
            raise ApiError(403, "bad upload token")
        path = builds.upload_path(files_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(request)}.part")
        try:
            # Chunks are small; a thread hop for each would cost more than the write.
            with open(tmp, "wb") as f:  # noqa: ASYNC230
                async for chunk in request.stream():
                    f.write(chunk)
            # The first upload under a hash stays: another one must not replace an
            # archive a build has checked (builds check an upload against its hash
            # before using it, and remove one that does not match).
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
        return Response(status_code=200)

    @router.post(
        "/v2/templates/{template_id}/builds/{build_id}",
        status_code=202,
        dependencies=list(authed),
    )
    async def start_build(
        template_id: BuildRecordId, build_id: BuildRecordId, request: Request
    ) -> Response:
        build = builds.get(template_id, build_id)
        try:
            body: Any = await request.json()
        except ValueError:
            raise InvalidRequest("the build request is not JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the build request must be an object")
        try:
            plan = parse_build(body)
        except PlanError as exc:
            raise InvalidRequest(str(exc)) from exc
        await builds.start(build, plan)
        return Response(status_code=202)

    @router.get(
        "/templates/{template_id}/builds/{build_id}/status",
        response_model=TemplateBuildInfo,
        response_model_by_alias=True,
        response_model_exclude_none=True,
        dependencies=list(authed),
    )
    async def build_status(
        template_id: BuildRecordId,
        build_id: BuildRecordId,
        logs_offset: Annotated[int, Query(alias="logsOffset", ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 100,
        level: Annotated[str | None, Query(pattern="^(debug|info|warn|error)$")] = None,
    ) -> TemplateBuildInfo:
        """Log entries from ``logsOffset`` on, at most ``limit``: the SDK polls until a
        finished build returns none."""
        build = builds.get(template_id, build_id)
        floor = LEVELS.get(level or "debug", 0)
        entries = [
            _entry(e.timestamp, e.level, e.message, e.step)
            for e in build.logs[logs_offset : logs_offset + limit]
            if LEVELS.get(e.level, 1) >= floor
        ]
        reason = None
        if build.reason is not None:
            reason = BuildStatusReason(
                message=str(build.reason["message"]),
                step=build.reason.get("step"),
                logEntries=[
                    _entry(e.timestamp, e.level, e.message, e.step)
                    for e in build.logs[-20:]
                    if e.level == "error"
                ],
            )
        return TemplateBuildInfo(
            templateID=build.template_id,
            buildID=build.build_id,
            status=build.status,  # type: ignore[arg-type]
            logEntries=entries,
            reason=reason,
        )

    @router.get(
        "/templates/aliases/{alias}",
        response_model=TemplateAliasResponse,
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def resolve_alias(alias: TemplateRef) -> TemplateAliasResponse:
        if alias in BUILTIN_TEMPLATES:
            return TemplateAliasResponse(templateID=alias)
        try:
            view = await orchestrator.get_snapshot(alias, type_="template")
        except SnapshotNotFound:
            # A template whose builds all have tags other than default exists too.
            tags = await orchestrator.tags.listing(alias)
            if not tags:
                raise TemplateAliasNotFound(alias) from None
            latest = max(tags, key=lambda t: t.assigned_at)
            return TemplateAliasResponse(templateID=latest.build_id)
        return TemplateAliasResponse(templateID=view.snapshot_id)

    return router


def _entry(timestamp: datetime, level: str, message: str, step: str | None) -> BuildLogEntry:
    return BuildLogEntry(
        timestamp=timestamp,
        level=level if level in LEVELS else "info",  # type: ignore[arg-type]
        message=message,
        step=step,
    )

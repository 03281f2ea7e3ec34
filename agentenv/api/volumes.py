"""E2B's volume API (``/volumes``, the API key) and volume content API
(``/volumecontent/{id}/...``, the volume's own token as ``Authorization: Bearer``), which
the SDK reaches at ``E2B_VOLUME_API_URL``. What a volume is and who may hold it:
:mod:`agentenv.orchestrator.volumes`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from agentenv.api.errors import ApiError
from agentenv.api.models import (
    NewVolume,
    VolumeAndToken,
    VolumeEntryStat,
    VolumeInfo,
    VolumeMetadataUpdate,
)
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.records import VolumeEntry
from agentenv.storage.volumes import Entry, MountedVolume, VolumePathError, read_chunks

#: Content uploads stream (no body bound).
VOLUME_UPLOAD_PATH = r"^/volumecontent/[^/]+/file$"

VolumePath = Annotated[str, Query(min_length=1, max_length=4096)]
Owner = Annotated[int | None, Query(ge=0, le=0xFFFFFFFE)]
Mode = Annotated[int | None, Query(ge=0, le=0o7777)]
#: The volume's token, ``Authorization: Bearer <token>``.
Auth = Annotated[str | None, Header()]


def _stat(entry: Entry) -> VolumeEntryStat:
    return VolumeEntryStat(**entry.__dict__)


def _with_token(entry: VolumeEntry) -> VolumeAndToken:
    return VolumeAndToken(volumeID=entry.id, name=entry.name, token=entry.token)


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def _path_error(exc: VolumePathError) -> ApiError:
    return ApiError(404 if exc.missing else 400, str(exc))


def volume_routes(orchestrator: Orchestrator, authed: Sequence[Any]) -> APIRouter:
    router = APIRouter(tags=["volumes"])
    volumes = orchestrator.volumes

    # -- volumes -----------------------------------------------------------------------
    @router.post("/volumes", status_code=201, response_model=VolumeAndToken,
                 response_model_by_alias=True, dependencies=list(authed))  # fmt: skip
    async def create_volume(body: NewVolume) -> VolumeAndToken:
        return _with_token(await volumes.create(body.name))

    @router.get("/volumes", response_model=list[VolumeInfo], response_model_by_alias=True,
                dependencies=list(authed))  # fmt: skip
    async def list_volumes() -> list[VolumeInfo]:
        return [VolumeInfo(volumeID=e.id, name=e.name) for e in await volumes.list()]

    @router.get("/volumes/{volume_id}", response_model=VolumeAndToken,
                response_model_by_alias=True, dependencies=list(authed))  # fmt: skip
    async def get_volume(volume_id: str) -> VolumeAndToken:
        return _with_token(await volumes.get(volume_id))

    @router.delete("/volumes/{volume_id}", status_code=204, dependencies=list(authed))
    async def destroy_volume(volume_id: str) -> Response:
        await volumes.destroy(volume_id)
        return Response(status_code=204)

    # -- content -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def files(volume_id: str, authorization: str | None) -> AsyncIterator[MountedVolume]:
        async with volumes.files(volume_id, _bearer(authorization)) as mounted:
            try:
                yield mounted
            except VolumePathError as exc:
                raise _path_error(exc) from exc

    @router.get("/volumecontent/{volume_id}/path", response_model=VolumeEntryStat)
    async def stat_path(volume_id: str, path: VolumePath, authorization: Auth = None) -> Any:
        async with files(volume_id, authorization) as vol:
            return _stat(await asyncio.to_thread(vol.entry, path))

    @router.get("/volumecontent/{volume_id}/dir", response_model=list[VolumeEntryStat])
    async def list_dir(
        volume_id: str,
        path: VolumePath,
        depth: Annotated[int, Query(ge=1, le=64)] = 1,
        authorization: Auth = None,
    ) -> Any:
        async with files(volume_id, authorization) as vol:
            return [_stat(e) for e in await asyncio.to_thread(vol.listing, path, depth)]

    @router.post("/volumecontent/{volume_id}/dir", status_code=201, response_model=VolumeEntryStat)
    async def make_dir(
        volume_id: str,
        path: VolumePath,
        uid: Owner = None,
        gid: Owner = None,
        mode: Mode = None,
        force: bool = False,
        authorization: Auth = None,
    ) -> Any:
        async with files(volume_id, authorization) as vol:
            return _stat(await asyncio.to_thread(vol.make_dir, path, uid, gid, mode, force=force))

    @router.put("/volumecontent/{volume_id}/file", status_code=201, response_model=VolumeEntryStat)
    async def write_file(
        request: Request,
        volume_id: str,
        path: VolumePath,
        uid: Owner = None,
        gid: Owner = None,
        mode: Mode = None,
        force: bool = False,
        authorization: Auth = None,
    ) -> Any:
        async with files(volume_id, authorization) as vol:
            clean, local = await asyncio.to_thread(vol.open_for_write, path, force=force)
            partial = local.with_name(f".{local.name}.{secrets.token_hex(4)}.partial")
            try:
                await _receive(request, partial)
                entry = await asyncio.to_thread(
                    vol.finish_write, clean, local, partial, uid, gid, mode
                )
            finally:
                partial.unlink(missing_ok=True)
            return _stat(entry)

    @router.get("/volumecontent/{volume_id}/file")
    async def read_file(volume_id: str, path: VolumePath, authorization: Auth = None) -> Any:
        stack = contextlib.AsyncExitStack()
        vol = await stack.enter_async_context(files(volume_id, authorization))
        try:
            local = await asyncio.to_thread(vol.read_path, path)
            size = local.stat().st_size
        except VolumePathError as exc:
            await stack.aclose()
            raise _path_error(exc) from exc
        except BaseException:
            await stack.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            async with stack:
                chunks = read_chunks(local)
                while chunk := await asyncio.to_thread(next, chunks, b""):
                    yield chunk

        return StreamingResponse(
            body(),
            media_type="application/octet-stream",
            headers={"Content-Length": str(size)},
        )

    @router.delete("/volumecontent/{volume_id}/path", status_code=204)
    async def remove_path(volume_id: str, path: VolumePath, authorization: Auth = None) -> Response:
        async with files(volume_id, authorization) as vol:
            await asyncio.to_thread(vol.remove, path)
        return Response(status_code=204)

    @router.patch("/volumecontent/{volume_id}/path", response_model=VolumeEntryStat)
    async def update_metadata(
        volume_id: str,
        path: VolumePath,
        body: VolumeMetadataUpdate,
        authorization: Auth = None,
    ) -> Any:
        async with files(volume_id, authorization) as vol:
            entry = await asyncio.to_thread(vol.set_metadata, path, body.uid, body.gid, body.mode)
            return _stat(entry)

    return router


async def _receive(request: Request, partial: Path) -> None:
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(fh.write, chunk)

"""E2B's volume API (``/volumes``, the API key) and volume content API
(``/volumecontent/{id}/...``, the volume's own token as ``Authorization: Bearer``), which
the SDK reaches at ``E2B_VOLUME_API_URL``. What a volume is and who may hold it:
:mod:`agentenv.orchestrator.volumes`; where the content API finds its files (the host's
image, or the guest of the running sandbox that mounts it):
:mod:`agentenv.orchestrator.volume_content`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
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
from agentenv.orchestrator.volume_content import VolumeFiles
from agentenv.storage.volumes import Entry, VolumePathError

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
    async def files(volume_id: str, authorization: str | None) -> AsyncIterator[VolumeFiles]:
        async with volumes.files(volume_id, _bearer(authorization)) as found:
            try:
                yield found
            except VolumePathError as exc:
                raise _path_error(exc) from exc

    @router.get("/volumecontent/{volume_id}/path", response_model=VolumeEntryStat)
    async def stat_path(volume_id: str, path: VolumePath, authorization: Auth = None) -> Any:
        async with files(volume_id, authorization) as vol:
            return _stat(await vol.entry(path))

    @router.get("/volumecontent/{volume_id}/dir", response_model=list[VolumeEntryStat])
    async def list_dir(
        volume_id: str,
        path: VolumePath,
        depth: Annotated[int, Query(ge=1, le=64)] = 1,
        authorization: Auth = None,
    ) -> Any:
        async with files(volume_id, authorization) as vol:
            return [_stat(e) for e in await vol.listing(path, depth)]

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
            return _stat(await vol.make_dir(path, uid, gid, mode, force=force))

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
            return _stat(await vol.write(path, request.stream(), uid, gid, mode, force=force))

    @router.get("/volumecontent/{volume_id}/file")
    async def read_file(volume_id: str, path: VolumePath, authorization: Auth = None) -> Any:
        stack = contextlib.AsyncExitStack()
        vol = await stack.enter_async_context(files(volume_id, authorization))
        try:
            size, chunks = await vol.read(path)
        except VolumePathError as exc:
            await stack.aclose()
            raise _path_error(exc) from exc
        except BaseException:
            await stack.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            async with stack:
                async for chunk in chunks:
                    yield chunk

        return StreamingResponse(
            body(),
            media_type="application/octet-stream",
            headers={} if size is None else {"Content-Length": str(size)},
        )

    @router.delete("/volumecontent/{volume_id}/path", status_code=204)
    async def remove_path(volume_id: str, path: VolumePath, authorization: Auth = None) -> Response:
        async with files(volume_id, authorization) as vol:
            await vol.remove(path)
        return Response(status_code=204)

    @router.patch("/volumecontent/{volume_id}/path", response_model=VolumeEntryStat)
    async def update_metadata(
        volume_id: str,
        path: VolumePath,
        body: VolumeMetadataUpdate,
        authorization: Auth = None,
    ) -> Any:
        async with files(volume_id, authorization) as vol:
            return _stat(await vol.set_metadata(path, body.uid, body.gid, body.mode))

    return router

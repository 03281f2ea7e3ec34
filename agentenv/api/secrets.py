"""The E2B secrets API (``/secrets``): create, update, get, list, delete. Values are
write-only: no answer carries one (the orchestrator's :mod:`~agentenv.orchestrator.secrets`
keeps them encrypted and hands them only to the egress filter)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.params import Depends

from agentenv.api.errors import ApiError
from agentenv.api.models import NewSecret, SecretInfo, SecretUpdate
from agentenv.limits import MAX_PAGE_SIZE
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.records import SecretEntry

_DEFAULT_PAGE = 100
SecretKey = Annotated[str, Path(min_length=1, max_length=256)]


def secret_info(entry: SecretEntry) -> SecretInfo:
    return SecretInfo(
        secretID=entry.id,
        name=entry.name,
        currentVersion=entry.current_version,
        metadata=entry.metadata,
        createdAt=entry.created_at,
        updatedAt=entry.updated_at,
    )


def _encode_token(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")


def _decode_token(token: str) -> str:
    try:
        padded = token + "=" * (-len(token) % 4)
        return base64.b64decode(padded, altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ApiError(400, "nextToken: not a page token of this server") from None


def secret_routes(orchestrator: Orchestrator, authed: Sequence[Depends]) -> APIRouter:
    router = APIRouter(tags=["secrets"], dependencies=list(authed))
    secrets = orchestrator.secrets

    @router.post(
        "/secrets", status_code=201, response_model=SecretInfo, response_model_by_alias=True
    )
    async def create_secret(body: NewSecret) -> SecretInfo:
        """Create a secret and its first version (e2b's ``Secret.create``). 409 if the
        name is taken."""
        return secret_info(await secrets.create(body.name, body.value, body.metadata or {}))

    @router.get("/secrets", response_model=list[SecretInfo], response_model_by_alias=True)
    async def list_secrets(
        response: Response,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = _DEFAULT_PAGE,
        next_token: Annotated[str | None, Query(alias="nextToken", max_length=1024)] = None,
    ) -> list[SecretInfo]:
        """The secrets, by name; ``X-Next-Token`` when there are more."""
        entries = await secrets.list()
        if next_token is not None:
            after = _decode_token(next_token)
            entries = [entry for entry in entries if entry.name > after]
        page = entries[:limit]
        if len(entries) > limit:
            response.headers["X-Next-Token"] = _encode_token(page[-1].name)
        return [secret_info(entry) for entry in page]

    @router.get("/secrets/{secret}", response_model=SecretInfo, response_model_by_alias=True)
    async def get_secret(secret: SecretKey) -> SecretInfo:
        """A secret's metadata, by id or name (404 if there is none)."""
        return secret_info(await secrets.find(secret))

    @router.post("/secrets/{secret}", response_model=SecretInfo, response_model_by_alias=True)
    async def update_secret(secret: SecretKey, body: SecretUpdate) -> SecretInfo:
        """Store a new value as the secret's next version; metadata, when given,
        replaces the old."""
        return secret_info(await secrets.update(secret, body.value, body.metadata))

    @router.delete("/secrets/{secret}", status_code=204)
    async def delete_secret(secret: SecretKey) -> Response:
        """Destroy a secret (404 if there is none); sandboxes whose rules name it stop
        getting its value at once."""
        await secrets.destroy(secret)
        return Response(status_code=204)

    return router

"""Errors at the API's edge: HTTP statuses for the orchestrator's error codes (the API's
one mapping from what failed, :class:`~agentenv.orchestrator.errors.ErrorCode`, to what
E2B clients expect), :class:`ApiError` for refusals the API makes itself, and the
handlers that make every error a JSON ``{code, message}`` body, documented in the
OpenAPI document."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentenv.api.models import ErrorBody
from agentenv.orchestrator.errors import ErrorCode, OrchestratorError

log = logging.getLogger("agentenv.api")

HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INTERNAL: 500,
    ErrorCode.SANDBOX_NOT_FOUND: 404,
    # E2B answers a create naming an unknown template with 400.
    ErrorCode.TEMPLATE_NOT_FOUND: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONFLICT: 409,
    ErrorCode.CAPACITY_EXHAUSTED: 503,
    ErrorCode.TEMPLATE_UNAVAILABLE: 503,
    ErrorCode.SANDBOX_START_FAILED: 500,
    ErrorCode.GUEST_UNAVAILABLE: 502,
    ErrorCode.OPERATION_FAILED: 500,
    ErrorCode.SNAPSHOT_NOT_FOUND: 404,
    ErrorCode.REPOSITORY_UNAVAILABLE: 503,
    ErrorCode.NODE_CACHE_FULL: 507,
    # Below the free-space floor, or a write that found no space.
    ErrorCode.INSUFFICIENT_STORAGE: 507,
    ErrorCode.BUILD_FAILED: 400,
    # The alias lookup route answers 404, unlike a create's unknown template.
    ErrorCode.TEMPLATE_ALIAS_NOT_FOUND: 404,
    # Paused on another node, its commit not landed within the wait: retry later.
    ErrorCode.COMMIT_PENDING: 503,
    ErrorCode.TAG_NOT_FOUND: 404,
    ErrorCode.SECRET_NOT_FOUND: 404,
    ErrorCode.VOLUME_NOT_FOUND: 404,
    # Saved under another VMM/accelerator than this node runs: the request is valid and
    # what it names exists, but cannot be restored in this node's current mode (a node
    # of the saved mode can). 409, not 422: the API answers no 422 (validation is 400
    # and the OpenAPI document lists none), and the conflict is with the node's state.
    ErrorCode.MODE_MISMATCH: 409,
}

_DESCRIPTIONS = {
    400: "Invalid request: a field, parameter or body out of its limits (named), or an "
    "unknown template in a create",
    401: "Missing or wrong API key",
    403: "Bad upload token",
    404: "No such sandbox, snapshot, template, volume or route",
    409: "Conflict with the current state (already paused, name taken, saved under "
    "another VMM or accelerator than the node runs, ...)",
    413: "Request body too large",
    431: "Request headers too large",
    500: "Internal error",
    502: "The sandbox's guest did not answer",
    503: "Repository or capacity unavailable, or a pause on another node not committed "
    "yet; retry later",
    507: "No room on the node: below its free-space floor, a write found none, or cache full",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for ``statuses``: each a JSON :class:`ErrorBody`."""
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS[s]} for s in statuses}


# What any route may answer (403 only the upload route, which adds it).
ERROR_RESPONSES = error_responses(400, 401, 404, 409, 413, 431, 500, 502, 503, 507)


def http_status(exc: BaseException) -> int:
    """The status to answer a request that failed with ``exc``."""
    if isinstance(exc, OrchestratorError):
        return HTTP_STATUS[exc.code]
    return 500


class ApiError(Exception):
    """A refusal the API makes itself (not the orchestrator): ``status`` and a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str, error_code: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": status, "message": message}
    if error_code is not None:
        body["error_code"] = error_code
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error JSON ``{code, message}``: the orchestrator's, the API's own,
    validation (400, not FastAPI's 422), Starlette's (unknown route 404, 405, 413) and
    anything unexpected (500, logged); and the OpenAPI document without the 422s that
    FastAPI lists for every route with parameters but that are never answered."""

    @app.exception_handler(OrchestratorError)
    async def _orchestrator_error(_: Request, exc: OrchestratorError) -> JSONResponse:
        return error_response(http_status(exc), str(exc), exc.code.value)

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

    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for path_item in schema.get("paths", {}).values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

"""HTTP statuses for the orchestrator's error codes: the API's one mapping from what
failed (:class:`~agentenv.orchestrator.errors.ErrorCode`) to what E2B clients expect."""

from __future__ import annotations

from agentenv.orchestrator.errors import ErrorCode, OrchestratorError

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
}


def http_status(exc: BaseException) -> int:
    """The status to answer a request that failed with ``exc``."""
    if isinstance(exc, OrchestratorError):
        return HTTP_STATUS[exc.code]
    return 500

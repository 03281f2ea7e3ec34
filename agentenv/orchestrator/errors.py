"""Errors the orchestrator raises. Each carries a stable :class:`ErrorCode`, which is
what callers match on; HTTP statuses are the API's business (``agentenv.api.errors``
maps codes to them)."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INTERNAL = "internal"
    SANDBOX_NOT_FOUND = "sandbox_not_found"
    TEMPLATE_NOT_FOUND = "template_not_found"
    INVALID_REQUEST = "invalid_request"
    CONFLICT = "conflict"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    TEMPLATE_UNAVAILABLE = "template_unavailable"
    SANDBOX_START_FAILED = "sandbox_start_failed"
    GUEST_UNAVAILABLE = "guest_unavailable"
    OPERATION_FAILED = "operation_failed"
    SNAPSHOT_NOT_FOUND = "snapshot_not_found"
    REPOSITORY_UNAVAILABLE = "repository_unavailable"
    NODE_CACHE_FULL = "node_cache_full"
    INSUFFICIENT_STORAGE = "insufficient_storage"
    BUILD_FAILED = "build_failed"
    TEMPLATE_ALIAS_NOT_FOUND = "template_alias_not_found"
    COMMIT_PENDING = "commit_pending"
    TAG_NOT_FOUND = "tag_not_found"
    SECRET_NOT_FOUND = "secret_not_found"
    VOLUME_NOT_FOUND = "volume_not_found"
    MODE_MISMATCH = "mode_mismatch"


class OrchestratorError(Exception):
    """Base class; ``code`` says what kind of failure it is."""

    code = ErrorCode.INTERNAL


class SandboxNotFound(OrchestratorError):
    code = ErrorCode.SANDBOX_NOT_FOUND

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} not found")
        self.sandbox_id = sandbox_id


class TemplateNotFound(OrchestratorError):
    code = ErrorCode.TEMPLATE_NOT_FOUND

    def __init__(self, template_id: str) -> None:
        super().__init__(f"template {template_id!r} not found")
        self.template_id = template_id


class InvalidRequest(OrchestratorError):
    code = ErrorCode.INVALID_REQUEST


class Conflict(OrchestratorError):
    code = ErrorCode.CONFLICT


class ModeMismatch(OrchestratorError):
    """What a sandbox would be restored from (a template, snapshot or paused sandbox)
    was saved under another VMM or accelerator than this node runs (see
    :mod:`.modes`): nothing was changed, and a node of ``saved``'s mode can restore it.
    Not a :class:`Conflict`, which callers take as "already in that state"."""

    code = ErrorCode.MODE_MISMATCH

    def __init__(self, what: str, saved: str, node: str) -> None:
        super().__init__(
            f"{what} was saved under {saved}; this node runs {node} "
            f"(a node running {saved} can restore it)"
        )
        self.saved = saved
        self.node = node


class CapacityExhausted(OrchestratorError):
    code = ErrorCode.CAPACITY_EXHAUSTED


class TemplateUnavailable(OrchestratorError):
    """The template exists but could not be built or loaded on this node."""

    code = ErrorCode.TEMPLATE_UNAVAILABLE


class SandboxStartFailed(OrchestratorError):
    code = ErrorCode.SANDBOX_START_FAILED


class GuestUnavailable(OrchestratorError):
    """The sandbox exists but its guest agent did not answer."""

    code = ErrorCode.GUEST_UNAVAILABLE


class OperationFailed(OrchestratorError):
    """A lifecycle operation failed; the sandbox is left in the state it was in before."""

    code = ErrorCode.OPERATION_FAILED


class SnapshotNotFound(OrchestratorError):
    code = ErrorCode.SNAPSHOT_NOT_FOUND

    def __init__(self, key: str) -> None:
        super().__init__(f"snapshot {key!r} not found")
        self.key = key


class SecretNotFound(OrchestratorError):
    code = ErrorCode.SECRET_NOT_FOUND

    def __init__(self, key: str) -> None:
        super().__init__(f"secret {key!r} not found")
        self.key = key


class RepositoryUnavailable(OrchestratorError):
    """The snapshot repository could not be read or written."""

    code = ErrorCode.REPOSITORY_UNAVAILABLE


class CommitPending(OrchestratorError):
    """The sandbox was paused on another node whose commit of it has not reached the
    repository within the wait: it may still come (retry), or that node is gone."""

    code = ErrorCode.COMMIT_PENDING

    def __init__(self, sandbox_id: str, node: str, waited: float) -> None:
        super().__init__(
            f"sandbox {sandbox_id} was paused on node {node}, whose commit of it has not "
            f"reached the repository after {waited:.0f} s; retry later (node {node} may be "
            "down: it resumes there, or here once committed)"
        )
        self.sandbox_id = sandbox_id
        self.node = node


class NodeCacheFull(OrchestratorError):
    """What this node must fetch does not fit its cache: everything in it is in use."""

    code = ErrorCode.NODE_CACHE_FULL


class InsufficientStorage(OrchestratorError):
    """There is no room for what an operation would write: this node's data filesystem
    or the repository."""

    code = ErrorCode.INSUFFICIENT_STORAGE


class BelowFreeSpaceFloor(InsufficientStorage):
    """The data directory's filesystem has less free space than its floor
    (``Config.free_space_floor``), so ``operation`` was refused before it started."""

    def __init__(self, operation: str, free_bytes: int, floor_bytes: int) -> None:
        super().__init__(
            f"{operation} refused: the node's data directory has {_mib(free_bytes)} free, "
            f"below its free-space floor of {_mib(floor_bytes)} (free_space_floor)"
        )
        self.operation = operation
        self.free_bytes = free_bytes
        self.floor_bytes = floor_bytes


class OutOfSpace(InsufficientStorage):
    """A write failed for want of space (ENOSPC, EDQUOT, or an object store saying it is
    full); ``where`` says what was being written."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: out of space: {reason}")
        self.where = where


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


class BuildFailed(OrchestratorError):
    code = ErrorCode.BUILD_FAILED


class TemplateAliasNotFound(OrchestratorError):
    """No template has this name (E2B answers 404 here, not the 400 of a create)."""

    code = ErrorCode.TEMPLATE_ALIAS_NOT_FOUND

    def __init__(self, alias: str) -> None:
        super().__init__(f"template {alias!r} not found")


class TagNotFound(OrchestratorError):
    """A template has no such tag (404 on the tag routes, as E2B answers)."""

    code = ErrorCode.TAG_NOT_FOUND


class VolumeNotFound(OrchestratorError):
    """No volume with that id or name (or, on the content API, a wrong volume token)."""

    code = ErrorCode.VOLUME_NOT_FOUND

    def __init__(self, key: str) -> None:
        super().__init__(f"volume {key!r} not found")
        self.key = key

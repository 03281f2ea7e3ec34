"""Errors the orchestrator raises; the API maps each to one HTTP status."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base class. ``status`` is the HTTP status the API answers with."""

    status = 500


class SandboxNotFound(OrchestratorError):
    status = 404

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} not found")
        self.sandbox_id = sandbox_id


class TemplateNotFound(OrchestratorError):
    status = 400

    def __init__(self, template_id: str) -> None:
        super().__init__(f"template {template_id!r} not found")
        self.template_id = template_id


class InvalidRequest(OrchestratorError):
    status = 400


class Conflict(OrchestratorError):
    status = 409


class CapacityExhausted(OrchestratorError):
    status = 503


class TemplateUnavailable(OrchestratorError):
    """The template exists but could not be built or loaded on this node."""

    status = 503


class SandboxStartFailed(OrchestratorError):
    status = 500


class GuestUnavailable(OrchestratorError):
    """The sandbox exists but its guest agent did not answer."""

    status = 502


class OperationFailed(OrchestratorError):
    """A lifecycle operation failed; the sandbox is left in the state it was in before."""

    status = 500


class SnapshotNotFound(OrchestratorError):
    status = 404

    def __init__(self, key: str) -> None:
        super().__init__(f"snapshot {key!r} not found")
        self.key = key


class RepositoryUnavailable(OrchestratorError):
    """The snapshot repository could not be read or written."""

    status = 503


class NodeCacheFull(OrchestratorError):
    """What this node must fetch does not fit its cache: everything in it is in use."""

    status = 507


class BuildFailed(OrchestratorError):
    status = 400


class TemplateAliasNotFound(OrchestratorError):
    """No template has this name (E2B answers 404 here, not the 400 of a create)."""

    status = 404

    def __init__(self, alias: str) -> None:
        super().__init__(f"template {alias!r} not found")

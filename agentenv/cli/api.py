"""The control plane as aenv sees it: ``agentenv.client.AgentEnv``, the one HTTP layer to
the API, with its failures reworded for the command line as ``CliError`` (what failed,
what to do about a rejected key, the documented exit code), and ``e2b`` SDK handles bound
to the same server for what goes to envd (commands, PTYs, files). No HTTP is spoken here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from agentenv.api.models import ForkResult, Health, SandboxDetail, SnapshotInfo, TemplateInfo
from agentenv.api.models import Sandbox as SandboxBody
from agentenv.cli.errors import translate
from agentenv.cli.settings import Settings
from agentenv.client.connection import Connection
from agentenv.client.sync_client import AgentEnv
from agentenv.client.wire import ResumeResult
from agentenv.limits import MAX_PAGE_SIZE

if TYPE_CHECKING:
    from e2b import Sandbox


class ControlPlane:
    """One server, as the settings (or ``aenv auth``'s arguments) name it. With
    ``need_key``, a missing API key is reported before anything is sent."""

    def __init__(self, settings: Settings, *, need_key: bool = True) -> None:
        self.settings = settings
        self.server = settings.server
        api_key = settings.require_api_key() if need_key else settings.api_key
        # The settings have already weighed the environment against the config file; the
        # client must not look further (it would take E2B_API_KEY or E2B_SANDBOX_URL).
        # envd traffic goes through the server's proxy (E2b-Sandbox-Id headers).
        connection = Connection(server=self.server, api_key=api_key, sandbox_url=self.server)
        self.client = AgentEnv(connection=connection)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    @contextlib.contextmanager
    def _reported(self, what: str | None = None) -> Iterator[None]:
        """Failures inside as ``CliError``, the server's message prefixed by ``what``
        failed when given."""
        try:
            yield
        except Exception as exc:
            raise translate(exc, self.server, what) from exc

    # -- node ----------------------------------------------------------------------------
    def health(self) -> Health:
        with self._reported():
            return self.client.health()

    def check_key(self) -> None:
        """Raise ``CliError`` (exit 3) unless the server accepts the key."""
        with self._reported():
            # One sandbox of one page: the cheapest request that needs the key.
            self.client.list_sandboxes_page(limit=1)

    # -- sandboxes -----------------------------------------------------------------------
    def create_sandbox(
        self,
        template: str,
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
    ) -> SandboxBody:
        with self._reported(f"cannot start {template!r}"):
            return self.client.start(template, timeout=timeout, metadata=metadata, envs=envs)

    def list_sandboxes(
        self, *, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> list[SandboxDetail]:
        with self._reported():
            return self.client.list_sandboxes(state=state, metadata=metadata)

    def kill(self, sandbox_id: str) -> None:
        with self._reported():
            self.client.kill(sandbox_id, missing_ok=False)

    def pause(self, sandbox_id: str) -> None:
        with self._reported("cannot pause"):
            self.client.pause(sandbox_id)

    def connect(self, sandbox_id: str, timeout: int | None = None) -> ResumeResult:
        """Connect to a sandbox, resuming it when paused: the sandbox and whether it was
        resumed rather than already running."""
        with self._reported("cannot connect"):
            return self.client.resume(sandbox_id, timeout=timeout)

    def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        with self._reported():
            self.client.set_timeout(sandbox_id, seconds)

    def refresh(self, sandbox_id: str, seconds: int) -> None:
        """Extend the lifetime to at least ``seconds`` from now (never shortens it)."""
        with self._reported():
            self.client.refresh(sandbox_id, seconds)

    def fork(self, sandbox_id: str, count: int, timeout: int | None = None) -> list[ForkResult]:
        with self._reported("cannot fork"):
            return self.client.fork_results(sandbox_id, count, timeout=timeout)

    # -- snapshots and templates -----------------------------------------------------------
    def create_snapshot(self, sandbox_id: str, name: str | None = None) -> SnapshotInfo:
        with self._reported("cannot snapshot"):
            return self.client.snapshot(sandbox_id, name or None)

    def list_snapshots(self, sandbox_id: str | None = None) -> list[SnapshotInfo]:
        with self._reported():
            return list(
                self.client.iter_snapshots(sandbox=sandbox_id or None, page_size=MAX_PAGE_SIZE)
            )

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._reported():
            self.client.delete_snapshot(snapshot_id, missing_ok=False)

    def list_templates(self) -> list[TemplateInfo]:
        with self._reported():
            return self.client.list_templates()

    def delete_template(self, template_id: str) -> None:
        with self._reported("cannot delete"):
            self.client.delete_template(template_id, missing_ok=False)

    # -- envd, through the SDK -------------------------------------------------------------
    def sdk_options(self) -> dict[str, Any]:
        return {
            "api_url": self.server,
            "sandbox_url": self.server,
            "api_key": self.settings.require_api_key(),
            # E2B_DEBUG in the environment would make the SDK skip the control plane.
            "debug": False,
        }

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """An SDK handle on a running sandbox (the caller connected or created it)."""
        with self._reported():
            return self.client.connect(sandbox_id)

"""``AsyncAgentEnv``: the asyncio client, method for method the same as ``AgentEnv``."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from agentenv.api.models import (
    ForkResult,
    Health,
    Lineage,
    SandboxDetail,
    SnapshotInfo,
    TemplateInfo,
)
from agentenv.api.models import Sandbox as SandboxBody
from agentenv.client import wire
from agentenv.client.connection import Connection, SandboxRef, sandbox_id_of
from agentenv.client.errors import (
    AgentEnvError,
    NotFoundError,
    error_from_response,
    error_from_transport,
    translated_sdk_errors,
)
from agentenv.client.wire import (
    ResumeResult,
    SandboxPage,
    SnapshotPage,
    path_part,
    snapshot_id_of,
)
from agentenv.limits import MAX_PAGE_SIZE

if TYPE_CHECKING:
    import e2b

__all__ = ["AsyncAgentEnv"]


class AsyncAgentEnv:
    """An asyncio client for one agentenv server; see ``AgentEnv`` for the configuration.
    Sandboxes come back as ``e2b.AsyncSandbox`` objects. Close it with ``aclose()`` or use
    it as an ``async with`` block."""

    def __init__(
        self,
        server: str | None = None,
        api_key: str | None = None,
        *,
        sandbox_url: str | None = None,
        connection: Connection | None = None,
        http_client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        request_timeout: float | httpx.Timeout = wire.DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        self.connection = connection or Connection.resolve(server, api_key, sandbox_url)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(transport=transport, timeout=request_timeout)

    @functools.cached_property
    def _sdk(self) -> e2b.E2B:
        # Made (and the SDK imported) on first use: the HTTP routes alone do not need it.
        return self.connection.e2b_client()

    # -- lifetime of the client ------------------------------------------------------------
    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncAgentEnv:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        params: dict[str, str | int] | None = None,
    ) -> httpx.Response:
        url = self.connection.server + path
        try:
            response = await self._http.request(
                method, url, json=json, params=params, headers=self.connection.headers()
            )
        except httpx.TransportError as exc:
            raise error_from_transport(exc, url) from exc
        if response.is_error:
            raise error_from_response(response)
        return response

    async def _delete(self, path: str, missing_ok: bool) -> bool:
        try:
            await self._request("DELETE", path)
        except NotFoundError:
            if missing_ok:
                return False
            raise
        return True

    # -- node --------------------------------------------------------------------------------
    async def health(self) -> Health:
        """The node's status: VMM, accelerator, templates, sandbox count. Needs the API
        key: without one a node tells no more than that it is up."""
        wire.require_key(self.connection, "the node's health")
        return wire.decode(wire.HEALTH, await self._request("GET", "/health"))

    # -- sandboxes ---------------------------------------------------------------------------
    async def create(self, template: str = "base", **options: Any) -> e2b.AsyncSandbox:
        """A new sandbox from a template or snapshot, created through the SDK; ``options``
        are ``e2b.AsyncSandbox.create``'s."""
        with translated_sdk_errors(self.connection.server):
            return await self._sdk.AsyncSandbox.create(template=template, **options)

    async def start(
        self,
        template: str = "base",
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
    ) -> SandboxBody:
        body = wire.create_body(template, timeout, metadata, envs)
        return wire.decode(wire.SANDBOX, await self._request("POST", "/v2/sandboxes", json=body))

    async def connect(self, sandbox: SandboxRef, *, timeout: int | None = None) -> e2b.AsyncSandbox:
        """An SDK object for an existing sandbox, resumed if it was paused."""
        with translated_sdk_errors(self.connection.server):
            return await self._sdk.AsyncSandbox.connect(sandbox_id_of(sandbox), timeout=timeout)

    sandbox = connect

    async def resume(self, sandbox: SandboxRef, *, timeout: int | None = None) -> ResumeResult:
        body = {"timeout": timeout} if timeout is not None else {}
        path = f"/v2/sandboxes/{path_part(sandbox_id_of(sandbox))}/connect"
        return wire.resume_result(await self._request("POST", path, json=body))

    async def pause(self, sandbox: SandboxRef) -> None:
        await self._request("POST", f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/pause")

    async def set_timeout(self, sandbox: SandboxRef, seconds: int) -> None:
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/timeout"
        await self._request("POST", path, json={"timeout": seconds})

    async def refresh(self, sandbox: SandboxRef, seconds: int) -> None:
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/refreshes"
        await self._request("POST", path, json=wire.refresh_body(seconds))

    async def update_network(
        self,
        sandbox: SandboxRef,
        *,
        allow_out: Sequence[str] | None = None,
        deny_out: Sequence[str] | None = None,
        dns_servers: Sequence[str] | None = None,
        allow_internet_access: bool | None = None,
    ) -> None:
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/network"
        body = wire.network_update_body(allow_out, deny_out, dns_servers, allow_internet_access)
        await self._request("PUT", path, json=body)

    async def get(self, sandbox: SandboxRef) -> SandboxDetail:
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}"
        return wire.decode(wire.SANDBOX_DETAIL, await self._request("GET", path))

    async def list_sandboxes_page(
        self,
        *,
        state: str | None = None,
        metadata: Mapping[str, str] | None = None,
        limit: int | None = None,
        next_token: str | None = None,
        order: str | None = None,
    ) -> SandboxPage:
        query = wire.sandbox_query(state, metadata, limit, next_token, order)
        return wire.sandbox_page(await self._request("GET", "/v2/sandboxes", params=query))

    def iter_sandboxes(
        self,
        *,
        state: str | None = None,
        metadata: Mapping[str, str] | None = None,
        page_size: int = MAX_PAGE_SIZE,
    ) -> AsyncIterator[SandboxDetail]:
        return wire.walk_pages_async(
            lambda token: self.list_sandboxes_page(
                state=state, metadata=metadata, limit=page_size, next_token=token, order="asc"
            )
        )

    async def list_sandboxes(
        self, *, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> list[SandboxDetail]:
        return [s async for s in self.iter_sandboxes(state=state, metadata=metadata)]

    async def lineage(self, sandbox: SandboxRef) -> Lineage:
        return wire.lineage_of(await self.get(sandbox))

    async def kill(self, sandbox: SandboxRef, *, missing_ok: bool = True) -> bool:
        """Kill the sandbox: ``True``, or ``False`` when there was no such sandbox (a
        ``NotFoundError`` unless ``missing_ok``)."""
        return await self._delete(f"/sandboxes/{path_part(sandbox_id_of(sandbox))}", missing_ok)

    async def fork_results(
        self, sandbox: SandboxRef, count: int = 1, *, timeout: int | None = None
    ) -> list[ForkResult]:
        response = await self._request(
            "POST",
            f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/fork",
            json=wire.fork_body(count, timeout),
        )
        return wire.decode(wire.FORK_RESULTS, response)

    async def fork(
        self, sandbox: SandboxRef, count: int = 1, *, timeout: int | None = None
    ) -> list[e2b.AsyncSandbox | AgentEnvError]:
        """Like ``AgentEnv.fork``, with ``e2b.AsyncSandbox`` children."""
        results = await self.fork_results(sandbox, count, timeout=timeout)
        return wire.fork_children(results, self.connection, self._sdk.AsyncSandbox)

    # -- snapshots ---------------------------------------------------------------------------
    async def snapshot(self, sandbox: SandboxRef, name: str | None = None) -> SnapshotInfo:
        body = {"name": name} if name is not None else {}
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/snapshots"
        return wire.decode(wire.SNAPSHOT, await self._request("POST", path, json=body))

    async def list_snapshots(
        self,
        *,
        sandbox: SandboxRef | None = None,
        name: str | None = None,
        limit: int | None = None,
        next_token: str | None = None,
    ) -> SnapshotPage:
        sandbox_id = sandbox_id_of(sandbox) if sandbox is not None else None
        query = wire.snapshot_query(sandbox_id, name, limit, next_token)
        return wire.snapshot_page(await self._request("GET", "/snapshots", params=query))

    def iter_snapshots(
        self, *, sandbox: SandboxRef | None = None, name: str | None = None, page_size: int = 100
    ) -> AsyncIterator[SnapshotInfo]:
        """Every matching snapshot, newest first, fetching pages of ``page_size``."""
        return wire.walk_pages_async(
            lambda token: self.list_snapshots(
                sandbox=sandbox, name=name, limit=page_size, next_token=token
            )
        )

    async def get_snapshot(self, snapshot: str | SnapshotInfo) -> SnapshotInfo:
        path = f"/snapshots/{path_part(snapshot_id_of(snapshot))}"
        return wire.decode(wire.SNAPSHOT, await self._request("GET", path))

    async def delete_snapshot(
        self, snapshot: str | SnapshotInfo, *, missing_ok: bool = True
    ) -> bool:
        return await self._delete(f"/snapshots/{path_part(snapshot_id_of(snapshot))}", missing_ok)

    # -- templates ---------------------------------------------------------------------------
    async def list_templates(self) -> list[TemplateInfo]:
        return wire.decode(wire.TEMPLATES, await self._request("GET", "/templates"))

    async def delete_template(self, template: str, *, missing_ok: bool = True) -> bool:
        return await self._delete(f"/templates/{path_part(template)}", missing_ok)

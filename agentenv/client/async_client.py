"""``AsyncAgentEnv``: the asyncio client, method for method the same as ``AgentEnv``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import e2b
import httpx

from agentenv.api.models import Health, Lineage, SandboxDetail, SnapshotInfo
from agentenv.client import wire
from agentenv.client.connection import Connection, SandboxRef, sandbox_id_of
from agentenv.client.errors import (
    AgentEnvError,
    NotFoundError,
    error_from_response,
    error_from_transport,
    translated_sdk_errors,
)
from agentenv.client.wire import SnapshotPage, path_part, snapshot_id_of

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
        http_client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        request_timeout: float | httpx.Timeout = wire.DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        self.connection = Connection.resolve(server, api_key, sandbox_url)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(transport=transport, timeout=request_timeout)
        self._sdk = self.connection.e2b_client()

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

    # -- node --------------------------------------------------------------------------------
    async def health(self) -> Health:
        """The node's status: VMM, accelerator, templates, sandbox count (no key needed)."""
        return wire.decode(wire.HEALTH, await self._request("GET", "/health"))

    # -- sandboxes ---------------------------------------------------------------------------
    async def create(self, template: str = "base", **options: Any) -> e2b.AsyncSandbox:
        """A new sandbox from a template or snapshot, created through the SDK; ``options``
        are ``e2b.AsyncSandbox.create``'s."""
        with translated_sdk_errors(self.connection.server):
            return await self._sdk.AsyncSandbox.create(template=template, **options)

    async def connect(self, sandbox: SandboxRef, *, timeout: int | None = None) -> e2b.AsyncSandbox:
        """An SDK object for an existing sandbox, resumed if it was paused."""
        with translated_sdk_errors(self.connection.server):
            return await self._sdk.AsyncSandbox.connect(sandbox_id_of(sandbox), timeout=timeout)

    sandbox = connect

    async def get(self, sandbox: SandboxRef) -> SandboxDetail:
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}"
        return wire.decode(wire.SANDBOX_DETAIL, await self._request("GET", path))

    async def list_sandboxes(self) -> list[SandboxDetail]:
        return wire.decode(wire.SANDBOX_DETAILS, await self._request("GET", "/sandboxes"))

    async def lineage(self, sandbox: SandboxRef) -> Lineage:
        return wire.lineage_of(await self.get(sandbox))

    async def kill(self, sandbox: SandboxRef) -> bool:
        """Kill the sandbox: ``True``, or ``False`` when there was no such sandbox."""
        try:
            await self._request("DELETE", f"/sandboxes/{path_part(sandbox_id_of(sandbox))}")
        except NotFoundError:
            return False
        return True

    async def fork(
        self, sandbox: SandboxRef, count: int = 1, *, timeout: int | None = None
    ) -> list[e2b.AsyncSandbox | AgentEnvError]:
        """Like ``AgentEnv.fork``, with ``e2b.AsyncSandbox`` children."""
        response = await self._request(
            "POST",
            f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/fork",
            json=wire.fork_body(count, timeout),
        )
        return wire.fork_children(response, self.connection, self._sdk.AsyncSandbox)

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

    async def iter_snapshots(
        self, *, sandbox: SandboxRef | None = None, name: str | None = None, page_size: int = 100
    ) -> AsyncIterator[SnapshotInfo]:
        token: str | None = None
        while True:
            page = await self.list_snapshots(
                sandbox=sandbox, name=name, limit=page_size, next_token=token
            )
            for item in page.items:
                yield item
            if page.next_token is None:
                return
            token = page.next_token

    async def get_snapshot(self, snapshot: str | SnapshotInfo) -> SnapshotInfo:
        path = f"/snapshots/{path_part(snapshot_id_of(snapshot))}"
        return wire.decode(wire.SNAPSHOT, await self._request("GET", path))

    async def delete_snapshot(self, snapshot: str | SnapshotInfo) -> bool:
        try:
            await self._request("DELETE", f"/snapshots/{path_part(snapshot_id_of(snapshot))}")
        except NotFoundError:
            return False
        return True

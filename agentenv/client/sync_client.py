"""``AgentEnv``: the blocking client."""

from __future__ import annotations

from collections.abc import Iterator
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

__all__ = ["AgentEnv"]


class AgentEnv:
    """A blocking client for one agentenv server.

    ``server``, ``api_key`` and ``sandbox_url`` default to ``AENV_SERVER`` (or
    ``E2B_API_URL``), ``AENV_API_KEY`` (or ``E2B_API_KEY``) and ``E2B_SANDBOX_URL`` (or the
    server URL). Pass ``http_client`` to use your own ``httpx.Client`` (it is not closed
    here), or ``transport`` to swap the one a new client gets. Sandboxes come back as
    ``e2b.Sandbox`` objects bound to the same server; every method that takes a sandbox
    accepts its id or such an object. Failures raise ``AgentEnvError`` subclasses (what
    the returned SDK objects do themselves raises the SDK's exceptions).
    """

    def __init__(
        self,
        server: str | None = None,
        api_key: str | None = None,
        *,
        sandbox_url: str | None = None,
        http_client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        request_timeout: float | httpx.Timeout = wire.DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        self.connection = Connection.resolve(server, api_key, sandbox_url)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(transport=transport, timeout=request_timeout)
        self._sdk = self.connection.e2b_client()

    # -- lifetime of the client ------------------------------------------------------------
    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> AgentEnv:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        params: dict[str, str | int] | None = None,
    ) -> httpx.Response:
        url = self.connection.server + path
        try:
            response = self._http.request(
                method, url, json=json, params=params, headers=self.connection.headers()
            )
        except httpx.TransportError as exc:
            raise error_from_transport(exc, url) from exc
        if response.is_error:
            raise error_from_response(response)
        return response

    # -- node --------------------------------------------------------------------------------
    def health(self) -> Health:
        """The node's status: VMM, accelerator, templates, sandbox count (no key needed)."""
        return wire.decode(wire.HEALTH, self._request("GET", "/health"))

    # -- sandboxes ---------------------------------------------------------------------------
    def create(self, template: str = "base", **options: Any) -> e2b.Sandbox:
        """A new sandbox from a template or snapshot (id or name), created through the SDK;
        ``options`` are ``e2b.Sandbox.create``'s (``timeout``, ``metadata``, ``envs``, ...)."""
        with translated_sdk_errors(self.connection.server):
            return self._sdk.Sandbox.create(template=template, **options)

    def connect(self, sandbox: SandboxRef, *, timeout: int | None = None) -> e2b.Sandbox:
        """An SDK object for an existing sandbox, resumed if it was paused. ``timeout`` only
        ever extends its lifetime."""
        with translated_sdk_errors(self.connection.server):
            return self._sdk.Sandbox.connect(sandbox_id_of(sandbox), timeout=timeout)

    sandbox = connect

    def get(self, sandbox: SandboxRef) -> SandboxDetail:
        """The sandbox's detail: state, lifetime, resources, lineage."""
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}"
        return wire.decode(wire.SANDBOX_DETAIL, self._request("GET", path))

    def list_sandboxes(self) -> list[SandboxDetail]:
        return wire.decode(wire.SANDBOX_DETAILS, self._request("GET", "/sandboxes"))

    def lineage(self, sandbox: SandboxRef) -> Lineage:
        """Where the sandbox comes from (parent, template or snapshot) and its live children."""
        return wire.lineage_of(self.get(sandbox))

    def kill(self, sandbox: SandboxRef) -> bool:
        """Kill the sandbox: ``True``, or ``False`` when there was no such sandbox."""
        try:
            self._request("DELETE", f"/sandboxes/{path_part(sandbox_id_of(sandbox))}")
        except NotFoundError:
            return False
        return True

    def fork(
        self, sandbox: SandboxRef, count: int = 1, *, timeout: int | None = None
    ) -> list[e2b.Sandbox | AgentEnvError]:
        """Fork a running sandbox into ``count`` (1..20) children sharing its memory and
        files; the parent keeps running. One entry per child, in order: a ready
        ``e2b.Sandbox``, or the ``AgentEnvError`` that kept it from starting. ``timeout``
        is the children's lifetime in seconds (the server's default when ``None``)."""
        response = self._request(
            "POST",
            f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/fork",
            json=wire.fork_body(count, timeout),
        )
        return wire.fork_children(response, self.connection, self._sdk.Sandbox)

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot(self, sandbox: SandboxRef, name: str | None = None) -> SnapshotInfo:
        """A persistent snapshot of a running sandbox, which keeps running. Its id (or
        ``name``) can be given to ``create`` in place of a template."""
        body = {"name": name} if name is not None else {}
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/snapshots"
        return wire.decode(wire.SNAPSHOT, self._request("POST", path, json=body))

    def list_snapshots(
        self,
        *,
        sandbox: SandboxRef | None = None,
        name: str | None = None,
        limit: int | None = None,
        next_token: str | None = None,
    ) -> SnapshotPage:
        """One page of snapshots, optionally only those of ``sandbox`` or with ``name``."""
        sandbox_id = sandbox_id_of(sandbox) if sandbox is not None else None
        query = wire.snapshot_query(sandbox_id, name, limit, next_token)
        return wire.snapshot_page(self._request("GET", "/snapshots", params=query))

    def iter_snapshots(
        self, *, sandbox: SandboxRef | None = None, name: str | None = None, page_size: int = 100
    ) -> Iterator[SnapshotInfo]:
        """Every matching snapshot, fetching pages of ``page_size`` as it goes."""
        token: str | None = None
        while True:
            page = self.list_snapshots(
                sandbox=sandbox, name=name, limit=page_size, next_token=token
            )
            yield from page.items
            if page.next_token is None:
                return
            token = page.next_token

    def get_snapshot(self, snapshot: str | SnapshotInfo) -> SnapshotInfo:
        path = f"/snapshots/{path_part(snapshot_id_of(snapshot))}"
        return wire.decode(wire.SNAPSHOT, self._request("GET", path))

    def delete_snapshot(self, snapshot: str | SnapshotInfo) -> bool:
        """Delete a snapshot (its files go once no sandbox uses them): ``True``, or
        ``False`` when there was no such snapshot."""
        try:
            self._request("DELETE", f"/snapshots/{path_part(snapshot_id_of(snapshot))}")
        except NotFoundError:
            return False
        return True

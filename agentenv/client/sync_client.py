"""``AgentEnv``: the blocking client."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
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

__all__ = ["AgentEnv"]


class AgentEnv:
    """A blocking client for one agentenv server.

    ``server``, ``api_key`` and ``sandbox_url`` default to ``AENV_SERVER`` (or
    ``E2B_API_URL``), ``AENV_API_KEY`` (or ``E2B_API_KEY``) and ``E2B_SANDBOX_URL`` (or the
    server URL); pass a ``connection`` instead to read nothing from the environment. Pass
    ``http_client`` to use your own ``httpx.Client`` (it is not closed here), or
    ``transport`` to swap the one a new client gets. Sandboxes come back as
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
        connection: Connection | None = None,
        http_client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        request_timeout: float | httpx.Timeout = wire.DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        self.connection = connection or Connection.resolve(server, api_key, sandbox_url)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(transport=transport, timeout=request_timeout)

    @functools.cached_property
    def _sdk(self) -> e2b.E2B:
        # Made (and the SDK imported) on first use: the HTTP routes alone do not need it.
        return self.connection.e2b_client()

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

    def _delete(self, path: str, missing_ok: bool) -> bool:
        try:
            self._request("DELETE", path)
        except NotFoundError:
            if missing_ok:
                return False
            raise
        return True

    # -- node --------------------------------------------------------------------------------
    def health(self) -> Health:
        """The node's status: VMM, accelerator, templates, sandbox count. Needs the API
        key: without one a node tells no more than that it is up."""
        wire.require_key(self.connection, "the node's health")
        return wire.decode(wire.HEALTH, self._request("GET", "/health"))

    # -- sandboxes ---------------------------------------------------------------------------
    def create(self, template: str = "base", **options: Any) -> e2b.Sandbox:
        """A new sandbox from a template or snapshot (id or name), created through the SDK;
        ``options`` are ``e2b.Sandbox.create``'s (``timeout``, ``metadata``, ``envs``, ...)."""
        with translated_sdk_errors(self.connection.server):
            return self._sdk.Sandbox.create(template=template, **options)

    def start(
        self,
        template: str = "base",
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
    ) -> SandboxBody:
        """Like ``create``, but the server's answer (id, envd version, access token) rather
        than an SDK object, so that nothing but the HTTP route is needed."""
        body = wire.create_body(template, timeout, metadata, envs)
        # v2 creates are secured: envd traffic needs the returned envdAccessToken.
        return wire.decode(wire.SANDBOX, self._request("POST", "/v2/sandboxes", json=body))

    def connect(self, sandbox: SandboxRef, *, timeout: int | None = None) -> e2b.Sandbox:
        """An SDK object for an existing sandbox, resumed if it was paused. ``timeout`` only
        ever extends its lifetime."""
        with translated_sdk_errors(self.connection.server):
            return self._sdk.Sandbox.connect(sandbox_id_of(sandbox), timeout=timeout)

    sandbox = connect

    def resume(self, sandbox: SandboxRef, *, timeout: int | None = None) -> ResumeResult:
        """Make sure the sandbox runs, resuming it if it was paused, as ``connect`` does,
        but answer with the server's view and whether it had to resume. ``timeout`` only
        ever extends its lifetime."""
        body = {"timeout": timeout} if timeout is not None else {}
        path = f"/v2/sandboxes/{path_part(sandbox_id_of(sandbox))}/connect"
        return wire.resume_result(self._request("POST", path, json=body))

    def pause(self, sandbox: SandboxRef) -> None:
        """Pause the sandbox, memory and disk kept; ``resume`` or ``connect`` wake it."""
        self._request("POST", f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/pause")

    def set_timeout(self, sandbox: SandboxRef, seconds: int) -> None:
        """Kill the sandbox ``seconds`` from now (sooner or later than it would have been)."""
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/timeout"
        self._request("POST", path, json={"timeout": seconds})

    def refresh(self, sandbox: SandboxRef, seconds: int) -> None:
        """Keep the sandbox alive at least ``seconds`` from now; never shortens its life."""
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/refreshes"
        self._request("POST", path, json=wire.refresh_body(seconds))

    def update_network(
        self,
        sandbox: SandboxRef,
        *,
        allow_out: Sequence[str] | None = None,
        deny_out: Sequence[str] | None = None,
        dns_servers: Sequence[str] | None = None,
        allow_internet_access: bool | None = None,
    ) -> None:
        """Replace a running sandbox's egress rules (e2b's ``Sandbox.update_network``):
        what is left out goes back to the default (internet allowed, no lists)."""
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/network"
        body = wire.network_update_body(allow_out, deny_out, dns_servers, allow_internet_access)
        self._request("PUT", path, json=body)

    def get(self, sandbox: SandboxRef) -> SandboxDetail:
        """The sandbox's detail: state, lifetime, resources, lineage."""
        path = f"/sandboxes/{path_part(sandbox_id_of(sandbox))}"
        return wire.decode(wire.SANDBOX_DETAIL, self._request("GET", path))

    def list_sandboxes_page(
        self,
        *,
        state: str | None = None,
        metadata: Mapping[str, str] | None = None,
        limit: int | None = None,
        next_token: str | None = None,
        order: str | None = None,
    ) -> SandboxPage:
        """One page of sandboxes, optionally only those in ``state`` (``running`` or
        ``paused``) whose metadata hold every pair of ``metadata``, in ``order`` (``asc``
        or ``desc`` by start time; the server's default is ``desc``, as E2B's)."""
        query = wire.sandbox_query(state, metadata, limit, next_token, order)
        return wire.sandbox_page(self._request("GET", "/v2/sandboxes", params=query))

    def iter_sandboxes(
        self,
        *,
        state: str | None = None,
        metadata: Mapping[str, str] | None = None,
        page_size: int = MAX_PAGE_SIZE,
    ) -> Iterator[SandboxDetail]:
        """Every matching sandbox, oldest first, fetching pages of ``page_size`` as it goes."""
        return wire.walk_pages(
            lambda token: self.list_sandboxes_page(
                state=state, metadata=metadata, limit=page_size, next_token=token, order="asc"
            )
        )

    def list_sandboxes(
        self, *, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> list[SandboxDetail]:
        """Every sandbox, or those matching ``state`` and ``metadata`` (see
        ``list_sandboxes_page``), oldest first."""
        return list(self.iter_sandboxes(state=state, metadata=metadata))

    def lineage(self, sandbox: SandboxRef) -> Lineage:
        """Where the sandbox comes from (parent, template or snapshot) and its live children."""
        return wire.lineage_of(self.get(sandbox))

    def kill(self, sandbox: SandboxRef, *, missing_ok: bool = True) -> bool:
        """Kill the sandbox: ``True``, or ``False`` when there was no such sandbox (a
        ``NotFoundError`` unless ``missing_ok``)."""
        return self._delete(f"/sandboxes/{path_part(sandbox_id_of(sandbox))}", missing_ok)

    def fork_results(
        self, sandbox: SandboxRef, count: int = 1, *, timeout: int | None = None
    ) -> list[ForkResult]:
        """``fork`` as the server answers it: per child, its sandbox or its error."""
        response = self._request(
            "POST",
            f"/sandboxes/{path_part(sandbox_id_of(sandbox))}/fork",
            json=wire.fork_body(count, timeout),
        )
        return wire.decode(wire.FORK_RESULTS, response)

    def fork(
        self, sandbox: SandboxRef, count: int = 1, *, timeout: int | None = None
    ) -> list[e2b.Sandbox | AgentEnvError]:
        """Fork a running sandbox into ``count`` children (1 to
        ``agentenv.limits.MAX_FORK_CHILDREN``) sharing its memory and files; the parent
        keeps running. One entry per child, in order: a ready ``e2b.Sandbox``, or the
        ``AgentEnvError`` that kept it from starting. ``timeout`` is the children's
        lifetime in seconds (the server's default when ``None``)."""
        results = self.fork_results(sandbox, count, timeout=timeout)
        return wire.fork_children(results, self.connection, self._sdk.Sandbox)

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
        """Every matching snapshot, newest first, fetching pages of ``page_size`` as it goes."""
        return wire.walk_pages(
            lambda token: self.list_snapshots(
                sandbox=sandbox, name=name, limit=page_size, next_token=token
            )
        )

    def get_snapshot(self, snapshot: str | SnapshotInfo) -> SnapshotInfo:
        path = f"/snapshots/{path_part(snapshot_id_of(snapshot))}"
        return wire.decode(wire.SNAPSHOT, self._request("GET", path))

    def delete_snapshot(self, snapshot: str | SnapshotInfo, *, missing_ok: bool = True) -> bool:
        """Delete a snapshot (its files go once no sandbox uses them): ``True``, or
        ``False`` when there was no such snapshot (a ``NotFoundError`` unless
        ``missing_ok``)."""
        return self._delete(f"/snapshots/{path_part(snapshot_id_of(snapshot))}", missing_ok)

    # -- templates ---------------------------------------------------------------------------
    def list_templates(self) -> list[TemplateInfo]:
        """The templates: the built-in one once built, and those built from images and
        Dockerfiles (with their build state). ``health().templates`` has the built-in one
        while it is still building. (The v1 listing: it has no pages, unlike
        ``/v2/templates``.)"""
        return wire.decode(wire.TEMPLATES, self._request("GET", "/templates"))

    def delete_template(self, template: str, *, missing_ok: bool = True) -> bool:
        """Delete a template or snapshot by id or name: ``True``, or ``False`` when there
        was none (a ``NotFoundError`` unless ``missing_ok``). Built-in templates cannot be
        deleted (``ConflictError``)."""
        return self._delete(f"/templates/{path_part(template)}", missing_ok)

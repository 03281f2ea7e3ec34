"""The control plane as aenv sees it: one method per HTTP route it uses (httpx), and an
``e2b`` SDK ``Sandbox`` bound to the same server for what goes to envd (commands, PTYs,
files). HTTP errors become ``CliError`` with the server's message."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import httpx

from agentenv.cli.errors import CliError, exit_code_for_status, translate
from agentenv.cli.settings import Settings

if TYPE_CHECKING:
    from e2b import Sandbox

JsonObject = dict[str, Any]

# Pauses, snapshots and forks of many children take seconds under TCG; connecting must
# fail fast so an unreachable server is reported promptly.
REQUEST_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
LIST_PAGE_SIZE = 1000


class ControlPlane:
    def __init__(self, settings: Settings, *, need_key: bool = True) -> None:
        self.settings = settings
        self.server = settings.server
        headers = {"User-Agent": "aenv"}
        if need_key:
            headers["X-API-Key"] = settings.require_api_key()
        elif settings.api_key:
            headers["X-API-Key"] = settings.api_key
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=REQUEST_TIMEOUT)

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
        self._http.close()

    # -- plumbing ------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        params: Mapping[str, str | int] | None = None,
        what: str | None = None,
    ) -> httpx.Response:
        """Send a request; a non-2xx answer raises ``CliError`` with the server's message
        (prefixed by ``what`` failed, when given)."""
        try:
            response = self._http.request(method, path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise translate(exc, self.server) from exc
        if response.is_success:
            return response
        message = _error_message(response)
        if response.status_code == 401:
            message = (
                f"the server at {self.server} rejected the API key ({message}); run `aenv auth`"
            )
        elif what:
            message = f"{what}: {message}"
        raise CliError(message, exit_code_for_status(response.status_code))

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise CliError(
                f"{self.server} answered {response.request.url.path} with something that "
                "is not JSON; is AENV_SERVER an agentenv server?"
            ) from exc

    # -- node ----------------------------------------------------------------------------
    def health(self) -> JsonObject:
        body = self._json(self.request("GET", "/health"))
        if not isinstance(body, dict) or "templates" not in body:
            raise CliError(f"{self.server} does not look like an agentenv server (/health)")
        return body

    def check_key(self) -> None:
        """Raise ``CliError`` (exit 3) unless the server accepts the key."""
        self.request("GET", "/v2/sandboxes", params={"limit": 1})

    # -- sandboxes -----------------------------------------------------------------------
    def create_sandbox(
        self,
        template: str,
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
    ) -> JsonObject:
        body: JsonObject = {
            "templateID": template,
            "metadata": dict(metadata or {}),
            "envVars": dict(envs or {}),
        }
        if timeout is not None:
            body["timeout"] = timeout
        # v2 creates are secured: envd traffic needs the returned envdAccessToken, which
        # the SDK picks up when it connects.
        response = self.request(
            "POST", "/v2/sandboxes", json=body, what=f"cannot start {template!r}"
        )
        created: JsonObject = self._json(response)
        return created

    def list_sandboxes(
        self, *, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> list[JsonObject]:
        params: dict[str, str | int] = {"limit": LIST_PAGE_SIZE}
        if state:
            params["state"] = state
        if metadata:
            # Quoted, then encoded once more (as the SDK does): the server unquotes
            # each key and value after parsing the query string.
            params["metadata"] = urllib.parse.urlencode(
                {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in metadata.items()}
            )
        return self._all_pages("/v2/sandboxes", params)

    def _all_pages(self, path: str, params: dict[str, str | int]) -> list[JsonObject]:
        """Every item of a paged listing, following ``X-Next-Token``."""
        items: list[JsonObject] = []
        while True:
            response = self.request("GET", path, params=params)
            items.extend(self._json(response))
            next_token = response.headers.get("X-Next-Token")
            if not next_token:
                return items
            params = {**params, "nextToken": next_token}

    def get_sandbox(self, sandbox_id: str) -> JsonObject:
        detail: JsonObject = self._json(self.request("GET", f"/sandboxes/{_seg(sandbox_id)}"))
        return detail

    def kill(self, sandbox_id: str) -> None:
        self.request("DELETE", f"/sandboxes/{_seg(sandbox_id)}")

    def pause(self, sandbox_id: str) -> None:
        self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/pause", what="cannot pause")

    def connect(self, sandbox_id: str, timeout: int | None = None) -> tuple[JsonObject, bool]:
        """Connect to a sandbox, resuming it when paused: the sandbox and whether it was
        resumed (201) rather than already running (200)."""
        body = {"timeout": timeout} if timeout is not None else {}
        response = self.request(
            "POST", f"/v2/sandboxes/{_seg(sandbox_id)}/connect", json=body, what="cannot connect"
        )
        connected: JsonObject = self._json(response)
        return connected, response.status_code == 201

    def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/timeout", json={"timeout": seconds})

    def refresh(self, sandbox_id: str, seconds: int) -> None:
        """Extend the lifetime to at least ``seconds`` from now (never shortens it)."""
        self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/refreshes", json={"duration": seconds})

    def fork(self, sandbox_id: str, count: int, timeout: int | None = None) -> list[JsonObject]:
        body: JsonObject = {"count": count}
        if timeout is not None:
            body["timeout"] = timeout
        response = self.request(
            "POST", f"/sandboxes/{_seg(sandbox_id)}/fork", json=body, what="cannot fork"
        )
        children: list[JsonObject] = self._json(response)
        return children

    # -- snapshots and templates -----------------------------------------------------------
    def create_snapshot(self, sandbox_id: str, name: str | None = None) -> JsonObject:
        body = {"name": name} if name else {}
        response = self.request(
            "POST",
            f"/sandboxes/{_seg(sandbox_id)}/snapshots",
            json=body,
            what="cannot snapshot",
        )
        snapshot: JsonObject = self._json(response)
        return snapshot

    def list_snapshots(self, sandbox_id: str | None = None) -> list[JsonObject]:
        params: dict[str, str | int] = {"limit": LIST_PAGE_SIZE}
        if sandbox_id:
            params["sandboxID"] = sandbox_id
        return self._all_pages("/snapshots", params)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.request("DELETE", f"/snapshots/{_seg(snapshot_id)}")

    def list_templates(self) -> list[JsonObject]:
        templates: list[JsonObject] = self._json(self.request("GET", "/v2/templates"))
        return templates

    def delete_template(self, template_id: str) -> None:
        self.request("DELETE", f"/templates/{_seg(template_id)}", what="cannot delete")

    # -- envd, through the SDK -------------------------------------------------------------
    def sdk_options(self) -> dict[str, Any]:
        return {
            "api_url": self.server,
            # envd traffic goes through the server's proxy (E2b-Sandbox-Id headers).
            "sandbox_url": self.server,
            "api_key": self.settings.require_api_key(),
            # E2B_DEBUG in the environment would make the SDK skip the control plane.
            "debug": False,
        }

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """An SDK handle on a running sandbox (the caller connected or created it)."""
        from e2b import Sandbox  # slow to import; only envd work needs it

        try:
            return Sandbox.connect(sandbox_id, **self.sdk_options())
        except Exception as exc:
            raise translate(exc, self.server) from exc


def _seg(value: str) -> str:
    """``value`` as one URL path segment (ids are safe; names may hold ``/`` or ``:``)."""
    return urllib.parse.quote(value, safe="")


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    text = response.text.strip()
    return f"HTTP {response.status_code}" + (f": {text[:200]}" if text else "")

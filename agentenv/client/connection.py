"""Where the server is and how to authenticate, resolved from arguments or the
environment, and the bridge to ``e2b`` SDK objects bound to the same server.

The SDK is imported only when an SDK object is made: it takes most of a second to import,
which a caller of the HTTP routes alone (the ``aenv`` CLI's listings) should not pay."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar, Union

from agentenv.api.models import Sandbox as SandboxBody

if TYPE_CHECKING:
    import e2b

DEFAULT_SERVER = "http://127.0.0.1:8000"

# Quoted (hence Union: `|` cannot join strings), so that this module need not import the SDK.
SandboxRef: TypeAlias = Union[str, "e2b.Sandbox", "e2b.AsyncSandbox"]
"""A sandbox as the client's methods accept it: its id or an SDK object."""

SandboxT = TypeVar("SandboxT", "e2b.Sandbox", "e2b.AsyncSandbox")


def sandbox_id_of(sandbox: SandboxRef) -> str:
    return sandbox if isinstance(sandbox, str) else sandbox.sandbox_id


@dataclass(frozen=True)
class Connection:
    """The control-plane URL, the API key and the URL envd traffic goes to (the server's
    proxy, which routes by the ``E2b-Sandbox-Id`` header)."""

    server: str
    api_key: str | None
    sandbox_url: str

    @classmethod
    def resolve(
        cls,
        server: str | None = None,
        api_key: str | None = None,
        sandbox_url: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Connection:
        """Arguments first, then ``AENV_SERVER`` / ``E2B_API_URL``, ``AENV_API_KEY`` /
        ``E2B_API_KEY`` and ``E2B_SANDBOX_URL``; the sandbox URL defaults to the server."""
        env = os.environ if env is None else env
        url = server or env.get("AENV_SERVER") or env.get("E2B_API_URL") or DEFAULT_SERVER
        url = url.rstrip("/")
        key = api_key or env.get("AENV_API_KEY") or env.get("E2B_API_KEY") or None
        traffic = (sandbox_url or env.get("E2B_SANDBOX_URL") or url).rstrip("/")
        return cls(server=url, api_key=key, sandbox_url=traffic)

    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.api_key} if self.api_key else {}

    def e2b_client(self) -> e2b.E2B:
        """An SDK client bound to this server. ``debug`` is pinned off: with ``E2B_DEBUG``
        set, the SDK would skip the control plane altogether."""
        import e2b

        return e2b.E2B(
            api_key=self.api_key, api_url=self.server, sandbox_url=self.sandbox_url, debug=False
        )

    def sdk_sandbox(self, cls: type[SandboxT], body: SandboxBody) -> SandboxT:
        """An SDK object for a sandbox the server has just started (a fork child), built
        from the create-style response as the SDK builds its own, without a round trip."""
        import e2b
        from packaging.version import Version

        envd_headers = {
            "E2b-Sandbox-Id": body.sandbox_id,
            "E2b-Sandbox-Port": str(e2b.ConnectionConfig.envd_port),
        }
        if body.envd_access_token is not None:
            envd_headers["X-Access-Token"] = body.envd_access_token
        config = e2b.ConnectionConfig(
            api_key=self.api_key,
            api_url=self.server,
            sandbox_url=self.sandbox_url,
            debug=False,
            extra_sandbox_headers=envd_headers,
        )
        return cls(
            sandbox_id=body.sandbox_id,
            sandbox_domain=body.domain,
            envd_version=Version(body.envd_version),
            envd_access_token=body.envd_access_token,
            traffic_access_token=body.traffic_access_token,
            connection_config=config,
        )

"""A minimal client for Firecracker's HTTP API on its Unix socket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from agentenv.vmm.base import VMMCommandError

API_TIMEOUT_S = 10.0


class FirecrackerAPI:
    """A minimal client for Firecracker's API socket: JSON in, JSON (or nothing) out, and
    ``{"fault_message": ...}`` replies raised as :class:`VMMCommandError`."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
            base_url="http://localhost",
            timeout=API_TIMEOUT_S,
        )

    async def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        read_timeout: float = API_TIMEOUT_S,
    ) -> dict[str, Any]:
        response = await self._client.request(method, path, json=body, timeout=read_timeout)
        if response.status_code >= 300:
            try:
                fault = response.json().get("fault_message") or response.text
            except ValueError:
                fault = response.text
            raise VMMCommandError(f"{method} {path} failed ({response.status_code}): {fault}")
        if not response.content:
            return {}
        data: dict[str, Any] = response.json()
        return data

    async def aclose(self) -> None:
        await self._client.aclose()

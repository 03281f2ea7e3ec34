"""Talking to the scheduler over HTTP, for gateways and nodes. Every failure to reach it
(or a 5xx from it, such as its Redis being down) is a :class:`SchedulerUnavailable`."""

from __future__ import annotations

from typing import Any

import httpx

from agentenv.cluster.models import (
    Binding,
    NodeInfo,
    NodeReport,
    Placement,
    PlacementRequest,
)


class SchedulerUnavailable(Exception):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"scheduler {url} unavailable: {reason}")
        self.url = url
        self.reason = reason


class SchedulerRefused(Exception):
    """The scheduler answered, and refused (e.g. no capacity: 503 with a reason)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class SchedulerClient:
    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers={"X-API-Key": api_key},
            timeout=timeout,
            trust_env=False,
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, path: str, *, json: Any = None, missing_ok: bool = False
    ) -> Any:
        try:
            response = await self._http.request(method, path, json=json)
        except httpx.HTTPError as exc:
            raise SchedulerUnavailable(self.url, str(exc) or type(exc).__name__) from exc
        if missing_ok and response.status_code == 404:
            return None
        if response.status_code >= 400:
            message = _message(response)
            if response.status_code >= 500 and response.status_code != 503:
                raise SchedulerUnavailable(self.url, message)
            raise SchedulerRefused(response.status_code, message)
        return response.json() if response.content else None

    async def heartbeat(self, report: NodeReport) -> NodeInfo:
        wire = report.model_dump(mode="json", by_alias=True)
        data = await self._call("POST", "/heartbeats", json=wire)
        return NodeInfo.model_validate(data)

    async def leave(self, node_id: str) -> None:
        await self._call("DELETE", f"/nodes/{node_id}")

    async def nodes(self) -> list[NodeInfo]:
        return [NodeInfo.model_validate(item) for item in await self._call("GET", "/nodes")]

    async def node(self, node_id: str) -> NodeInfo | None:
        data = await self._call("GET", f"/nodes/{node_id}", missing_ok=True)
        return None if data is None else NodeInfo.model_validate(data)

    async def place(self, request: PlacementRequest) -> Placement:
        data = await self._call("POST", "/placements", json=request.model_dump(by_alias=True))
        return Placement.model_validate(data)

    async def release(self, placement_id: str) -> None:
        await self._call("DELETE", f"/placements/{placement_id}")

    async def bind(self, sandbox_id: str, node_id: str, placement_id: str | None = None) -> None:
        body = {"nodeID": node_id, "placementID": placement_id}
        await self._call("PUT", f"/bindings/{sandbox_id}", json=body)

    async def lookup(self, sandbox_id: str) -> Binding | None:
        data = await self._call("GET", f"/bindings/{sandbox_id}", missing_ok=True)
        return None if data is None else Binding.model_validate(data)

    async def unbind(self, sandbox_id: str) -> None:
        await self._call("DELETE", f"/bindings/{sandbox_id}")


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:200] or f"HTTP {response.status_code}"
    if isinstance(data, dict) and "message" in data:
        return str(data["message"])
    return str(data)[:200]

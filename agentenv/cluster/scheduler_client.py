"""Talking to the scheduler over HTTP, for gateways and nodes. Every failure to reach it
(or a 5xx from it, such as its Redis being down) is a :class:`SchedulerUnavailable`.

A client may be given several scheduler replicas (``http://a:9090,http://b:9090``, see
``scheduler``): it keeps calling the one that last answered and moves to the next when
that one cannot be reached, breaks off, or answers a 5xx other than 503 (a 503 is a
refusal every replica would give: no capacity, or the shared Redis down). Every call is
safe to send again to another replica: heartbeats, binds and unbinds are idempotent, and
a placement whose answer was lost leaves only a reservation that expires. One address in
front of the replicas (a Kubernetes Service) works as well, as a list of one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from agentenv.cluster.models import (
    Binding,
    NodeInfo,
    NodeReport,
    Placement,
    PlacementRequest,
)
from agentenv.cluster.tls import client_context


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


def scheduler_urls(urls: str | list[str]) -> list[str]:
    """``urls`` as a list: comma-separated text or a list, trailing slashes dropped."""
    items = urls.split(",") if isinstance(urls, str) else urls
    found = [url.strip().rstrip("/") for url in items if url.strip()]
    if not found:
        raise ValueError("no scheduler URL given")
    return found


class SchedulerClient:
    def __init__(
        self,
        urls: str | list[str],
        api_key: str,
        *,
        timeout: float = 10.0,
        ca_file: Path | str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.urls = scheduler_urls(urls)
        # The replica calls go to first: the one that answered last.
        self._current = 0
        self._http = httpx.AsyncClient(
            headers={"X-API-Key": api_key},
            # A replica that is gone refuses at once on a live host; a dead host is given
            # a few seconds before the next replica is tried.
            timeout=httpx.Timeout(timeout, connect=min(timeout, 3.0)),
            trust_env=False,
            verify=client_context(ca_file),
            transport=transport,
        )

    @property
    def url(self) -> str:
        """The replica calls go to first."""
        return self.urls[self._current]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, path: str, *, json: Any = None, missing_ok: bool = False
    ) -> Any:
        failures = []
        for step in range(len(self.urls)):
            index = (self._current + step) % len(self.urls)
            url = self.urls[index]
            try:
                response = await self._http.request(method, url + path, json=json)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {str(exc) or type(exc).__name__}")
                continue
            if response.status_code >= 500 and response.status_code != 503:
                failures.append(f"{url}: {_message(response)}")
                continue
            self._current = index
            if missing_ok and response.status_code == 404:
                return None
            if response.status_code >= 400:
                raise SchedulerRefused(response.status_code, _message(response))
            return response.json() if response.content else None
        raise SchedulerUnavailable(",".join(self.urls), "; ".join(failures))

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

"""Where the scheduler keeps what must survive its restart: sandbox→node bindings and the
nodes' last reports. In memory (lost on restart, rebuilt from the next heartbeats) or in
Redis (kept; several schedulers could read them).

Redis layout: hash ``{prefix}bindings`` (sandbox id → ``{"node": ..., "at": ...}``) and
hash ``{prefix}nodes`` (node id → the node's last report as JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from agentenv.cluster.models import NodeReport


class BindingStoreUnavailable(Exception):
    """The binding store (Redis) cannot be reached or answered with an error."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"binding store {url} unavailable: {reason}")
        self.url = url
        self.reason = reason


@dataclass(frozen=True)
class BoundEntry:
    node_id: str
    # Scheduler wall-clock seconds when the binding was written.
    bound_at: float


class BindingStore(Protocol):
    async def get(self, sandbox_id: str) -> BoundEntry | None: ...
    async def put(self, sandbox_id: str, entry: BoundEntry) -> None: ...
    async def delete(self, *sandbox_ids: str) -> None: ...
    async def all(self) -> dict[str, BoundEntry]: ...
    async def save_node(self, report: NodeReport) -> None: ...
    async def delete_node(self, node_id: str) -> None: ...
    async def nodes(self) -> list[NodeReport]: ...
    async def aclose(self) -> None: ...


class MemoryBindings:
    """Bindings in this process only: a restarted scheduler starts empty and relearns
    them from the nodes' rosters."""

    def __init__(self) -> None:
        self._bindings: dict[str, BoundEntry] = {}
        self._nodes: dict[str, NodeReport] = {}

    async def get(self, sandbox_id: str) -> BoundEntry | None:
        return self._bindings.get(sandbox_id)

    async def put(self, sandbox_id: str, entry: BoundEntry) -> None:
        self._bindings[sandbox_id] = entry

    async def delete(self, *sandbox_ids: str) -> None:
        for sandbox_id in sandbox_ids:
            self._bindings.pop(sandbox_id, None)

    async def all(self) -> dict[str, BoundEntry]:
        return dict(self._bindings)

    async def save_node(self, report: NodeReport) -> None:
        self._nodes[report.node_id] = report

    async def delete_node(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    async def nodes(self) -> list[NodeReport]:
        return list(self._nodes.values())

    async def aclose(self) -> None:
        return None


class RedisBindings:
    """Bindings in a Redis server (``redis://host:port/db``); every failure is a
    :class:`BindingStoreUnavailable`."""

    def __init__(self, url: str, prefix: str = "aenv:") -> None:
        self.url = url
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5
        )
        self._bindings_key = f"{prefix}bindings"
        self._nodes_key = f"{prefix}nodes"

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            result = getattr(self._redis, method)(*args)
            return await result
        except (RedisError, OSError) as exc:
            raise BindingStoreUnavailable(self.url, str(exc) or type(exc).__name__) from exc

    async def get(self, sandbox_id: str) -> BoundEntry | None:
        raw = await self._call("hget", self._bindings_key, sandbox_id)
        return _entry(raw) if raw else None

    async def put(self, sandbox_id: str, entry: BoundEntry) -> None:
        value = json.dumps({"node": entry.node_id, "at": entry.bound_at})
        await self._call("hset", self._bindings_key, sandbox_id, value)

    async def delete(self, *sandbox_ids: str) -> None:
        if sandbox_ids:
            await self._call("hdel", self._bindings_key, *sandbox_ids)

    async def all(self) -> dict[str, BoundEntry]:
        raw: dict[str, str] = await self._call("hgetall", self._bindings_key)
        return {sandbox_id: _entry(value) for sandbox_id, value in raw.items()}

    async def save_node(self, report: NodeReport) -> None:
        await self._call(
            "hset", self._nodes_key, report.node_id, report.model_dump_json(by_alias=True)
        )

    async def delete_node(self, node_id: str) -> None:
        await self._call("hdel", self._nodes_key, node_id)

    async def nodes(self) -> list[NodeReport]:
        raw: dict[str, str] = await self._call("hgetall", self._nodes_key)
        return [NodeReport.model_validate_json(value) for value in raw.values()]

    async def aclose(self) -> None:
        await self._redis.aclose()


def _entry(raw: str) -> BoundEntry:
    data = json.loads(raw)
    return BoundEntry(node_id=str(data["node"]), bound_at=float(data["at"]))


def open_binding_store(url: str | None) -> BindingStore:
    """Redis at ``url`` (``redis://...``), else memory."""
    return RedisBindings(url) if url else MemoryBindings()

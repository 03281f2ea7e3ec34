"""What the scheduler knows, kept where every scheduler replica reads and writes it: the
sandbox→node bindings, the nodes' last reports and liveness, and the reservations of
placements not yet in a report. In memory (one scheduler; lost on restart and rebuilt
from the next heartbeats) or in Redis (kept; any number of replicas).

Why all of it lives in Redis, not only the bindings: a node sends each heartbeat to one
replica (the first of its list that answers, or whichever one a Service in front picks),
so a replica fed only by the heartbeats it receives would see some nodes and not others,
and would mark down a node that merely heartbeats elsewhere. Making every node heartbeat
to every replica would forbid one address in front of them and multiply heartbeats. With
the reports and liveness in Redis every replica sees every node, a replica that dies
(even by kill -9) loses nothing but the requests in flight, and a new one serves at once.
Reservations are there too because placement must see every replica's: two replicas
placing at once must not both count a node's last free room (``reserve`` is atomic).

Liveness is a key that expires ``node_timeout`` after the last heartbeat, so Redis's
clock, not the replicas', decides when a node is down, and no replica has to sweep for it.

Redis layout (``prefix`` default ``aenv:``): hash ``bindings`` (sandbox id →
``{"node", "at"}``), hash ``node-records`` (node id → ``{"report", "seen"}``), keys
``alive:{node id}`` (present while the node is up), hash ``reservations`` (placement id →
``{"node", "vcpus", "memoryMib", "at", "sandbox"}``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from agentenv.cluster.models import NodeReport


class StoreUnavailable(Exception):
    """The store (Redis) cannot be reached or answered with an error."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"scheduler store {url} unavailable: {reason}")
        self.url = url
        self.reason = reason


@dataclass(frozen=True)
class BoundEntry:
    node_id: str
    # Scheduler wall-clock seconds when the binding was written.
    bound_at: float


@dataclass(frozen=True)
class NodeRecord:
    report: NodeReport
    # Scheduler wall-clock seconds of the last heartbeat.
    seen_at: float
    up: bool


@dataclass(frozen=True)
class Reservation:
    """Room a placement holds on a node until the node's report shows its sandbox."""

    node_id: str
    vcpus: int
    memory_mib: int
    made_at: float
    sandbox_id: str | None = None


# Given the nodes and every current reservation, the reservation to make (None: no room).
Chooser = Callable[[list[NodeRecord], list[Reservation]], Reservation | None]


class SchedulerStore(Protocol):
    # -- bindings
    async def get(self, sandbox_id: str) -> BoundEntry | None: ...
    async def put(self, sandbox_id: str, entry: BoundEntry) -> None: ...
    async def delete(self, *sandbox_ids: str) -> None: ...
    async def delete_unchanged(self, entries: dict[str, BoundEntry]) -> None:
        """Unbind each sandbox only if its binding is still the entry given (another
        replica may have moved it meanwhile)."""
        ...

    async def all(self) -> dict[str, BoundEntry]: ...

    # -- nodes
    async def save_node(self, report: NodeReport, seen_at: float, alive_for: float) -> None:
        """A heartbeat: the node's report, up for ``alive_for`` seconds from now."""
        ...

    async def mark_down(self, node_id: str) -> None: ...
    async def delete_node(self, node_id: str) -> None: ...
    async def node(self, node_id: str, now: float) -> NodeRecord | None: ...
    async def nodes(self, now: float) -> list[NodeRecord]: ...

    # -- reservations
    async def reserve(self, choose: Chooser, now: float) -> tuple[str, Reservation] | None:
        """Atomically: ``choose`` over the up nodes and every reservation, and keep what
        it chose under a new placement id."""
        ...

    async def reservations(self) -> dict[str, Reservation]: ...
    async def set_reservation(self, placement_id: str, reservation: Reservation) -> None:
        """Change a reservation that exists (no effect on one that ended)."""
        ...

    async def end_reservations(self, *placement_ids: str) -> None: ...
    async def aclose(self) -> None: ...


class MemoryStore:
    """Everything in this process: one scheduler, which starts empty and relearns nodes
    and bindings from the heartbeats."""

    def __init__(self) -> None:
        self._bindings: dict[str, BoundEntry] = {}
        # node id -> (report, seen at, up until)
        self._nodes: dict[str, tuple[NodeReport, float, float]] = {}
        self._reservations: dict[str, Reservation] = {}

    async def get(self, sandbox_id: str) -> BoundEntry | None:
        return self._bindings.get(sandbox_id)

    async def put(self, sandbox_id: str, entry: BoundEntry) -> None:
        self._bindings[sandbox_id] = entry

    async def delete(self, *sandbox_ids: str) -> None:
        for sandbox_id in sandbox_ids:
            self._bindings.pop(sandbox_id, None)

    async def delete_unchanged(self, entries: dict[str, BoundEntry]) -> None:
        for sandbox_id, entry in entries.items():
            if self._bindings.get(sandbox_id) == entry:
                del self._bindings[sandbox_id]

    async def all(self) -> dict[str, BoundEntry]:
        return dict(self._bindings)

    async def save_node(self, report: NodeReport, seen_at: float, alive_for: float) -> None:
        self._nodes[report.node_id] = (report, seen_at, seen_at + alive_for)

    async def mark_down(self, node_id: str) -> None:
        if node_id in self._nodes:
            report, seen_at, _ = self._nodes[node_id]
            self._nodes[node_id] = (report, seen_at, float("-inf"))

    async def delete_node(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    def _record(self, node_id: str, now: float) -> NodeRecord | None:
        if node_id not in self._nodes:
            return None
        report, seen_at, up_until = self._nodes[node_id]
        return NodeRecord(report, seen_at, up=now < up_until)

    async def node(self, node_id: str, now: float) -> NodeRecord | None:
        return self._record(node_id, now)

    async def nodes(self, now: float) -> list[NodeRecord]:
        return [r for node_id in self._nodes if (r := self._record(node_id, now)) is not None]

    async def reserve(self, choose: Chooser, now: float) -> tuple[str, Reservation] | None:
        # No await between reading and writing: atomic within the event loop.
        records = [r for node_id in self._nodes if (r := self._record(node_id, now))]
        chosen = choose(records, list(self._reservations.values()))
        if chosen is None:
            return None
        placement_id = secrets.token_hex(8)
        self._reservations[placement_id] = chosen
        return placement_id, chosen

    async def reservations(self) -> dict[str, Reservation]:
        return dict(self._reservations)

    async def set_reservation(self, placement_id: str, reservation: Reservation) -> None:
        if placement_id in self._reservations:
            self._reservations[placement_id] = reservation

    async def end_reservations(self, *placement_ids: str) -> None:
        for placement_id in placement_ids:
            self._reservations.pop(placement_id, None)

    async def aclose(self) -> None:
        return None


# Deletes each binding KEYS[1][ARGV[2i-1]] whose value is still ARGV[2i].
_DELETE_UNCHANGED = """
local removed = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    removed = removed + 1
  end
end
return removed
"""

# Sets KEYS[1][ARGV[1]] to ARGV[2] only if that field exists.
_SET_IF_PRESENT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return -1
"""

# Connections one scheduler process holds to Redis at most.
_MAX_CONNECTIONS = 64
# How often a placement is tried again when another replica's placement (or a heartbeat
# ending reservations) changed the reservations between its read and its write.
_RESERVE_ATTEMPTS = 100


class RedisStore:
    """Everything in a Redis server (``redis://host:port/db``), shared by every scheduler
    replica; every failure is a :class:`StoreUnavailable`."""

    def __init__(self, url: str, prefix: str = "aenv:") -> None:
        self.url = url
        # A bounded pool that makes a burst of requests wait for a connection (up to
        # `socket_timeout`) rather than fail: redis-py's default pool refuses the 101st.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=_MAX_CONNECTIONS,
            timeout=10,
            decode_responses=True,
            socket_timeout=5,
            socket_connect_timeout=5,
        )
        self._redis: aioredis.Redis = aioredis.Redis.from_pool(pool)
        self._prefix = prefix
        self._bindings_key = f"{prefix}bindings"
        self._nodes_key = f"{prefix}node-records"
        self._reservations_key = f"{prefix}reservations"
        self._delete_unchanged = self._redis.register_script(_DELETE_UNCHANGED)
        self._set_if_present = self._redis.register_script(_SET_IF_PRESENT)

    def _alive_key(self, node_id: str) -> str:
        return f"{self._prefix}alive:{node_id}"

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self._redis, method)(*args, **kwargs)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(self.url, str(exc) or type(exc).__name__) from exc

    async def _script(self, script: Any, keys: list[str], args: list[str]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(self.url, str(exc) or type(exc).__name__) from exc

    # -- bindings
    async def get(self, sandbox_id: str) -> BoundEntry | None:
        raw = await self._call("hget", self._bindings_key, sandbox_id)
        return _entry(raw) if raw else None

    async def put(self, sandbox_id: str, entry: BoundEntry) -> None:
        await self._call("hset", self._bindings_key, sandbox_id, _entry_json(entry))

    async def delete(self, *sandbox_ids: str) -> None:
        if sandbox_ids:
            await self._call("hdel", self._bindings_key, *sandbox_ids)

    async def delete_unchanged(self, entries: dict[str, BoundEntry]) -> None:
        if entries:
            args = [part for sid, e in entries.items() for part in (sid, _entry_json(e))]
            await self._script(self._delete_unchanged, [self._bindings_key], args)

    async def all(self) -> dict[str, BoundEntry]:
        raw: dict[str, str] = await self._call("hgetall", self._bindings_key)
        return {sandbox_id: _entry(value) for sandbox_id, value in raw.items()}

    # -- nodes
    async def save_node(self, report: NodeReport, seen_at: float, alive_for: float) -> None:
        record = json.dumps(
            {"report": report.model_dump(mode="json", by_alias=True), "seen": seen_at}
        )
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._nodes_key, report.node_id, record)
                pipe.set(self._alive_key(report.node_id), "1", px=max(1, int(alive_for * 1000)))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(self.url, str(exc) or type(exc).__name__) from exc

    async def mark_down(self, node_id: str) -> None:
        await self._call("delete", self._alive_key(node_id))

    async def delete_node(self, node_id: str) -> None:
        await self._call("hdel", self._nodes_key, node_id)
        await self._call("delete", self._alive_key(node_id))

    async def node(self, node_id: str, now: float) -> NodeRecord | None:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hget(self._nodes_key, node_id)
                pipe.exists(self._alive_key(node_id))
                raw, alive = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(self.url, str(exc) or type(exc).__name__) from exc
        return None if raw is None else _record(raw, bool(alive))

    async def nodes(self, now: float) -> list[NodeRecord]:
        return await self._nodes(self._redis)

    async def _nodes(self, redis: Any) -> list[NodeRecord]:
        """The nodes, read through ``redis``: the client, or a pipeline in its immediate
        mode (after WATCH), so a placement holds one connection."""
        try:
            raw: dict[str, str] = await redis.hgetall(self._nodes_key)
            ids = sorted(raw)
            alive = await redis.mget([self._alive_key(i) for i in ids]) if ids else []
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(self.url, str(exc) or type(exc).__name__) from exc
        return [_record(raw[i], flag is not None) for i, flag in zip(ids, alive, strict=True)]

    # -- reservations
    async def reserve(self, choose: Chooser, now: float) -> tuple[str, Reservation] | None:
        # Optimistic: WATCH the reservations, read, choose, write in MULTI; if any replica
        # changed them meanwhile, EXEC fails and this is tried again on what it did. No
        # lock, so a replica killed mid-placement holds nothing up.
        placement_id = secrets.token_hex(8)
        try:
            for _ in range(_RESERVE_ATTEMPTS):
                async with self._redis.pipeline(transaction=True) as pipe:
                    try:
                        await pipe.watch(self._reservations_key)
                        held = await pipe.hgetall(self._reservations_key)
                        records = await self._nodes(pipe)
                        chosen = choose(records, [_reservation(str(v)) for v in held.values()])
                        if chosen is None:
                            return None
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.hset(self._reservations_key, placement_id, _reservation_json(chosen))
                        await pipe.execute()
                        return placement_id, chosen
                    except WatchError:
                        continue
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(self.url, str(exc) or type(exc).__name__) from exc
        raise StoreUnavailable(self.url, f"placement lost {_RESERVE_ATTEMPTS} races in a row")

    async def reservations(self) -> dict[str, Reservation]:
        raw: dict[str, str] = await self._call("hgetall", self._reservations_key)
        return {key: _reservation(value) for key, value in raw.items()}

    async def set_reservation(self, placement_id: str, reservation: Reservation) -> None:
        args = [placement_id, _reservation_json(reservation)]
        await self._script(self._set_if_present, [self._reservations_key], args)

    async def end_reservations(self, *placement_ids: str) -> None:
        if placement_ids:
            await self._call("hdel", self._reservations_key, *placement_ids)

    async def aclose(self) -> None:
        await self._redis.aclose()


def _entry_json(entry: BoundEntry) -> str:
    return json.dumps({"node": entry.node_id, "at": entry.bound_at})


def _entry(raw: str) -> BoundEntry:
    data = json.loads(raw)
    return BoundEntry(node_id=str(data["node"]), bound_at=float(data["at"]))


def _record(raw: str, up: bool) -> NodeRecord:
    data = json.loads(raw)
    return NodeRecord(NodeReport.model_validate(data["report"]), float(data["seen"]), up)


def _reservation_json(reservation: Reservation) -> str:
    return json.dumps(asdict(reservation))


def _reservation(raw: str) -> Reservation:
    return Reservation(**json.loads(raw))


def with_sandbox(reservation: Reservation, sandbox_id: str) -> Reservation:
    return replace(reservation, sandbox_id=sandbox_id)


def open_store(url: str | None) -> SchedulerStore:
    """Redis at ``url`` (``redis://...``), else memory."""
    return RedisStore(url) if url else MemoryStore()

"""Several scheduler replicas on one real redis-server, without VMs: each sees the nodes
and bindings another was told about, placements made on both at once never share a
node's last room, a roster does not unbind a sandbox another replica just moved, liveness
expires in Redis, and scheduler clients move on from a replica that is gone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.cluster.models import NodeState
from agentenv.cluster.placement import Demand, LeastLoaded
from agentenv.cluster.registry import NoCapacity, NodeRegistry
from agentenv.cluster.scheduler import create_scheduler_app
from agentenv.cluster.scheduler_client import SchedulerClient, SchedulerUnavailable
from agentenv.cluster.store import BoundEntry, RedisStore
from tests.cluster_support import KEY, ServedApp, redis_server, registry, report
from tests.helpers import free_port


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


def replica(redis_url: str, node_timeout: float = 30.0) -> NodeRegistry:
    """A scheduler replica's registry on the shared Redis, on the real clock."""
    return NodeRegistry(
        RedisStore(redis_url),
        LeastLoaded(overcommit=1.0),
        node_timeout=node_timeout,
        binding_grace=10.0,
    )


async def test_replicas_share_nodes_bindings_and_reservations(redis_url: str) -> None:
    first, second = replica(redis_url), replica(redis_url)
    await first.heartbeat(report("a", sandboxes=["i1"]))
    await second.heartbeat(report("b"))
    assert [(n.node_id, n.state) for n in await first.nodes()] == [
        ("a", NodeState.UP),
        ("b", NodeState.UP),
    ]
    await first.bind("i2", "b")
    for reg in (first, second):
        assert (await reg.lookup("i1")).node_id == "a"  # type: ignore[union-attr]
        assert (await reg.lookup("i2")).node_id == "b"  # type: ignore[union-attr]
    # A placement made on one replica is released on the other.
    placement_id, _ = await first.place(Demand("base"))
    assert len(await second.store.reservations()) == 1
    await second.release(placement_id)
    assert await first.store.reservations() == {}
    await second.unbind("i2")
    assert await first.lookup("i2") is None
    for reg in (first, second):
        await reg.store.aclose()


async def test_placements_on_two_replicas_at_once_never_share_room(redis_url: str) -> None:
    replicas = [replica(redis_url) for _ in range(2)]
    # Two nodes with room for one sandbox each (2 CPUs, 2 vCPUs a sandbox, no overcommit).
    for node_id in ("a", "b"):
        await replicas[0].heartbeat(report(node_id, cpuCount=2))

    async def attempt(reg: NodeRegistry) -> str | None:
        try:
            return (await reg.place(Demand("base")))[1].node_id
        except NoCapacity:
            return None

    # A burst: more at once than a Redis connection pool holds.
    placed = await asyncio.gather(*(attempt(replicas[i % 2]) for i in range(300)))
    assert sorted(node for node in placed if node is not None) == ["a", "b"]
    for reg in replicas:
        await reg.store.aclose()


async def test_a_roster_does_not_unbind_a_sandbox_moved_meanwhile(redis_url: str) -> None:
    store = RedisStore(redis_url)
    await store.put("i1", BoundEntry("a", 100.0))
    # Read as bound to a; then another replica binds it to b; then a's roster unbinds.
    await store.put("i1", BoundEntry("b", 200.0))
    await store.delete_unchanged({"i1": BoundEntry("a", 100.0)})
    assert await store.get("i1") == BoundEntry("b", 200.0)
    await store.delete_unchanged({"i1": BoundEntry("b", 200.0)})
    assert await store.get("i1") is None
    await store.aclose()


async def test_a_silent_node_goes_down_for_every_replica(redis_url: str) -> None:
    first, second = replica(redis_url, node_timeout=1.0), replica(redis_url, node_timeout=1.0)
    await first.heartbeat(report("a"))
    assert (await second.node("a")).state is NodeState.UP  # type: ignore[union-attr]
    third = replica(redis_url, node_timeout=1.0)
    assert await third.newly_down() == []  # a look: it sees a up, not told by a heartbeat
    assert third.states_seen() == {"a": NodeState.UP}
    # Redis expires its liveness: no replica needs to have seen it go.
    for _ in range(600):
        if (await second.node("a")).state is NodeState.DOWN:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.1)
    assert (await second.node("a")).state is NodeState.DOWN  # type: ignore[union-attr]
    assert await second.newly_down() == []  # it never saw it up
    assert await first.newly_down() == ["a"]
    assert await third.newly_down() == ["a"]
    await second.heartbeat(report("a"))
    assert (await first.node("a")).state is NodeState.UP  # type: ignore[union-attr]
    await second.forget("a")
    assert await third.newly_down() == [] and third.states_seen() == {}
    for reg in (first, second, third):
        await reg.store.aclose()


async def test_clients_move_on_from_a_replica_that_is_gone(redis_url: str) -> None:
    live = replica(redis_url)
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with ServedApp(create_scheduler_app(live, KEY)) as served:
        client = SchedulerClient(f"{gone},{served.url}/", KEY)
        assert client.urls == [gone, served.url]
        await client.heartbeat(report("a"))
        assert client.url == served.url  # the next call goes there first
        assert [n.node_id for n in await client.nodes()] == ["a"]
        await client.aclose()
    client = SchedulerClient(f"{gone},{served.url}", KEY)
    with pytest.raises(SchedulerUnavailable) as failed:
        await client.nodes()
    assert gone in failed.value.reason and served.url in failed.value.reason
    await client.aclose()


async def test_memory_registries_do_not_share(redis_url: str) -> None:
    """Without Redis each scheduler has its own view: why replicas need it."""
    from tests.cluster_support import Clock

    clock = Clock()
    first, second = registry(clock), registry(clock)
    await first.heartbeat(report("a"))
    assert await second.nodes() == []

"""The gateway's route cache (``agentenv.cluster.routes``) with a fake clock and lookup:
fresh entries route alone, expired ones route while they are looked up again off the
request's path, failed look-ups and forgotten sandboxes drop them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from agentenv.cluster.models import NodeInfo, NodeState
from agentenv.cluster.routes import RouteCache
from tests.cluster_support import Clock, report


def node(node_id: str) -> NodeInfo:
    return NodeInfo(report=report(node_id), state=NodeState.UP, lastSeen=datetime.now(UTC))


class Scheduler:
    """Where sandboxes are, as a lookup sees it; ``gate`` holds look-ups while cleared."""

    def __init__(self) -> None:
        self.owners: dict[str, NodeInfo | None] = {}
        self.failure: Exception | None = None
        self.lookups = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def lookup(self, sandbox_id: str) -> NodeInfo | None:
        self.lookups += 1
        await self.gate.wait()
        if self.failure is not None:
            raise self.failure
        return self.owners.get(sandbox_id)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_expired_route_serves_while_it_is_looked_up_again() -> None:
    clock, scheduler = Clock(), Scheduler()
    routes = RouteCache(scheduler.lookup, 1.0, clock=clock)
    scheduler.owners["i1"] = node("a")
    found, cached = await routes.owner("i1")
    assert (found and found.node_id, cached, scheduler.lookups) == ("a", False, 1)
    scheduler.owners["i1"] = node("b")  # moved by another gateway
    clock.now += 0.5
    found, cached = await routes.owner("i1")
    assert (found and found.node_id, cached, scheduler.lookups) == ("a", True, 1)
    # Expired: the request is routed at once, from the entry; one look-up goes out.
    clock.now += 0.6
    scheduler.gate.clear()
    for _ in range(3):
        # Bounded: a look-up on the request's path would wait for the gate.
        found, cached = await asyncio.wait_for(routes.owner("i1"), 30)
        assert (found and found.node_id, cached) == ("a", True)
    await settle()
    assert scheduler.lookups == 2
    scheduler.gate.set()
    await settle()
    found, cached = await routes.owner("i1")
    assert (found and found.node_id, cached, scheduler.lookups) == ("b", True, 2)
    # Idle past twice the lifetime: looked up on the request's path.
    clock.now += 2.5
    scheduler.owners["i1"] = node("a")
    found, cached = await routes.owner("i1")
    assert (found and found.node_id, cached, scheduler.lookups) == ("a", False, 3)
    await routes.aclose()


async def test_a_failed_or_empty_look_up_drops_the_route() -> None:
    clock, scheduler = Clock(), Scheduler()
    routes = RouteCache(scheduler.lookup, 1.0, clock=clock)
    scheduler.owners["i1"] = node("a")
    await routes.owner("i1")
    clock.now += 1.5
    scheduler.failure = RuntimeError("scheduler unreachable")
    found, cached = await routes.owner("i1")  # still routed, the look-up fails behind it
    assert (found and found.node_id, cached) == ("a", True)
    await settle()
    with pytest.raises(RuntimeError):
        await routes.owner("i1")  # the next request asks, and gets the failure
    scheduler.failure = None
    await routes.owner("i1")
    clock.now += 1.5
    scheduler.owners["i1"] = None  # killed through another gateway
    await routes.owner("i1")
    await settle()
    assert await routes.owner("i1") == (None, False)
    await routes.aclose()


async def test_a_forgotten_route_is_not_brought_back_by_a_look_up_under_way() -> None:
    clock, scheduler = Clock(), Scheduler()
    routes = RouteCache(scheduler.lookup, 1.0, clock=clock)
    scheduler.owners["i1"] = node("a")
    await routes.owner("i1")
    clock.now += 1.5
    scheduler.gate.clear()
    await routes.owner("i1")  # a look-up starts and waits
    await settle()
    routes.forget("i1")  # e.g. this gateway killed the sandbox meanwhile
    scheduler.gate.set()
    await settle()
    scheduler.owners["i1"] = node("b")
    found, cached = await routes.owner("i1")
    assert (found and found.node_id, cached) == ("b", False)
    await routes.aclose()

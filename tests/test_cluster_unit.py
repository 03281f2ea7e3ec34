"""The cluster's scheduler and gateway without VMs: placement, the node registry and its
bindings (in memory and in a real redis-server), listings merged across nodes, and the
gateway's routing against fake nodes."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from agentenv import __version__
from agentenv.api.listing import Order, decode_token
from agentenv.cluster.discovery import EndpointSliceDiscovery, StaticDiscovery, open_discovery
from agentenv.cluster.gateway import Gateway
from agentenv.cluster.listing import merge_pages, sandbox_key
from agentenv.cluster.models import NodeState, PlacementRequest
from agentenv.cluster.placement import Candidate, Demand, LeastLoaded
from agentenv.cluster.registry import NoCapacity, NodeRegistry
from agentenv.cluster.scheduler import create_scheduler_app
from agentenv.cluster.scheduler_client import SchedulerClient
from agentenv.cluster.store import RedisStore
from tests.cluster_support import (
    KEY,
    Clock,
    ServedApp,
    ServedGateway,
    echo_node,
    redis_server,
    registry,
    report,
)
from tests.helpers import free_port


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


# -- placement ----------------------------------------------------------------------------
def candidate(node_id: str, vcpus: int = 0, memory: int = 0, **fields: Any) -> Candidate:
    from agentenv.cluster.models import NodeInfo

    info = NodeInfo.model_validate(
        {"report": report(node_id, **fields), "state": "up", "lastSeen": "2026-01-01T00:00:00Z"}
    )
    return Candidate(info, vcpus, memory)


def test_least_loaded_takes_the_emptiest_node_and_breaks_ties_by_id() -> None:
    strategy = LeastLoaded()
    demand = Demand("base")
    assert strategy.choose([candidate("b"), candidate("a")], demand).node_id == "a"  # type: ignore[union-attr]
    busy_a = candidate("a", vcpus=2, memory=512)
    assert strategy.choose([busy_a, candidate("b")], demand).node_id == "b"  # type: ignore[union-attr]


def test_overcommit_bounds_what_a_node_takes() -> None:
    full = candidate("a", vcpus=4, memory=512)
    assert LeastLoaded(overcommit=1.0).choose([full], Demand("base")) is None
    assert LeastLoaded(overcommit=2.0).choose([full], Demand("base")) is not None
    # Memory counts as well as CPUs.
    assert LeastLoaded(overcommit=1.0).choose([candidate("a", memory=4000)], Demand("base")) is None


def test_nodes_holding_the_template_come_first_and_broken_nodes_never() -> None:
    holder = candidate("z", vcpus=2, memory=512, templates=["base", "snap-1"])
    empty = candidate("a")
    assert LeastLoaded().choose([empty, holder], Demand("snap-1")).node_id == "z"  # type: ignore[union-attr]
    assert LeastLoaded().choose([empty, holder], Demand("base")).node_id == "a"  # type: ignore[union-attr]
    broken = candidate("a", problem="base template failed")
    assert LeastLoaded().choose([broken], Demand("base")) is None


# -- the registry ---------------------------------------------------------------------------
async def test_heartbeats_register_nodes_and_rosters_bind_sandboxes() -> None:
    clock = Clock()
    reg = registry(clock)
    await reg.heartbeat(report("a", sandboxes=["i1", "i2"]))
    assert [n.node_id for n in await reg.nodes()] == ["a"]
    binding = await reg.lookup("i1")
    assert binding is not None and binding.node_id == "a" and binding.node is not None
    # A sandbox the node no longer reports is unbound once the grace has passed.
    clock.now += 11
    await reg.heartbeat(report("a", sandboxes=["i2"]))
    assert await reg.lookup("i1") is None and await reg.lookup("i2") is not None


async def test_a_new_binding_survives_a_report_collected_before_it() -> None:
    clock = Clock()
    reg = registry(clock)
    await reg.heartbeat(report("a"))
    await reg.bind("i9", "a")
    clock.now += 1
    await reg.heartbeat(report("a", sandboxes=[]))
    assert await reg.lookup("i9") is not None


async def test_reservations_spread_placements_made_between_heartbeats() -> None:
    clock = Clock()
    reg = registry(clock, overcommit=1.0)
    await reg.heartbeat(report("a", cpuCount=2))
    await reg.heartbeat(report("b", cpuCount=2))
    first_id, first = await reg.place(Demand("base"))
    _, second = await reg.place(Demand("base"))
    assert {first.node_id, second.node_id} == {"a", "b"}
    with pytest.raises(NoCapacity):
        await reg.place(Demand("base"))
    # A failed create gives its room back.
    await reg.release(first_id)
    assert (await reg.place(Demand("base")))[1].node_id == first.node_id


async def test_a_reservation_ends_when_the_roster_shows_the_sandbox() -> None:
    clock = Clock()
    reg = registry(clock)
    await reg.heartbeat(report("a", cpuCount=2))
    placement_id, _ = await reg.place(Demand("base"))
    await reg.bind("i1", "a", placement_id)
    assert (await reg.candidates())[0].vcpus == 2
    await reg.heartbeat(report("a", cpuCount=2, sandboxes=["i1"], allocatedVcpus=2))
    assert (await reg.candidates())[0].vcpus == 2  # now the node's own count, not twice


async def test_silent_nodes_are_marked_down_and_come_back_with_a_heartbeat() -> None:
    clock = Clock()
    reg = registry(clock)
    await reg.heartbeat(report("a"))
    await reg.heartbeat(report("b"))
    clock.now += 3
    await reg.heartbeat(report("b"))
    clock.now += 3
    assert await reg.newly_down() == ["a"]
    assert await reg.newly_down() == []  # said once
    assert (await reg.node("a")).state is NodeState.DOWN  # type: ignore[union-attr]
    assert [c.node_id for c in await reg.candidates()] == ["b"]
    await reg.heartbeat(report("a"))
    assert (await reg.node("a")).state is NodeState.UP  # type: ignore[union-attr]


async def test_a_restarted_registry_relearns_bindings_from_rosters() -> None:
    clock = Clock()
    reg = registry(clock)
    await reg.heartbeat(report("a", sandboxes=["i1"]))
    restarted = registry(clock)  # memory store: nothing kept
    assert await restarted.lookup("i1") is None
    await restarted.heartbeat(report("a", sandboxes=["i1"]))
    assert (await restarted.lookup("i1")).node_id == "a"  # type: ignore[union-attr]


async def test_redis_keeps_bindings_and_nodes_across_a_restart(redis_url: str) -> None:
    clock = Clock()
    reg = registry(clock, RedisStore(redis_url))
    await reg.heartbeat(report("a", sandboxes=["i1"]))
    await reg.bind("i2", "a")
    await reg.store.aclose()
    restarted = registry(clock, RedisStore(redis_url))
    binding = await restarted.lookup("i2")
    assert binding is not None and binding.node is not None
    assert binding.node.report.url == "http://a.test" and binding.node.state is NodeState.UP
    assert (await restarted.lookup("i1")).node_id == "a"  # type: ignore[union-attr]
    await restarted.store.aclose()


# -- listings -------------------------------------------------------------------------------
def detail(sandbox_id: str, second: int) -> dict[str, Any]:
    return {"sandboxID": sandbox_id, "startedAt": f"2026-12-04T10:00:{second:02d}.5Z"}


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_merged_pages_walk_every_node_once_in_order(order: Order) -> None:
    node_a = [detail("ia", s) for s in (1, 3, 5, 7)]
    node_b = [detail("ib", s) for s in (2, 4, 6)]
    seen: list[str] = []
    token: str | None = None
    while True:
        pages = []
        more = False
        for items in (node_a, node_b):  # what each node would answer for (token, limit 2)
            ordered = sorted(items, key=sandbox_key, reverse=order == "desc")
            if token is not None:
                after = decode_token(token, order)
                ordered = [
                    i
                    for i in ordered
                    if (sandbox_key(i) < after if order == "desc" else sandbox_key(i) > after)
                ]
            pages.append(ordered[:2])
            more = more or len(ordered) > 2
        page, token = merge_pages(pages, order, 2, more)
        seen += [f"{i['sandboxID']}{i['startedAt'][17:19]}" for i in page]
        if token is None:
            break
    walk = ["ia01", "ib02", "ia03", "ib04", "ia05", "ib06", "ia07"]
    assert seen == (walk if order == "asc" else walk[::-1])


# -- the gateway against fake nodes ----------------------------------------------------------
class _Body(httpx.AsyncByteStream):
    """A body that streams, as a real node's does (``MockTransport`` reads ``content``)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


def answer(status: int, data: Any) -> httpx.Response:
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    return httpx.Response(status, stream=_Body(body))


class FakeNodes:
    """Nodes answering the gateway's app (the control plane: a sandbox's traffic is the
    front's, tested in test_gateway_front_*): ``down`` ones refuse connections."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.sandboxes: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        self.requests: list[tuple[str, str]] = []
        self.headers: list[httpx.Headers] = []
        # Nodes that run another mode than template "saved-elsewhere" and sandbox
        # "ipsaved-elsewhere" were saved under: they refuse both as a node does.
        self.other_mode: set[str] = set()
        # Nodes whose host cannot hold another sandbox: they refuse creates as a node does.
        self.full: set[str] = set()

    def handler(self, request: httpx.Request) -> httpx.Response:
        node = request.url.host.split(".")[0]
        self.requests.append((node, f"{request.method} {request.url.path}"))
        self.headers.append(request.headers)
        if node in self.down:
            raise httpx.ConnectError("connection refused")
        path = request.url.path
        saved_elsewhere = b"saved-elsewhere" in request.content or "saved-elsewhere" in path
        if node in self.other_mode and saved_elsewhere:
            return answer(
                409,
                {
                    "code": 409,
                    "message": "saved under firecracker/kvm; this node runs qemu/tcg",
                    "error_code": "mode_mismatch",
                },
            )
        if request.method == "POST" and path == "/sandboxes" and node in self.full:
            return answer(
                503,
                {
                    "code": 503,
                    "message": "create refused: this node's host stalled on memory 12 %",
                    "error_code": "capacity_exhausted",
                },
            )
        if request.method == "POST" and path == "/sandboxes":
            sandbox_id = f"i{node}{len(self.sandboxes[node])}"
            self.sandboxes[node].append(detail(sandbox_id, len(self.sandboxes[node])))
            return answer(201, {"sandboxID": sandbox_id})
        if request.method == "POST" and path.endswith("/connect"):
            # Only node "b" can adopt, and only sandboxes paused and committed ("ip...").
            adoptable = node == "b" and path.split("/")[-2].startswith("ip")
            return answer(201, {"node": node}) if adoptable else answer(404, {"code": 404})
        if path == "/health":
            health = {"status": "ok", "version": "0.1.0"}
            if request.headers.get("x-api-key") != KEY:
                return answer(200, health)  # what a node tells a caller without the key
            health |= {"vmm": "qemu", "accel": "tcg"}
            return answer(200, {**health, "templates": {"base": "ready"}, "sandboxes": 0})
        if request.method == "GET" and path == "/v2/sandboxes":
            return answer(200, self.sandboxes[node])
        return answer(200, {"node": node})


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[httpx.AsyncClient, FakeNodes, NodeRegistry]]:
    clock = Clock()
    reg = registry(clock, overcommit=4.0)
    app = create_scheduler_app(reg, KEY)
    nodes = FakeNodes()
    scheduler = SchedulerClient(
        "http://scheduler.test", KEY, transport=httpx.ASGITransport(app=app)
    )
    gw = Gateway(scheduler, KEY, "gw.test", transport=httpx.MockTransport(nodes.handler))
    for node_id in ("a", "b"):
        await scheduler.heartbeat(report(node_id))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw), base_url="http://gw.test"
    ) as client:
        yield client, nodes, reg
    await gw.aclose()


async def test_gateway_places_binds_and_routes_control_calls_to_the_owner(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    client, _nodes, _reg = gateway
    first = (await client.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
    second = (await client.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
    assert {first[1], second[1]} == {"a", "b"}  # spread: ids are i{node}{n}
    assert (await client.get(f"/sandboxes/{first}")).json() == {"node": first[1]}
    unknown = await client.get("/sandboxes/inope")
    assert unknown.status_code == 404


async def test_gateway_lists_across_nodes_with_paging(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    client, nodes, reg = gateway
    for _ in range(3):
        await client.post("/sandboxes", json={"templateID": "base"})
    everything = (await client.get("/v2/sandboxes")).json()
    assert len(everything) == 3
    page = await client.get("/v2/sandboxes", params={"limit": 2})
    assert len(page.json()) == 2 and page.headers["x-next-token"]
    assert "x-aenv-nodes-down" not in page.headers
    reg.clock.now += 60  # type: ignore[attr-defined]
    await reg.heartbeat(report("a", sandboxes=[s["sandboxID"] for s in nodes.sandboxes["a"]]))
    await reg.newly_down()
    partial = await client.get("/v2/sandboxes")
    assert partial.headers["x-aenv-nodes-down"] == "b"
    assert len(partial.json()) == len(nodes.sandboxes["a"])


async def test_a_sandbox_on_a_dead_node_is_503_node_unavailable(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    client, nodes, reg = gateway
    sandbox_id = (await client.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
    nodes.down.add(sandbox_id[1])
    answer = await client.get(f"/sandboxes/{sandbox_id}")
    assert answer.status_code == 503
    assert "node unavailable" in json.loads(answer.content)["message"]
    # Once the scheduler marks it down the answer is the same, without trying the node.
    reg.clock.now += 60  # type: ignore[attr-defined]
    await reg.newly_down()
    answer = await client.get(f"/sandboxes/{sandbox_id}")
    assert answer.status_code == 503 and "stopped heartbeating" in answer.json()["message"]


async def test_gateway_nodes_are_e2b_nodes_and_need_the_key(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    client, nodes, reg = gateway
    auth = {"X-API-Key": KEY}
    assert (await client.get("/nodes")).status_code == 401
    listed = (await client.get("/nodes", headers=auth)).json()
    assert [(n["id"], n["status"]) for n in listed] == [("a", "ready"), ("b", "ready")]
    assert listed[0]["metrics"]["cpuCount"] == 4  # described from its heartbeat report
    # An up node answers for itself.
    assert (await client.get("/nodes/b", headers=auth)).json() == {"node": "b"}
    assert ("b", "GET /nodes/b") in nodes.requests
    assert (await client.get("/nodes/zz", headers=auth)).status_code == 404
    # A down node is described from its last heartbeat, unhealthy.
    reg.clock.now += 60  # type: ignore[attr-defined]
    await reg.heartbeat(report("a"))
    await reg.newly_down()
    down = (await client.get("/nodes/b", headers=auth)).json()
    assert (down["id"], down["status"], down["cachedBuilds"]) == ("b", "unhealthy", ["base"])
    listed = (await client.get("/nodes", headers=auth)).json()
    assert [(n["id"], n["status"]) for n in listed] == [("a", "ready"), ("b", "unhealthy")]


async def test_gateway_metrics_time_requests_and_nodes(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    client, _nodes, _reg = gateway
    await client.post("/sandboxes", json={"templateID": "base"})
    assert (await client.get("/metrics")).status_code == 401
    answer = await client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }
    created = (("component", "gateway"), ("method", "POST"), ("route", "create"), ("status", "201"))
    assert got[("aenv_http_request_duration_seconds_count", created)] == 1
    upstream = [
        v for (name, labels), v in got.items() if name == "aenv_gateway_upstream_seconds_count"
    ]
    assert sum(upstream) == 1


async def test_an_unreachable_scheduler_is_a_503() -> None:
    port = free_port()  # nothing listens there
    gw = Gateway(SchedulerClient(f"http://127.0.0.1:{port}", KEY), KEY, None)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw), base_url="http://gw.test"
    ) as client:
        for answer in (
            await client.get("/sandboxes/iabc"),
            await client.post("/sandboxes", json={"templateID": "base"}),
        ):
            assert answer.status_code == 503
            assert "scheduler" in answer.json()["message"]
    await gw.aclose()


async def test_an_unreachable_redis_is_a_503_from_the_scheduler() -> None:
    reg = registry(Clock(), RedisStore(f"redis://127.0.0.1:{free_port()}/0"))
    app = create_scheduler_app(reg, KEY)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://scheduler.test"
    ) as client:
        answer = await client.get("/bindings/iabc", headers={"X-API-Key": KEY})
        assert answer.status_code == 503 and "unavailable" in answer.json()["message"]
        beat = await client.post(
            "/heartbeats", json=report("a").model_dump(by_alias=True), headers={"X-API-Key": KEY}
        )
        assert beat.status_code == 503
    await reg.store.aclose()


# -- WebSockets through a served gateway to a served fake node --------------------------------
def test_websockets_pass_through_the_gateway_both_ways() -> None:
    import asyncio

    from websockets.sync.client import connect

    with ServedApp(echo_node()) as node:
        clock = Clock()
        reg = registry(clock)
        scheduler_app = create_scheduler_app(reg, KEY)
        scheduler_client = SchedulerClient(
            "http://scheduler.test", KEY, transport=httpx.ASGITransport(app=scheduler_app)
        )
        gw = Gateway(scheduler_client, KEY, "gw.test")

        async def register() -> None:
            await reg.heartbeat(report("a", url=f"http://127.0.0.1:{node.port}"))
            await reg.bind("iws", "a")

        asyncio.run(register())
        with ServedGateway(gw) as served:
            url = f"ws://127.0.0.1:{served.port}/ws"
            with connect(url, additional_headers={"E2b-Sandbox-Id": "iws"}) as ws:
                assert ws.recv(timeout=10) == f"127.0.0.1:{served.port} iws"
                ws.send("hello")
                assert ws.recv(timeout=10) == "HELLO"
            # By Host name: the node sees the name the client used.
            import socket

            sock = socket.create_connection(("127.0.0.1", served.port))
            with connect("ws://3000-iws.gw.test/ws", sock=sock) as ws:
                assert ws.recv(timeout=10) == "3000-iws.gw.test None"


async def test_connect_moves_a_committed_paused_sandbox_off_a_dead_node(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    client, nodes, reg = gateway
    await reg.bind("ipaused", "a")
    await reg.bind("irunning", "a")
    nodes.down.add("a")
    moved = await client.post("/sandboxes/ipaused/connect", json={"timeout": 60})
    assert moved.status_code == 201 and moved.json() == {"node": "b"}
    assert (await reg.lookup("ipaused")).node_id == "b"  # type: ignore[union-attr]
    # A sandbox no other node can adopt was running there: its node is the answer.
    stuck = await client.post("/sandboxes/irunning/connect")
    assert stuck.status_code == 503 and "node unavailable" in stuck.json()["message"]
    # Bound to no node: any node adopts it if it can, else 404.
    assert (await client.post("/sandboxes/ipnew/connect")).status_code == 201
    assert (await client.post("/sandboxes/inope/connect")).status_code == 404


async def test_creates_and_connects_go_past_nodes_of_another_mode(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    """In a cluster of mixed modes, a node that cannot restore what was saved under
    another VMM or accelerator (409 mode_mismatch) is passed for one that can; with none
    left, its 409 is the answer, and no placement is left reserved."""
    client, nodes, reg = gateway
    nodes.other_mode = {"a"}
    for _ in range(3):
        created = await client.post("/sandboxes", json={"templateID": "saved-elsewhere"})
        assert created.status_code == 201, created.text
        assert created.json()["sandboxID"][1] == "b"
    nodes.other_mode = {"a", "b"}
    refused = await client.post("/sandboxes", json={"templateID": "saved-elsewhere"})
    assert refused.status_code == 409
    assert refused.json()["error_code"] == "mode_mismatch"
    # Only the three sandboxes made hold reservations (until their node's roster shows
    # them): the refused placements were given back.
    held = (await reg.store.reservations()).values()
    assert sorted(r.sandbox_id or "" for r in held) == ["ib0", "ib1", "ib2"]
    # A paused sandbox bound to a node that now runs another mode: adopted by one that
    # runs its own.
    nodes.other_mode = {"a"}
    await reg.bind("ipsaved-elsewhere", "a")
    moved = await client.post("/sandboxes/ipsaved-elsewhere/connect")
    assert moved.status_code == 201 and moved.json() == {"node": "b"}
    assert (await reg.lookup("ipsaved-elsewhere")).node_id == "b"  # type: ignore[union-attr]
    nodes.other_mode = {"a", "b"}
    await reg.bind("ipsaved-elsewhere", "a")
    stuck = await client.post("/sandboxes/ipsaved-elsewhere/connect")
    assert stuck.status_code == 409 and stuck.json()["error_code"] == "mode_mismatch"


async def test_creates_go_past_nodes_whose_host_is_full(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    """A node that refuses a create for what its host can hold now (503
    capacity_exhausted: memory reserve or stalls, which heartbeats do not carry) is
    passed for another; with every node full, the last refusal is the answer and no
    placement is left reserved. Other failures are not retried elsewhere."""
    client, nodes, reg = gateway
    nodes.full = {"a"}
    for _ in range(3):
        created = await client.post("/sandboxes", json={"templateID": "base"})
        assert created.status_code == 201, created.text
        assert created.json()["sandboxID"][1] == "b"
    nodes.full = {"a", "b"}
    refused = await client.post("/sandboxes", json={"templateID": "base"})
    assert refused.status_code == 503
    assert refused.json()["error_code"] == "capacity_exhausted"
    assert "stalled on memory" in refused.json()["message"]
    held = (await reg.store.reservations()).values()
    assert sorted(r.sandbox_id or "" for r in held) == ["ib0", "ib1", "ib2"]
    asked = [n for n, what in nodes.requests if what == "POST /sandboxes"]
    assert asked[-2:] in (["a", "b"], ["b", "a"])  # each node asked once


async def test_gateway_health_is_a_node_health_for_the_cluster(
    gateway: tuple[httpx.AsyncClient, FakeNodes, NodeRegistry],
) -> None:
    from agentenv.client.wire import HEALTH

    client, _, reg = gateway
    await reg.heartbeat(report("a", sandboxes=["i1", "i2"]))
    await reg.heartbeat(report("b", sandboxes=["i3"]))
    auth = {"X-API-Key": KEY}
    answer = await client.get("/health", headers=auth)
    health = HEALTH.validate_python(answer.json())  # what aenv reads
    assert health.status == "ok" and health.sandboxes == 3 and health.vmm == "qemu"
    # Without the key only that it is up; with a wrong one, refused.
    assert (await client.get("/health")).json() == {"status": "ok", "version": __version__}
    assert (await client.get("/health", headers={"X-API-Key": "nope"})).status_code == 401
    reg.clock.now += 60  # type: ignore[attr-defined]
    await reg.heartbeat(report("b"))
    await reg.newly_down()
    degraded = (await client.get("/health", headers=auth)).json()
    assert degraded["status"] == "degraded" and degraded["detail"] == "nodes down: a"
    anonymous = (await client.get("/health")).json()
    assert anonymous == {"status": "degraded", "version": __version__}


def _scheduler_binding(sandbox_id: str, node_id: str, node_url: str) -> SchedulerClient:
    """A client of an in-process scheduler that knows one node, at ``node_url`` (a real
    server), and binds ``sandbox_id`` to it."""
    reg = registry(Clock())

    async def register() -> None:
        await reg.heartbeat(report(node_id, url=node_url))
        await reg.bind(sandbox_id, node_id)

    asyncio.run(register())
    return SchedulerClient(
        "http://scheduler.test",
        KEY,
        transport=httpx.ASGITransport(app=create_scheduler_app(reg, KEY)),
    )


def test_a_client_leaving_a_stream_ends_it_on_the_node() -> None:
    """A node's stream that would run for an hour (a command's output, say) ends on the
    node once the client goes away: the gateway sees the client leave and lets go of it."""
    ended = threading.Event()

    async def endless(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                yield b"first"
                await asyncio.sleep(3600)
            finally:
                ended.set()

        return StreamingResponse(chunks())

    with ServedApp(Starlette(routes=[Route("/{path:path}", endless)])) as node:
        scheduler = _scheduler_binding("istream", "a", node.url)
        with ServedGateway(Gateway(scheduler, KEY, None)) as served:
            with httpx.Client(base_url=served.url, trust_env=False, timeout=60) as client:
                traffic = {"E2b-Sandbox-Id": "istream"}
                with client.stream("GET", "/process", headers=traffic) as answer:
                    assert answer.status_code == 200
                    # Held: an iterator dropped after its first chunk closes the response
                    # (and the connection) as it is collected.
                    chunks = answer.iter_raw()
                    assert next(chunks) == b"first"
                    assert not ended.wait(0.5)
            assert ended.wait(60)  # the client's connection closed with the block


def test_answers_through_the_gateway_carry_one_date() -> None:
    """The node's uvicorn and the gateway's both date their answers: a relayed answer (a
    sandbox's traffic, streamed, or a control route, replayed) keeps only the gateway's."""

    async def dated(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok", headers={"x-node": "a"})

    with ServedApp(Starlette(routes=[Route("/{path:path}", dated)])) as node:
        scheduler = _scheduler_binding("idated", "a", node.url)
        with ServedGateway(Gateway(scheduler, KEY, None)) as served:
            with httpx.Client(base_url=served.url, trust_env=False, timeout=60) as client:
                for answer in (
                    client.get("/health", headers={"E2b-Sandbox-Id": "idated"}),
                    client.get("/sandboxes/idated", headers={"X-API-Key": KEY}),
                ):
                    assert answer.headers["x-node"] == "a", answer.url
                    assert len(answer.headers.get_list("date")) == 1, answer.url


# -- discovery and the scheduler's metrics -------------------------------------------------
def test_a_request_body_keeps_its_framing_through_the_gateway() -> None:
    """A body of a known length (the SDK's Process/Start) reaches the node with that
    Content-Length, not re-chunked (whose end would come as a write of its own that the
    node and the guest wait for); a chunked one stays chunked. Either arrives whole."""
    seen: list[tuple[str | None, str | None, bytes]] = []

    async def record(request: Request) -> PlainTextResponse:
        body = await request.body()
        headers = request.headers
        seen.append((headers.get("content-length"), headers.get("transfer-encoding"), body))
        return PlainTextResponse("ok")

    def chunks() -> Iterator[bytes]:
        yield b"first,"
        yield b"second"

    with ServedApp(Starlette(routes=[Route("/{path:path}", record, methods=["POST"])])) as node:
        scheduler = _scheduler_binding("ibody", "a", node.url)
        with ServedGateway(Gateway(scheduler, KEY, None)) as served:
            with httpx.Client(base_url=served.url, trust_env=False, timeout=60) as client:
                traffic = {"E2b-Sandbox-Id": "ibody"}
                sized = client.post("/process.Process/Start", content=b"x" * 54, headers=traffic)
                chunked = client.post("/files", content=chunks(), headers=traffic)
                assert (sized.status_code, chunked.status_code) == (200, 200)
    assert seen == [("54", None, b"x" * 54), (None, "chunked", b"first,second")]


class FakeDiscoveryApi:
    """kubernetes.client.DiscoveryV1Api's one call the scheduler makes, answering with the
    client's own models."""

    def __init__(self) -> None:
        self.addresses: list[tuple[str, bool]] = []
        self.asked: list[tuple[str, str]] = []

    def list_namespaced_endpoint_slice(self, namespace: str, label_selector: str) -> Any:
        from kubernetes.client import DiscoveryV1EndpointPort as Port
        from kubernetes.client import (
            V1Endpoint,
            V1EndpointConditions,
            V1EndpointSlice,
            V1EndpointSliceList,
            V1ObjectMeta,
        )

        self.asked.append((namespace, label_selector))
        endpoints = [
            V1Endpoint(addresses=[ip], conditions=V1EndpointConditions(ready=ready))
            for ip, ready in self.addresses
        ]
        item = V1EndpointSlice(
            address_type="IPv4",
            endpoints=endpoints,
            ports=[Port(name="metrics", port=9100), Port(name="api", port=8000)],
            metadata=V1ObjectMeta(name="aenv-node-abc"),
        )
        return V1EndpointSliceList(items=[item])


async def test_endpoint_slices_list_ready_nodes_and_vanished_ones_go_down() -> None:
    api = FakeDiscoveryApi()
    api.addresses = [("10.0.0.1", True), ("10.0.0.2", True), ("10.0.0.3", False)]
    discovery = EndpointSliceDiscovery("agentenv", "aenv-node", api=api)
    urls = await discovery.node_urls()
    assert urls == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    assert api.asked == [("agentenv", "kubernetes.io/service-name=aenv-node")]
    reg = registry(Clock())
    for name, url in (("a", "http://10.0.0.1:8000"), ("b", "http://10.0.0.2:8000")):
        await reg.heartbeat(report(name, url=url))
    assert await reg.follow_discovery(urls) == []
    api.addresses = [("10.0.0.1", True)]  # b's pod is gone
    assert await reg.follow_discovery(await discovery.node_urls()) == ["b"]
    assert [n.state for n in await reg.nodes()] == [NodeState.UP, NodeState.DOWN]
    # A node discovery never listed is left to its heartbeats.
    await reg.heartbeat(report("c", url="http://10.0.0.9:8000"))
    assert await reg.follow_discovery({"http://10.0.0.1:8000"}) == []
    # Nodes serving TLS report https:// URLs; discovery's http:// ones match by address.
    await reg.heartbeat(report("b", url="https://10.0.0.2:8000"))
    assert await reg.follow_discovery({"http://10.0.0.1:8000", "http://10.0.0.2:8000"}) == []
    assert await reg.follow_discovery({"http://10.0.0.1:8000"}) == ["b"]


def test_discovery_specs() -> None:
    static = open_discovery("static:http://a:8000,http://b:8000/")
    assert isinstance(static, StaticDiscovery) and static.urls == {"http://a:8000", "http://b:8000"}
    k8s = open_discovery("kubernetes:agentenv/aenv-node:8000")
    assert isinstance(k8s, EndpointSliceDiscovery) and k8s.port == 8000
    assert open_discovery(None) is None
    for bad in ("kubernetes:agentenv", "dns:x", "kubernetes:a/b:port"):
        with pytest.raises(ValueError):
            open_discovery(bad)


async def test_scheduler_metrics_count_placements_and_nodes() -> None:
    reg = registry(Clock(), overcommit=4.0)
    app = create_scheduler_app(reg, KEY)
    transport = httpx.ASGITransport(app=app)
    scheduler = SchedulerClient("http://scheduler.test", KEY, transport=transport)
    await scheduler.heartbeat(report("a"))
    await scheduler.place(PlacementRequest(templateID="base"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://scheduler.test"
    ) as client:
        assert (await client.get("/metrics")).status_code == 401
        answer = await client.get("/metrics", headers={"X-API-Key": KEY})
    await scheduler.aclose()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }
    assert got[("aenv_scheduler_placements_total", (("node", "a"), ("outcome", "placed")))] == 1
    assert got[("aenv_scheduler_nodes", (("state", "up"),))] == 1
    heartbeats = (
        ("component", "scheduler"),
        ("method", "POST"),
        ("route", "/heartbeats"),
        ("status", "200"),
    )
    assert got[("aenv_http_request_duration_seconds_count", heartbeats)] == 1


async def test_scheduler_health_tells_only_the_key_holder_what_it_knows() -> None:
    reg = registry(Clock(), overcommit=4.0)
    app = create_scheduler_app(reg, KEY)
    scheduler = SchedulerClient("http://scheduler.test", KEY, transport=httpx.ASGITransport(app))
    await scheduler.heartbeat(report("a"))
    await scheduler.aclose()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://scheduler.test"
    ) as client:
        anonymous = await client.get("/health")
        wrong = await client.get("/health", headers={"X-API-Key": "nope"})
        holder = await client.get("/health", headers={"X-API-Key": KEY})
    assert anonymous.status_code == 200
    assert anonymous.json() == {"status": "ok", "version": __version__}
    assert wrong.status_code == 401
    assert holder.json() == {"status": "ok", "version": __version__, "nodes": 1, "discovered": 0}

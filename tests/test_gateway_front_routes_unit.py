"""Where the gateway's front sends a sandbox's traffic, against fake nodes served on real
sockets: to the owner by header and by host name, through the route cache (dropped by a
control call or a node's failure, and past a stale entry to the sandbox's new node), a
503 for a node that is down or a scheduler that cannot be reached; answers' heads kept and
no cookies kept between sandboxes. Without VMs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from agentenv.cluster.gateway import Gateway
from agentenv.cluster.gateway_server import GatewayServer
from agentenv.cluster.registry import NodeRegistry
from agentenv.cluster.scheduler import create_scheduler_app
from agentenv.cluster.scheduler_client import SchedulerClient
from tests.cluster_support import KEY, Clock, registry, report
from tests.helpers import free_port


@dataclass
class Node:
    """A node's proxy at the byte level: answers ``from {name}`` to any request, or the
    502 a node's proxy gives for a sandbox it does not hold (``gone``)."""

    name: str
    gone: set[str] = field(default_factory=set)
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    port: int = 0
    listener: asyncio.Server | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self) -> None:
        self.listener = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.listener.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Down: connections refused, the kept ones closed."""
        if self.listener is not None:
            self.listener.close()
            await self.listener.wait_closed()
            self.listener = None
        for writer in self.writers:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                line, *fields = head.decode("latin-1").split("\r\n")[:-2]
                headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                method, target, _ = line.split(" ")
                self.seen.append((f"{method} {target}", headers))
                sandbox = headers.get("e2b-sandbox-id", "")
                if sandbox in self.gone:
                    body, status = f'{{"code":502,"sandbox":"{sandbox}"}}'.encode(), b"502 Bad"
                else:
                    body, status = f"from {self.name}".encode(), b"200 OK"
                cookies = b"set-cookie: a=1; Path=/\r\nset-cookie: b=2; Path=/\r\n"
                extra = cookies if target == "/set-cookies" else b""
                writer.write(
                    b"HTTP/1.1 %b\r\n%bcontent-length: %d\r\n\r\n%b"
                    % (status, extra, len(body), body)
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()


@dataclass
class Setup:
    client: httpx.AsyncClient
    reg: NodeRegistry
    nodes: dict[str, Node]


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    """Nodes ``a`` and ``b`` up, and a gateway served as ``aenv-gateway`` serves it
    (domain ``gw.test``), its route cache kept for a minute."""
    reg = registry(Clock())
    nodes = {name: Node(name) for name in ("a", "b")}
    for node in nodes.values():
        await node.start()
        await reg.heartbeat(report(node.name, url=f"http://127.0.0.1:{node.port}"))
    scheduler = SchedulerClient(
        "http://scheduler.test", KEY, transport=httpx.ASGITransport(create_scheduler_app(reg, KEY))
    )
    port = free_port()
    server = GatewayServer(Gateway(scheduler, KEY, "gw.test", route_cache_s=60), "127.0.0.1", port)
    await server.start()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield Setup(client, reg, nodes)
    await server.stop()
    for node in nodes.values():
        await node.stop()


async def test_traffic_goes_to_the_owner_by_header_and_by_host(setup: Setup) -> None:
    client, reg, nodes = setup.client, setup.reg, setup.nodes
    await reg.bind("i1", "a")
    await reg.bind("i2", "b")
    assert (await client.get("/files", headers={"E2b-Sandbox-Id": "i2"})).text == "from b"
    by_host = await client.get("/", headers={"Host": "8080-i1.gw.test"})
    assert by_host.text == "from a"
    # Host and routing headers reach the node as the client sent them.
    assert nodes["a"].seen[-1][1]["host"] == "8080-i1.gw.test"
    assert nodes["b"].seen[-1][1]["e2b-sandbox-id"] == "i2"
    unknown = await client.get("/", headers={"E2b-Sandbox-Id": "inope"})
    assert unknown.status_code == 502 and "inope" in unknown.json()["message"]


async def test_routes_are_cached_until_a_control_call_or_a_failure(setup: Setup) -> None:
    client, reg, nodes = setup.client, setup.reg, setup.nodes
    traffic = {"E2b-Sandbox-Id": "i1"}
    await reg.bind("i1", "a")
    assert (await client.get("/files", headers=traffic)).text == "from a"
    await reg.bind("i1", "b")  # moved by someone else (another gateway, a heartbeat)
    assert (await client.get("/files", headers=traffic)).text == "from a"  # cached
    await client.get("/sandboxes/i1", headers={"X-API-Key": KEY})  # control: dropped
    assert (await client.get("/files", headers=traffic)).text == "from b"
    await nodes["b"].stop()
    down = await client.get("/files", headers=traffic)
    assert down.status_code == 503 and "node unavailable" in down.json()["message"]
    await reg.bind("i1", "a")
    assert (await client.get("/files", headers=traffic)).text == "from a"  # failure dropped it


async def test_a_stale_route_goes_on_to_the_sandboxs_new_node(setup: Setup) -> None:
    """Another gateway resumed the sandbox on another node within this one's route
    cache: the old node's proxy answers 502, and the request goes to the new owner."""
    client, reg, nodes = setup.client, setup.reg, setup.nodes
    traffic = {"E2b-Sandbox-Id": "i1"}
    await reg.bind("i1", "a")
    assert (await client.get("/files", headers=traffic)).text == "from a"
    await reg.bind("i1", "b")
    nodes["a"].gone.add("i1")
    assert (await client.get("/files", headers=traffic)).text == "from b"
    # A body cannot be sent twice: the stale answer stands, but the route is dropped.
    await reg.bind("i1", "a")
    nodes["b"].gone.add("i1")
    nodes["a"].gone.clear()
    assert (await client.post("/files", headers=traffic, content=b"x")).status_code == 502
    assert (await client.post("/files", headers=traffic, content=b"x")).text == "from a"
    # The owner's own 502 is its answer: nothing is sent twice.
    nodes["a"].gone.add("i1")
    sent = len(nodes["a"].seen) + len(nodes["b"].seen)
    assert (await client.get("/files", headers=traffic)).status_code == 502
    assert len(nodes["a"].seen) + len(nodes["b"].seen) == sent + 1


async def test_a_node_or_scheduler_that_is_not_there_is_503(setup: Setup) -> None:
    client, reg, nodes = setup.client, setup.reg, setup.nodes
    await reg.bind("i1", "a")
    await nodes["a"].stop()
    answer = await client.get("/health", headers={"E2b-Sandbox-Id": "i1"})
    assert answer.status_code == 503 and "node unavailable" in answer.json()["message"]
    # Once the scheduler marks it down the answer is the same, without trying the node.
    reg.clock.now += 60  # type: ignore[attr-defined]
    await reg.heartbeat(report("b", url=f"http://127.0.0.1:{nodes['b'].port}"))
    await reg.newly_down()
    answer = await client.get("/health", headers={"E2b-Sandbox-Id": "i1"})
    assert answer.status_code == 503 and "stopped heartbeating" in answer.json()["message"]


async def test_an_unreachable_scheduler_is_a_503_for_traffic() -> None:
    nowhere = SchedulerClient(f"http://127.0.0.1:{free_port()}", KEY)
    port = free_port()
    server = GatewayServer(Gateway(nowhere, KEY, None), "127.0.0.1", port)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            answer = await client.get("/", headers={"E2b-Sandbox-Id": "iabc"})
            assert answer.status_code == 503 and "scheduler" in answer.json()["message"]
    finally:
        await server.stop()


async def test_answers_keep_their_head_and_no_cookies_are_kept(setup: Setup) -> None:
    client, reg, nodes = setup.client, setup.reg, setup.nodes
    await reg.bind("i1", "a")
    await reg.bind("i2", "a")
    answer = await client.get("/set-cookies", headers={"E2b-Sandbox-Id": "i1"})
    assert answer.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    assert answer.headers["content-length"] == "6" and answer.text == "from a"
    assert "transfer-encoding" not in answer.headers
    # The gateway keeps no cookies: another sandbox's traffic (on the same node) gets none.
    client.cookies.clear()
    assert (await client.get("/files", headers={"E2b-Sandbox-Id": "i2"})).text == "from a"
    assert "cookie" not in nodes["a"].seen[-1][1]

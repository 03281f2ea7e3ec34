"""The gateway's front (``agentenv.cluster.front``) against a fake node written at the
byte level, and a client speaking raw HTTP/1.1: how requests and answers are framed on
the way through (lengths, chunks, keep-alive reuse of node connections, either side
closing mid-answer, heads it refuses, upgrades), without VMs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httptools
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentenv.cluster.gateway import Gateway
from agentenv.cluster.gateway_server import GatewayServer
from agentenv.cluster.scheduler import create_scheduler_app
from agentenv.cluster.scheduler_client import SchedulerClient
from tests.cluster_support import KEY, Clock, registry, report
from tests.helpers import free_port

TIMEOUT = 30
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "FakeNode"], Awaitable[None]]


@dataclass
class FakeNode:
    """A node's proxy answering each connection with ``handler``; what it was sent is
    kept, request by request (heads and bodies as they arrived, framing included)."""

    handler: Handler
    connections: int = 0
    received: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader, node: FakeNode) -> bytes | None:
    """One request off the connection (head and body, as sent), or None at its end."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lowered = head.lower()
    body = b""
    if b"transfer-encoding: chunked" in lowered:
        while not body.endswith(b"0\r\n\r\n"):
            body += await reader.readuntil(b"\r\n")
    elif b"content-length:" in lowered:
        length = int(lowered.split(b"content-length:")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
    node.received.append(head + body)
    return head + body


async def answer_ok(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node: FakeNode
) -> None:
    """Keep-alive answers of a known length, saying which connection answered."""
    while await read_request(reader, node) is not None:
        body = b"connection %d" % node.connections
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()


Start = Callable[[Handler], Awaitable[tuple[FakeNode, int]]]


@pytest.fixture
async def served() -> AsyncIterator[Start]:
    """Start a fake node with a handler and a gateway (front and app) routing sandbox
    ``ifront`` to it (and ``igone`` to a node where nothing listens); gives the node and
    the gateway's port."""
    started: list[tuple[asyncio.Server, GatewayServer]] = []

    async def start(handler: Handler) -> tuple[FakeNode, int]:
        node = FakeNode(handler)
        listener = await asyncio.start_server(node.serve, "127.0.0.1", 0)
        node.port = listener.sockets[0].getsockname()[1]
        reg = registry(Clock())
        await reg.heartbeat(report("a", url=f"http://127.0.0.1:{node.port}"))
        await reg.bind("ifront", "a")
        await reg.heartbeat(report("b", url=f"http://127.0.0.1:{free_port()}"))
        await reg.bind("igone", "b")
        scheduler = SchedulerClient(
            "http://scheduler.test",
            KEY,
            transport=httpx.ASGITransport(app=create_scheduler_app(reg, KEY)),
        )
        port = free_port()
        server = GatewayServer(Gateway(scheduler, KEY, "gw.test"), "127.0.0.1", port)
        await server.start()
        started.append((listener, server))
        return node, port

    yield start
    for listener, server in started:
        await server.stop()
        listener.close()


class Client:
    """A raw HTTP/1.1 connection to the gateway; answers read with llhttp."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Client:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def answer(self) -> tuple[int, dict[bytes, bytes], bytes, list[bytes]]:
        """The next answer: status, headers (lower-cased), body, and the body's pieces as
        the parser gave them."""
        done = asyncio.Event()
        headers: dict[bytes, bytes] = {}
        pieces: list[bytes] = []

        class Callbacks:
            def on_header(self, name: bytes, value: bytes) -> None:
                headers[name.lower()] = value

            def on_body(self, body: bytes) -> None:
                pieces.append(body)

            def on_message_complete(self) -> None:
                done.set()

        parser = httptools.HttpResponseParser(Callbacks())
        while not done.is_set():
            data = await asyncio.wait_for(self.reader.read(65536), TIMEOUT)
            if not data:
                raise ConnectionError("the gateway closed the connection mid-answer")
            parser.feed_data(data)
        return parser.get_status_code(), headers, b"".join(pieces), pieces

    async def closed(self) -> bool:
        """Whether the gateway closes the connection (what is left unread is dropped)."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), TIMEOUT):
                pass
        except ConnectionError:
            pass
        return True

    def close(self) -> None:
        self.writer.close()


TRAFFIC = b"E2b-Sandbox-Id: ifront\r\n"


async def test_answers_of_known_length_reuse_one_node_connection(served: Start) -> None:
    node, port = await served(answer_ok)
    first, second = await Client.open(port), await Client.open(port)
    for client in (first, second, first):
        client.send(b"GET /health HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n")
        status, headers, body, _ = await client.answer()
        assert (status, body, headers[b"content-length"]) == (200, b"connection 1", b"12")
    assert node.connections == 1
    # The head went on as the client sent it (Host and routing headers kept).
    assert node.received[0] == b"GET /health HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n"
    first.close()
    second.close()


async def test_connection_headers_stay_behind_and_a_body_keeps_its_framing(served: Start) -> None:
    node, port = await served(answer_ok)
    client = await Client.open(port)
    client.send(
        b"POST /process.Process/Start HTTP/1.1\r\nHost: gw\r\n"
        + TRAFFIC
        + b"Connection: keep-alive\r\nKeep-Alive: 5\r\nContent-Length: 5\r\n\r\nhello"
    )
    assert (await client.answer())[0] == 200
    client.send(
        b"POST /files HTTP/1.1\r\nHost: gw\r\n"
        + TRAFFIC
        + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    assert (await client.answer())[0] == 200
    sized, chunked = node.received
    assert b"connection" not in sized.lower() and b"keep-alive" not in sized.lower()
    assert sized.endswith(b"Content-Length: 5\r\n\r\nhello")
    assert chunked.endswith(b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    client.close()


async def test_a_chunked_stream_comes_through_as_it_is_written(served: Start) -> None:
    go_on = asyncio.Event()

    async def stream(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node: FakeNode
    ) -> None:
        while await read_request(reader, node) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()
            await go_on.wait()  # the first chunk must reach the client before this
            writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
            await writer.drain()

    node, port = await served(stream)
    client = await Client.open(port)
    client.send(b"GET /stream HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n")
    first = await asyncio.wait_for(client.reader.readuntil(b"first\r\n"), TIMEOUT)
    assert first.startswith(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked")
    go_on.set()
    assert await asyncio.wait_for(client.reader.readuntil(b"0\r\n\r\n"), TIMEOUT) == (
        b"6\r\nsecond\r\n0\r\n\r\n"
    )
    # The answer ended whole: the next request goes over the same node connection.
    go_on.clear()
    client.send(b"GET /stream HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n")
    await asyncio.wait_for(client.reader.readuntil(b"first\r\n"), TIMEOUT)
    assert node.connections == 1
    client.close()


async def test_a_node_breaking_off_an_answer_ends_the_clients_connection(served: Start) -> None:
    async def broken(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node: FakeNode
    ) -> None:
        await read_request(reader, node)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()

    _node, port = await served(broken)
    client = await Client.open(port)
    client.send(b"GET /files HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n")
    with pytest.raises(ConnectionError):
        await client.answer()  # never looks complete


async def test_a_client_leaving_mid_stream_closes_the_node_connection(served: Start) -> None:
    async def endless(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node: FakeNode
    ) -> None:
        await read_request(reader, node)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()  # until the gateway closes the connection
        node.closed.set()

    node, port = await served(endless)
    client = await Client.open(port)
    client.send(b"GET /stream HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n")
    await asyncio.wait_for(client.reader.readuntil(b"first\r\n"), TIMEOUT)
    client.writer.transport.abort()
    await asyncio.wait_for(node.closed.wait(), TIMEOUT)


async def test_a_kept_connection_the_node_closed_is_replaced(served: Start) -> None:
    async def once(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node: FakeNode
    ) -> None:
        await read_request(reader, node)
        # Says nothing of closing, then closes as soon as the answer is sent.
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    node, port = await served(once)
    client = await Client.open(port)
    for _ in range(3):
        client.send(b"GET /health HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n")
        assert (await client.answer())[:3:2] == (200, b"ok")
    assert node.connections == 3
    client.close()


async def test_heads_the_front_cannot_take_are_refused_in_json(served: Start) -> None:
    node, port = await served(answer_ok)
    client = await Client.open(port)
    client.send(b"GET /health HTTP/1.1\r\nHost: gw\r\nBad Header: x\r\n\r\n")
    status, headers, body, _ = await client.answer()
    assert status == 400 and headers[b"content-type"] == b"application/json"
    assert json.loads(body)["code"] == 400
    assert await client.closed()
    client = await Client.open(port)
    client.send(
        b"GET /health HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"X-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    )
    status, _, body, _ = await client.answer()
    assert status == 431 and "exceed" in json.loads(body)["message"]
    assert await client.closed()
    assert node.received == []


async def test_an_upgrade_becomes_a_pipe_both_ways(served: Start) -> None:
    async def echo(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node: FakeNode
    ) -> None:
        await read_request(reader, node)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\nhi"
        )
        while data := await reader.read(65536):
            writer.write(data.upper())
            await writer.drain()
        node.closed.set()

    node, port = await served(echo)
    client = await Client.open(port)
    client.send(
        b"GET /ws HTTP/1.1\r\nHost: gw\r\n"
        + TRAFFIC
        + b"Connection: Upgrade\r\nUpgrade: x\r\n\r\nearly bytes;"
    )
    head = await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    assert head.startswith(b"HTTP/1.1 101")
    assert await asyncio.wait_for(client.reader.readexactly(14), TIMEOUT) == b"hiEARLY BYTES;"
    client.send(b"more")
    assert await asyncio.wait_for(client.reader.readexactly(4), TIMEOUT) == b"MORE"
    assert b"upgrade: x" in node.received[0].lower()
    client.close()
    await asyncio.wait_for(node.closed.wait(), TIMEOUT)


async def test_a_node_that_is_not_there_is_503_and_the_api_goes_to_the_app(served: Start) -> None:
    _node, port = await served(answer_ok)
    client = await Client.open(port)
    # The app (the API): anonymous /health, and a pipelined second request in its turn.
    client.send(
        b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
        + b"GET /health HTTP/1.1\r\nHost: gw\r\n"
        + TRAFFIC
        + b"\r\n"
    )
    status, _, body, _ = await client.answer()
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert (await client.answer())[2] == b"connection 1"
    client.send(b"GET /metrics HTTP/1.1\r\nHost: gw\r\nX-API-Key: " + KEY.encode() + b"\r\n\r\n")
    status, _, body, _ = await client.answer()
    samples = {
        (s.name, s.labels.get("route"), s.labels.get("status")): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("aenv_http_request_duration_seconds_count", "sandbox-traffic", "200")] == 1
    # A sandbox whose node does not answer (nothing listens there) is a 503.
    client.send(b"GET /health HTTP/1.1\r\nHost: gw\r\nE2b-Sandbox-Id: igone\r\n\r\n")
    status, _, body, _ = await client.answer()
    assert status == 503 and "node unavailable" in json.loads(body)["message"]
    # One bound to no node is what a node's proxy answers for a sandbox it lacks.
    client.send(b"GET /health HTTP/1.1\r\nHost: 49983-inone.gw.test\r\n\r\n")
    assert (await client.answer())[0] == 502
    client.close()


async def test_a_slow_reader_slows_the_node_and_the_connection_serves_on(served: Start) -> None:
    """Nothing is buffered on the way: while the client reads nothing the node's writes
    stall (within the sockets' own buffers), and once the client reads, all of it comes,
    after which the node connection serves the next request."""
    total = 64 * 1024 * 1024
    chunk = b"x" * 65536
    written: list[int] = [0]

    async def big(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node: FakeNode
    ) -> None:
        while await read_request(reader, node) is not None:
            if len(node.received) > 1:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
            for _ in range(total // len(chunk)):
                writer.write(chunk)
                await writer.drain()
                written[0] += len(chunk)

    node, port = await served(big)
    client = await Client.open(port)
    client.send(b"GET /files HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n")
    last = -1
    for _ in range(300):  # until the node's writes stop moving
        await asyncio.sleep(0.1)
        if written[0] == last and written[0] > 0:
            break
        last = written[0]
    assert 0 < written[0] < total // 2
    received = 0
    head = await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    assert head.startswith(b"HTTP/1.1 200")
    while received < total:
        received += len(await asyncio.wait_for(client.reader.read(1 << 20), TIMEOUT))
    assert received == total
    client.send(b"GET /health HTTP/1.1\r\nHost: gw\r\n" + TRAFFIC + b"\r\n")
    assert (await client.answer())[2] == b"ok"
    assert node.connections == 1
    client.close()

"""The gateway's transport to nodes (aiohttp under an httpx transport) against a real
server: requests arrive as they came, answers come back as the node sent them, bodies
stream both ways, connections are reused only when an answer was read to its end, and
failures are httpx errors (which the gateway maps to 503s)."""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from agentenv.cluster.node_transport import AiohttpNodeTransport
from agentenv.cluster.tls import client_context
from tests.cluster_support import ServedApp
from tests.helpers import free_port

WAIT_S = 60  # generous: the machine running the tests may be loaded


class RecordingNode:
    """A node (an ASGI app) recording what it is sent, answering by path."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.first_chunk_in = threading.Event()
        self.first_chunk_out = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        record: dict[str, Any] = {
            "raw_path": scope["raw_path"],
            "query": scope["query_string"],
            "headers": scope["headers"],
            "client_port": scope["client"][1],
            "body": b"",
        }
        self.seen.append(record)
        while True:
            message = await receive()
            record["body"] += message.get("body", b"")
            if record["body"]:
                self.first_chunk_in.set()
            if not message.get("more_body"):
                break
        if path == "/gzip":
            body = gzip.compress(b"x" * 100)
            head = [(b"content-encoding", b"gzip"), (b"content-length", str(len(body)).encode())]
            head += [(b"set-cookie", b"a=1; Path=/"), (b"set-cookie", b"b=2; Path=/")]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": body})
        elif path == "/two-parts":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await asyncio.to_thread(self.first_chunk_out.wait, WAIT_S)
            await send({"type": "http.response.body", "body": b"second"})
        elif path == "/long":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(64):
                await send({"type": "http.response.body", "body": b"l" * 65536, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/big-head":
            # Over aiohttp's defaults (8190 bytes a header, 128 headers), under 16 KiB.
            head = [(b"x-big", b"b" * 9000)] + [(b"x-%d" % i, b"v") for i in range(200)]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": b"big"})
        elif path == "/broken":
            head = [(b"content-length", b"100")]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": b"only ten b", "more_body": True})
            raise RuntimeError("the node breaks off")  # uvicorn drops the connection
        else:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": record["body"] or b"ok"})


@pytest.fixture
def node() -> Iterator[tuple[RecordingNode, str]]:
    app = RecordingNode()
    with ServedApp(app) as served:
        yield app, served.url


@pytest.fixture
async def transport() -> AsyncIterator[AiohttpNodeTransport]:
    sent = AiohttpNodeTransport(client_context(None))
    yield sent
    await sent.aclose()


async def send(
    transport: AiohttpNodeTransport, method: str, url: str, **request: Any
) -> httpx.Response:
    timeout = httpx.Timeout(connect=10.0, read=None, write=None, pool=None)
    sent = httpx.Request(method, url, extensions={"timeout": timeout.as_dict()}, **request)
    return await transport.handle_async_request(sent)


async def test_requests_reach_the_node_as_they_came(
    node: tuple[RecordingNode, str], transport: AiohttpNodeTransport
) -> None:
    app, url = node
    headers = [("host", "49983-isbx.gw.test"), ("x-rep", "1"), ("x-rep", "2")]
    answer = await send(transport, "GET", f"{url}/a%2Fb/c?x=1&y=%20z", headers=headers)
    assert await answer.aread() == b"ok"
    seen = app.seen[-1]
    assert seen["raw_path"] == b"/a%2Fb/c" and seen["query"] == b"x=1&y=%20z"
    names = [k for k, _ in seen["headers"]]
    assert (b"host", b"49983-isbx.gw.test") in seen["headers"]
    assert [v for k, v in seen["headers"] if k == b"x-rep"] == [b"1", b"2"]
    # Nothing of the client's own: the node sees what the gateway's client sent.
    for added in (b"user-agent", b"accept", b"accept-encoding", b"content-type", b"cookie"):
        assert added not in names


async def test_answers_come_back_as_the_node_sent_them_and_no_cookie_is_kept(
    node: tuple[RecordingNode, str], transport: AiohttpNodeTransport
) -> None:
    app, url = node
    answer = await send(transport, "GET", f"{url}/gzip")
    assert answer.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    raw = b"".join([chunk async for chunk in answer.aiter_raw()])
    assert raw == gzip.compress(b"x" * 100)  # not decompressed: relayed as it is
    await answer.aclose()
    await (await send(transport, "GET", f"{url}/plain")).aread()
    assert b"cookie" not in [k for k, _ in app.seen[-1]["headers"]]
    big = await send(transport, "GET", f"{url}/big-head")
    assert big.headers["x-big"] == "b" * 9000 and big.headers["x-199"] == "v"
    assert await big.aread() == b"big"


async def test_bodies_stream_both_ways_unbuffered(
    node: tuple[RecordingNode, str], transport: AiohttpNodeTransport
) -> None:
    app, url = node

    async def upload() -> AsyncIterator[bytes]:
        yield b"part one,"
        # The second part is only sent once the node has the first: a transport that
        # read the whole body before sending would wait here for ever.
        assert await asyncio.to_thread(app.first_chunk_in.wait, WAIT_S)
        yield b"part two"

    answer = await send(transport, "POST", f"{url}/echo", content=upload())
    assert await answer.aread() == b"part one,part two"
    assert (b"transfer-encoding", b"chunked") in app.seen[-1]["headers"]
    sized = await send(transport, "PUT", f"{url}/echo", content=b"12345")
    assert await sized.aread() == b"12345"
    assert (b"content-length", b"5") in app.seen[-1]["headers"]

    streamed = await send(transport, "GET", f"{url}/two-parts")
    chunks = streamed.aiter_raw()
    assert await chunks.__anext__() == b"first"  # before the node sends the rest
    app.first_chunk_out.set()
    assert b"".join([chunk async for chunk in chunks]) == b"second"
    await streamed.aclose()


async def test_connections_are_reused_only_after_a_whole_answer(
    node: tuple[RecordingNode, str], transport: AiohttpNodeTransport
) -> None:
    app, url = node
    for _ in range(5):
        await (await send(transport, "GET", f"{url}/plain")).aread()
    # One connection, unless the server's keep-alive ran out in a stall of a loaded machine.
    assert len({seen["client_port"] for seen in app.seen}) < 5
    cut = await send(transport, "GET", f"{url}/long")
    await cut.aiter_raw().__anext__()
    await cut.aclose()  # left mid-body: its connection holds the rest, and is closed
    after = await send(transport, "GET", f"{url}/plain")
    assert await after.aread() == b"ok"
    assert app.seen[-1]["client_port"] != app.seen[-2]["client_port"]


async def test_failures_are_httpx_errors(
    node: tuple[RecordingNode, str], transport: AiohttpNodeTransport
) -> None:
    _app, url = node
    with pytest.raises(httpx.ConnectError):
        await send(transport, "GET", f"http://127.0.0.1:{free_port()}/health")
    broken = await send(transport, "GET", f"{url}/broken")
    with pytest.raises(httpx.ReadError):
        await broken.aread()
    await broken.aclose()
    assert await (await send(transport, "GET", f"{url}/plain")).aread() == b"ok"

"""The HTTP/1.1 protocol the servers run (agentenv.api.http_protocol), served by uvicorn on
uvloop with a one-route app, spoken to over raw sockets: a normalising client could not
send a malformed request line, nor keep writing a head after the server refused it."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from agentenv.api.http_protocol import DEFAULT_MAX_HEAD_BYTES, JsonErrorsHttpToolsProtocol

HEAD_LIMIT = 64 * 1024
# The most a server reads at once (uvloop's and asyncio's buffers): a head that arrives
# whole in one read is parsed before it is counted.
ONE_READ = 256 * 1024


async def echo_sizes(scope: Any, receive: Any, send: Any) -> None:
    """Answers with how many header and body bytes the request reached the app with, and
    its raw path."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    head = sum(len(name) + len(value) for name, value in scope["headers"])
    raw_path = scope["raw_path"].decode("latin-1")
    answer = json.dumps({"head": head, "body": len(body), "raw_path": raw_path}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(answer)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": answer})


async def serve(**options: Any) -> AsyncIterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        echo_sizes, http=JsonErrorsHttpToolsProtocol, log_level="critical", **options
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:  # noqa: ASYNC110 (uvicorn offers no event for it)
        await asyncio.sleep(0.01)
    try:
        yield int(listener.getsockname()[1])
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async for bound in serve(h11_max_incomplete_event_size=HEAD_LIMIT):
        yield bound


@pytest.fixture
async def default_port() -> AsyncIterator[int]:
    async for bound in serve():
        yield bound


async def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` (as much of it as the server reads) and everything answered until
    the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
    except ConnectionError:
        pass  # refused mid-request: the answer was written before the close
    answer = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 60):
            answer += chunk
    except ConnectionError:
        pass
    writer.close()
    return answer


def answers(raw: bytes) -> list[tuple[int, dict[str, str], Any]]:
    """Each (status, headers, JSON body) in ``raw``, in order."""
    parsed = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines)
        length = int(headers["content-length"])
        parsed.append((int(status_line.split()[1]), headers, json.loads(raw[:length])))
        raw = raw[length:]
    return parsed


async def test_an_unparseable_request_is_a_json_400(port: int) -> None:
    [(status, headers, body)] = answers(
        await exchange(port, b"GET /x?x=\x01y HTTP/1.1\r\nHost: x\r\n\r\n")
    )
    assert status == 400 and body["code"] == 400 and body["message"]
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"


async def test_a_head_within_the_limit_reaches_the_app_whole(port: int) -> None:
    padding = b"a" * (HEAD_LIMIT // 2)
    raw = await exchange(
        port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-P: " + padding + b"\r\n\r\n"
    )
    [(status, _, body)] = answers(raw)
    assert status == 200 and body["head"] > len(padding)


@pytest.mark.parametrize("size", [HEAD_LIMIT + 2 * ONE_READ, 64 * HEAD_LIMIT])
async def test_a_head_over_the_limit_is_a_json_431_before_the_app(port: int, size: int) -> None:
    raw = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-P: " + b"a" * size + b"\r\n\r\n")
    [(status, headers, body)] = answers(raw)
    assert status == 431 and body["code"] == 431 and str(HEAD_LIMIT) in body["message"]
    assert headers["connection"] == "close"


async def test_without_a_setting_the_head_bound_is_h11s_default(default_port: int) -> None:
    over = b"a" * (DEFAULT_MAX_HEAD_BYTES + 2 * ONE_READ)
    raw = await exchange(default_port, b"GET / HTTP/1.1\r\nHost: x\r\nX-P: " + over + b"\r\n\r\n")
    [(status, _, _)] = answers(raw)
    assert status == 431


async def test_bodies_do_not_count_towards_the_head_on_a_kept_alive_connection(
    port: int,
) -> None:
    """Bodies many times the head limit, then a head near it, one after the other on the
    same connection: each head is counted from its own request's start."""
    body = b"b" * (8 * HEAD_LIMIT)
    post = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    near_limit = b"X-P: " + b"a" * (HEAD_LIMIT // 2) + b"\r\n"
    get = b"GET / HTTP/1.1\r\nHost: x\r\n" + near_limit + b"\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = []
    try:
        for request in (post, post, get, post):
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            [(status, _, answer)] = answers(head + await reader.readexactly(length))
            got.append((status, answer["body"]))
    finally:
        writer.close()
    assert got == [(200, len(body)), (200, len(body)), (200, 0), (200, len(body))]


async def test_a_target_that_is_not_a_path_reaches_the_app_whole(port: int) -> None:
    """Absolute-form is kept as h11 keeps it, for the proxy's path check to refuse: cut
    down to its path it would look like an ordinary request for that path."""
    for target, raw_path in (
        (b"http://127.0.0.1/init?a=1", "http://127.0.0.1/init"),
        (b"/plain?a=1", "/plain"),
    ):
        request = b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        [(status, _, body)] = answers(await exchange(port, request))
        assert (status, body["raw_path"]) == (200, raw_path)

"""Relaying one HTTP exchange or WebSocket to an upstream, the part the node's sandbox
proxy (``forward``: client to guest) and the cluster gateway (``agentenv.cluster.gateway``:
client to node) share: which headers are the connection's, the bound on a request head,
whether a request has a body to stream, the response head passed back, refusals as JSON,
and the two pumps of a relayed WebSocket.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import httpx
import websockets
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection

# Connection-scoped headers (RFC 9110 §7.6.1): never forwarded.
CONNECTION_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    }
)
# Not forwarded by a relay through an HTTP client: the connection's own, and the ones
# the client recomputes.
HOP_BY_HOP = CONNECTION_HEADERS | {"transfer-encoding", "host", "content-length"}
# The same bound h11 (and so envd) applies to a request head.
MAX_HEADER_BYTES = 16 * 1024


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str

    def response(self) -> Response:
        return JSONResponse({"code": self.status, "message": self.message}, status_code=self.status)


def oversized_head(scope: Scope) -> Refusal | None:
    """A 431 for request headers over :data:`MAX_HEADER_BYTES`. (The servers' own HTTP
    protocol, agentenv.api.http_protocol, reads heads up to 1 MiB so that this answer,
    rather than a closed connection, is what a client gets.)"""
    header_bytes = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
    if header_bytes > MAX_HEADER_BYTES:
        return Refusal(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
    return None


async def refuse(scope: Scope, receive: Receive, send: Send, refusal: Refusal) -> None:
    """Answer an HTTP request or a WebSocket handshake with ``refusal``."""
    if scope["type"] == "http":
        await refusal.response()(scope, receive, send)
    else:
        await receive()
        await deny_websocket(send, refusal)


def has_body(method: str, headers: Headers) -> bool:
    """Whether a request's body is to be streamed on (a GET says so by its headers)."""
    return method not in ("GET", "HEAD", "OPTIONS") or (
        "content-length" in headers or "transfer-encoding" in headers
    )


def response_headers(upstream: httpx.Response) -> dict[str, str]:
    """The upstream's response headers a client is given."""
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


async def deny_websocket(send: Send, refusal: Refusal) -> None:
    # The "websocket.http.response" extension lets the client see a real HTTP status.
    await send(
        {
            "type": "websocket.http.response.start",
            "status": refusal.status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    body = JSONResponse({"code": refusal.status, "message": refusal.message}).body
    await send({"type": "websocket.http.response.body", "body": body})


async def pump_websocket(
    receive: Receive,
    send: Send,
    upstream: ClientConnection,
    until: Awaitable[Any] | None = None,
) -> None:
    """Accept the client's WebSocket and relay messages both ways until either side
    closes (or ``until`` completes); the pumps' outcomes are collected, the finished
    one's too (a client gone mid-send is how a relay ends)."""
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
    pumps = [
        asyncio.create_task(_client_to_upstream(receive, upstream)),
        asyncio.create_task(_upstream_to_client(upstream, send)),
    ]
    waiters: list[asyncio.Future[Any]] = list(pumps)
    if until is not None:
        waiters.append(asyncio.ensure_future(until))
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pumps:
        task.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)


async def _client_to_upstream(receive: Receive, upstream: ClientConnection) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "websocket.receive":
            data = message.get("bytes")
            await upstream.send(data if data is not None else message.get("text") or "")
        elif message["type"] == "websocket.disconnect":
            await upstream.close(_sendable_close_code(message.get("code")))
            return


async def _upstream_to_client(upstream: ClientConnection, send: Send) -> None:
    with contextlib.suppress(websockets.exceptions.ConnectionClosed):
        async for data in upstream:
            if isinstance(data, bytes):
                await send({"type": "websocket.send", "bytes": data})
            else:
                await send({"type": "websocket.send", "text": data})
    await send({"type": "websocket.close", "code": _sendable_close_code(upstream.close_code)})


def _sendable_close_code(code: int | None) -> int:
    """Codes such as 1005 (no status) and 1006 (abnormal closure) describe what happened
    to a connection but may never be sent in a close frame (RFC 6455 §7.4.1)."""
    if code is not None and (1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999):
        return code
    return 1000

"""What the gateway's app relays itself: one request sent on to a node as it came (raw
path, query, headers but the connection's, body streamed), the node's answer relayed back
as it arrives. That is the control plane's routes that go to one node (a sandbox's own
routes, templates, snapshots), and, only when the app is served without its front (in
process, as the routing unit tests serve it), a sandbox's HTTP traffic: ``aenv-gateway``
relays that in its front (``front``), byte for byte, and sends the app none.

Requests go straight to the connection pool (an ``httpx`` transport with aiohttp's pool
under it, ``node_transport``), without the client layer's cookie jar, redirects and auth
(a shared cookie jar would also hand one sandbox's cookies to requests for another); the
node's response head is passed on as raw header pairs (repeated ones such as
``Set-Cookie`` kept), with its ``Content-Length`` when it has one, so that a body the node
breaks off ends the client's connection instead of looking complete. A request body keeps
its client's ``Content-Length`` the same way (see ``node_headers``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from agentenv.proxy.relay import HOP_BY_HOP

log = logging.getLogger("agentenv.cluster.gateway")

# No overall timeout: streams (process output, downloads) may run for long.
NODE_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=None, pool=None)
_TIMEOUTS = NODE_TIMEOUT.as_dict()
# Hop-by-hop headers are the connection's; Host is kept, so a node routes
# `{port}-{id}.{domain}` names as it would have without the gateway.
NOT_FORWARDED = HOP_BY_HOP - {"host"}
# What of a node's response head is not passed on. Its Content-Length is (see
# relayed_headers); its Date is not, the gateway's own uvicorn adds one (an answer with
# two would otherwise go out).
_NOT_RELAYED = frozenset(name.encode() for name in HOP_BY_HOP - {"content-length"} | {"date"})


class NodeUnavailable(Exception):
    def __init__(self, node_id: str, reason: str, sandbox_id: str | None = None) -> None:
        subject = f"sandbox {sandbox_id} is on node {node_id}" if sandbox_id else f"node {node_id}"
        super().__init__(f"node unavailable: {subject}, which {reason}")
        self.node_id = node_id
        self.reason = reason
        self.sandbox_id = sandbox_id


def node_headers(headers: Headers, *, body: bool = False) -> list[tuple[str, str]]:
    """A request's headers as they go on to a node; with ``body`` (the client's body is
    sent on, whole or streamed), its ``Content-Length`` too, unless ``Transfer-Encoding``
    frames it. A body whose length went unsaid would go on chunked, its end a write of
    its own that the node, and the guest after it, wait for before they answer: one more
    read on every hop for each command (the SDK's Process/Start)."""
    sized = body and "transfer-encoding" not in headers
    return [
        (k, v)
        for k, v in headers.items()
        if k not in NOT_FORWARDED or (sized and k == "content-length")
    ]


async def send_to_node(
    transport: httpx.AsyncBaseTransport,
    method: str,
    url: httpx.URL,
    headers: list[tuple[str, str]],
    content: Any,
) -> httpx.Response:
    """The request sent through ``transport``, its response head read (the body is
    streamed: close the response)."""
    request = httpx.Request(
        method, url, headers=headers, content=content, extensions={"timeout": _TIMEOUTS}
    )
    response = await transport.handle_async_request(request)
    response.request = request
    return response


def relayed_headers(upstream: httpx.Response) -> list[tuple[bytes, bytes]]:
    """The node's response headers a client is given, as raw pairs. Its Content-Length
    stays unless it also sent Transfer-Encoding (then the length is not the body's)."""
    pairs = upstream.headers.raw
    chunked = any(k.lower() == b"transfer-encoding" for k, _ in pairs)
    return [
        (k, v)
        for k, v in pairs
        if k.lower() not in _NOT_RELAYED and not (chunked and k.lower() == b"content-length")
    ]


class RelayedAnswer:
    """An ASGI answer: the node's response as it arrives, its body unbuffered (each chunk
    sent on before the next is read, so a slow client slows the node instead of filling
    memory). A client that goes away ends it, and the node's response is closed either
    way."""

    def __init__(self, upstream: httpx.Response, node_id: str) -> None:
        self.upstream = upstream
        self.node_id = node_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.upstream.status_code,
                    "headers": relayed_headers(self.upstream),
                }
            )
            # The body is pumped in a task of its own so that a client's disconnect (which
            # only `receive` tells) ends a stream the node is in no hurry to finish.
            pump = asyncio.ensure_future(self._pump(send))
            left = asyncio.ensure_future(_client_left(receive))
            await asyncio.wait((pump, left), return_when=asyncio.FIRST_COMPLETED)
            for task in (pump, left):
                task.cancel()
            pumped, _ = await asyncio.gather(pump, left, return_exceptions=True)
            if isinstance(pumped, Exception):
                raise pumped  # uvicorn logs it and drops the connection mid-answer
        finally:
            await self.upstream.aclose()

    async def _pump(self, send: Send) -> None:
        async for chunk in _body(self.upstream, self.node_id):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _client_left(receive: Receive) -> None:
    """Returns once the client is gone (or, with uvicorn, once the answer is complete)."""
    message: Message = await receive()
    while message["type"] != "http.disconnect":
        message = await receive()


async def _body(upstream: httpx.Response, node_id: str) -> AsyncIterator[bytes]:
    """The node's body as it arrives. Its status line is on its way already, so a node
    that breaks off can only end the stream early."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("node %s broke off a response: %s", node_id, exc)

"""The gateway's port: what ``aenv-gateway`` listens on. It reads each request's head
itself (llhttp, through httptools), and relays the request at the byte level:

- a sandbox's traffic (``E2b-Sandbox-Id`` headers, ``{port}-{id}.{domain}`` hosts) to its
  node's proxy, found through the gateway's route cache;
- everything else (the API, ``/health``, ``/metrics``, signed ``/files`` URLs naming no
  sandbox) to the gateway's ASGI app (:class:`~agentenv.cluster.gateway.Gateway`), which
  uvicorn serves on a Unix socket in a directory only this process can enter.

Why in front of uvicorn and not inside the app: relayed through ASGI, each chunk of a
Connect stream went aiohttp, httpx stream, Starlette response, uvicorn, a few coroutine
switches and copies each, and that Python was most of what the gateway added to an envd
call (``bench/cluster.py``: about 1.8 ms of CPU a command, on a host whose cores the
guests' TCG threads want too). Here a request head is parsed once, sent on as one write
to a pooled keep-alive connection (``upstreams``), and the body bytes go each way as they
are read, in the transports' callbacks. Handing non-traffic requests to uvicorn over a
socket, rather than driving uvicorn's protocol objects from here, keeps the app served
exactly as uvicorn serves any app (lifespan, keep-alive, WebSockets, its HTTP parsing)
through its public API only; the control plane pays one local hop for it (a fraction of
a millisecond on calls that take far longer on the node).

The request head going on is the client's, less what belongs to its connection
(``Connection``, ``Keep-Alive``, ``TE``, ``Trailer``, ``Proxy-*``, ``Expect``: the front
answers ``100 Continue`` itself); ``Host`` is kept, so a node routes host names as it
would without the gateway. A body keeps its framing: one of a known length goes on as
it came, a chunked one is chunked again as it is read. The response comes back as the
node sent it (its ``Date`` and ``Server`` the only ones). A request head over
:data:`~agentenv.proxy.relay.MAX_HEADER_BYTES` of headers is a JSON 431, an unparsable
one a JSON 400 (the connection closed after either); a sandbox whose node is down or
does not answer is a 503 "node unavailable", one bound to no node a 502 (what a node's
proxy answers for a sandbox it does not hold). An upgrade (WebSocket) is relayed the
same way, and once the node answers 101 both connections are one pipe until either
closes.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import httptools
from starlette.datastructures import Headers

from agentenv.cluster.scheduler_client import SchedulerRefused, SchedulerUnavailable
from agentenv.cluster.traffic import NodeUnavailable
from agentenv.cluster.upstreams import Upstream, UpstreamConnection, UpstreamFailed, UpstreamPool
from agentenv.proxy.forward import target_of
from agentenv.proxy.relay import CONNECTION_HEADERS, MAX_HEADER_BYTES

if TYPE_CHECKING:
    from agentenv.cluster.gateway import Gateway
    from agentenv.cluster.models import NodeInfo

log = logging.getLogger("agentenv.cluster.gateway")

#: Request header names the front does not send on (lower-cased): the connection's own,
#: and Expect (the front answers 100 Continue itself). For an upgrade, Connection and
#: Upgrade go on (the node's proxy answers the upgrade).
_CONNECTION_HEADERS = frozenset(name.encode() for name in CONNECTION_HEADERS | {"expect"})
_UPGRADE_HEADERS = frozenset({b"connection", b"upgrade"})
#: A request head's bytes read before it is refused whatever its headers add up to
#: (bounds the memory a client can make the front hold, as the app's protocol does).
MAX_HEAD_READ_BYTES = 1024 * 1024
#: Request body bytes held while the request waits for its upstream, before the client
#: is no longer read.
_MAX_BUFFERED = 256 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Exchange:
    """One request: its head as it goes on, and its body, held until an upstream takes
    it and written to that upstream from then on."""

    def __init__(
        self,
        client: ClientConnection,
        head: bytes,
        lowered: list[tuple[bytes, bytes]],
        method: bytes,
    ) -> None:
        self.client = client
        self.head = head
        self.headers = lowered
        self.method = method
        self.keep_alive = False
        self.upgrade = False
        self.chunked = False
        self.has_body = False
        self.expects_continue = False
        self.body_complete = False
        self.refusal: tuple[int, str] | None = None
        self.sent_body = False
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._upstream: UpstreamConnection | None = None
        self._discard = False

    def body(self, data: bytes) -> None:
        if self._discard:
            return
        if self._upstream is not None:
            self.sent_body = True
            self._upstream.write(data)
            return
        self._held.append(data)
        self._held_bytes += len(data)
        if self._held_bytes > _MAX_BUFFERED and self._held_bytes - len(data) <= _MAX_BUFFERED:
            self.client.hold_reading()

    def attach(self, upstream: UpstreamConnection) -> None:
        self._upstream = upstream
        held, self._held = self._held, []
        if held:
            self.sent_body = True
            upstream.write_many(held)
        self._unheld()

    def _unheld(self) -> None:
        if self._held_bytes > _MAX_BUFFERED:
            self.client.release_reading()
        self._held_bytes = 0

    def detach(self) -> None:
        self._upstream = None

    def discard(self) -> None:
        """What is left of the body is read and dropped (the answer is given)."""
        self._discard = True
        self._upstream = None
        self._held = []
        self._unheld()


class GatewayFront:
    """The protocol factory of the gateway's listening socket, and what its connections
    share: the gateway (routes, metrics), the pool of upstream connections, and where
    the app is."""

    def __init__(self, gateway: Gateway, app_socket: str, *, keep_alive_s: float) -> None:
        self.gateway = gateway
        self.keep_alive_s = keep_alive_s
        self.app = Upstream("app", unix_path=app_socket)
        self.pool = UpstreamPool(gateway.node_tls)
        self.connections: set[ClientConnection] = set()
        self._nodes: dict[str, Upstream] = {}
        self._timers: dict[tuple[bytes, int], Any] = {}

    def __call__(self) -> ClientConnection:
        return ClientConnection(self)

    def node(self, node: NodeInfo) -> Upstream:
        url = node.report.url
        found = self._nodes.get(url)
        if found is None:
            if len(self._nodes) > 10_000:
                self._nodes.clear()
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            found = self._nodes[url] = Upstream(
                node.node_id, parts.hostname or "", parts.port or (443 if tls else 80), tls
            )
        return found

    def observe(self, method: bytes, status: int, started: float) -> None:
        """A sandbox's request timed to its response head, as the app times its own."""
        key = (method, status)
        timer = self._timers.get(key)
        if timer is None:
            if len(self._timers) > 1000:
                self._timers.clear()
            timer = self._timers[key] = self.gateway.request_seconds.labels(
                "gateway", method.decode("latin-1"), "sandbox-traffic", str(status)
            )
        timer.observe(time.perf_counter() - started)

    def close(self) -> None:
        for connection in list(self.connections):
            connection.abort()
        self.pool.close()


class ClientConnection(asyncio.Protocol):
    """One client's connection: requests parsed as they come, answered one after another
    (pipelined ones wait their turn, their bodies held)."""

    def __init__(self, front: GatewayFront) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._queue: collections.deque[_Exchange] = collections.deque()
        self._runner: asyncio.Task[None] | None = None
        self._incoming: _Exchange | None = None
        self._active: UpstreamConnection | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._reading_head = False
        self._head_read = 0
        self._broken = False
        self._upgraded = False
        self._closed = False
        self._write_paused = False
        self._holds = 0
        self._idle: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self.front.connections.add(self)
        self._idle_from_now()

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        if self._upgraded:
            if self._incoming is not None:
                self._incoming.body(data)
            return
        if self._reading_head:
            self._head_read += len(data)
            if self._head_read > MAX_HEAD_READ_BYTES:
                self._refuse(431, f"request head exceeds {MAX_HEADER_BYTES} bytes")
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgraded = True
            rest = data[int(exc.args[0]) :]
            if rest and self._incoming is not None:
                self._incoming.body(rest)
        except httptools.HttpParserError as exc:
            self._refuse(400, f"invalid HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.front.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        if self._active is not None:
            self._active.close()  # a stream the node is in no hurry to end ends with it
        self._queue.clear()

    def eof_received(self) -> bool:
        # A client that shuts its sending side is done: an upgraded pipe or an answer
        # under way ends with it, as it would with a relay through uvicorn.
        return False

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._active is not None and self._active.transport is not None:
            self._active.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._active is not None and self._active.transport is not None:
            self._active.transport.resume_reading()

    # -- upstreams.Peer ----------------------------------------------------------------
    def hold_reading(self) -> None:
        self._holds += 1
        if self._holds == 1 and self.transport is not None and not self._closed:
            self.transport.pause_reading()

    def release_reading(self) -> None:
        self._holds = max(0, self._holds - 1)
        if self._holds == 0 and self.transport is not None and not self._closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- llhttp's callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._url = b""
        self._headers = []
        self._reading_head = True
        self._head_read = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._reading_head = False
        parser = self._parser
        method = parser.get_method()
        upgrade = parser.should_upgrade()
        lowered = [(name.lower(), value) for name, value in self._headers]
        dropped = _CONNECTION_HEADERS - _UPGRADE_HEADERS if upgrade else _CONNECTION_HEADERS
        version = parser.get_http_version().encode()
        lines = [method, b" ", self._url, b" HTTP/", version, b"\r\n"]
        size = 0
        exchange = _Exchange(self, b"", lowered, method)
        for (name, value), (low, _) in zip(self._headers, lowered, strict=True):
            size += len(name) + len(value) + 4
            if low in dropped:
                if low == b"expect" and value.lower() == b"100-continue":
                    exchange.expects_continue = True
                continue
            if low == b"transfer-encoding":
                exchange.chunked = b"chunked" in value.lower()
                exchange.has_body = True
            elif low == b"content-length":
                exchange.has_body = exchange.has_body or value.strip() not in (b"0", b"")
            lines += (name, b": ", value, b"\r\n")
        lines.append(b"\r\n")
        exchange.head = b"".join(lines)
        exchange.keep_alive = parser.should_keep_alive()
        exchange.upgrade = upgrade
        if size > MAX_HEADER_BYTES:
            exchange.refusal = (431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
        elif method == b"CONNECT":
            exchange.refusal = (405, "CONNECT is not served here")
        if exchange.refusal is not None:
            exchange.keep_alive = False  # a client that sends such heads is let go
        self._headers = []
        self._incoming = exchange
        self._queue.append(exchange)
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())

    def on_body(self, body: bytes) -> None:
        exchange = self._incoming
        if exchange is not None:
            if exchange.chunked:
                exchange.body(b"%x\r\n%b\r\n" % (len(body), body))
            else:
                exchange.body(body)

    def on_message_complete(self) -> None:
        exchange = self._incoming
        if exchange is not None:
            if exchange.chunked:
                exchange.body(b"0\r\n\r\n")
            exchange.body_complete = True

    # -- answering ---------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while self._queue and not self._closed:
                keep = await self._serve(self._queue[0])
                if self._queue:
                    self._queue.popleft()
                if not keep and self.transport is not None:
                    self._broken = True
                    self.transport.close()
                    return
        except Exception:
            log.exception("relaying a request failed")
            self.abort()
        finally:
            self._runner = None
        self._idle_from_now()

    async def _serve(self, exchange: _Exchange) -> bool:
        """Answer one request; whether the client's connection stays open after it."""
        if exchange.refusal is not None:
            return self._answer(exchange, *exchange.refusal)
        gateway = self.front.gateway
        target = target_of(Headers(raw=exchange.headers), gateway.domain)
        if target is None:
            return await self._relay(exchange, self.front.app, None, None, False, 0.0)
        sandbox_id = target.sandbox_id
        started = time.perf_counter()
        try:
            node, cached = await gateway.traffic_route(sandbox_id)
        except (NodeUnavailable, SchedulerUnavailable) as exc:
            return self._answer(exchange, 503, str(exc), started)
        except SchedulerRefused as exc:
            return self._answer(exchange, exc.status, exc.message, started)
        if node is None:
            # What a node's proxy answers for an unknown sandbox (E2B's edge too).
            return self._answer(exchange, 502, f"The sandbox {sandbox_id} was not found", started)
        upstream = self.front.node(node)
        return await self._relay(exchange, upstream, node, sandbox_id, cached, started)

    async def _relay(
        self,
        exchange: _Exchange,
        upstream: Upstream,
        node: NodeInfo | None,
        sandbox_id: str | None,
        cached: bool,
        started: float,
    ) -> bool:
        """Relay ``exchange`` to ``upstream`` (``node``'s proxy for ``sandbox_id``'s
        traffic, found in the route cache when ``cached``; else the app), and its answer
        back; whether the client's connection stays open after it."""
        front, gateway = self.front, self.front.gateway
        sent = time.perf_counter()
        try:
            conn = await self._send(exchange, upstream)
            if node is not None and cached and conn.status == 502 and sandbox_id is not None:
                # What a node's proxy answers for a sandbox it does not hold: the cached
                # route may be stale (another gateway resumed the sandbox elsewhere).
                # Dropped either way; a request without a body goes again to the owner
                # the scheduler names now, when that is another node (the owner's own
                # 502, say from the app, is its answer).
                gateway.forget_route(sandbox_id)
                try:
                    fresh, _ = await gateway.traffic_route(sandbox_id)
                except (NodeUnavailable, SchedulerUnavailable, SchedulerRefused) as exc:
                    conn.close()
                    return self._answer(exchange, 503, str(exc), started)
                if not exchange.has_body and fresh is not None and fresh.node_id != node.node_id:
                    conn.close()
                    exchange.detach()
                    node, upstream = fresh, front.node(fresh)
                    conn = await self._send(exchange, upstream)
        except UpstreamFailed as exc:
            if node is None:
                return self._answer(exchange, 503, f"the gateway's app did not answer ({exc})")
            gateway.observe_upstream(node.node_id, sent, "error")
            assert sandbox_id is not None
            gateway.forget_route(sandbox_id)
            reason = NodeUnavailable(node.node_id, f"did not answer ({exc})", sandbox_id)
            return self._answer(exchange, 503, str(reason), started)
        if node is not None:
            gateway.observe_upstream(node.node_id, sent, "ok")
            front.observe(exchange.method, conn.status, started)
        assert conn.done is not None
        if self._closed:  # the client left while the node answered
            conn.close()
            return False
        self._active = conn
        if self._write_paused and conn.transport is not None:
            conn.transport.pause_reading()
        conn.forward()
        whole = await conn.done
        self._active = None
        exchange.discard()
        if conn.upgraded or self._closed:
            conn.close()
            return False
        keep = whole and exchange.keep_alive and conn.keep_alive and not exchange.upgrade
        if whole and exchange.body_complete and conn.reusable:
            front.pool.give_back(upstream, conn)
        else:
            conn.close()
        return keep

    async def _send(self, exchange: _Exchange, upstream: Upstream) -> UpstreamConnection:
        """The request sent to ``upstream``, its response's final head read. A kept
        connection the upstream closed just as it was taken is replaced once, for a
        request without a body (one with a body may have been acted on)."""
        assert self.transport is not None
        while True:
            conn = await self.front.pool.take(upstream)
            conn.begin(exchange.head, self.transport, self, head_only=exchange.method == b"HEAD")
            exchange.attach(conn)
            if exchange.expects_continue:
                exchange.expects_continue = False
                self.transport.write(_CONTINUE)
            assert conn.head is not None
            try:
                await conn.head
                return conn
            except UpstreamFailed:
                conn.close()
                exchange.detach()
                if not conn.reused or exchange.has_body or exchange.upgrade:
                    raise

    def _answer(
        self, exchange: _Exchange, status: int, message: str, started: float | None = None
    ) -> bool:
        """The front's own JSON answer (``{code, message}``, as the app's errors); the
        connection is kept when the request was read whole."""
        exchange.discard()
        keep = exchange.keep_alive and exchange.body_complete and not exchange.upgrade
        if started is not None:
            self.front.observe(exchange.method, status, started)
        body = json.dumps({"code": status, "message": message}).encode()
        head = [
            b"HTTP/1.1 %d %b" % (status, HTTPStatus(status).phrase.encode()),
            b"date: " + formatdate(usegmt=True).encode(),
            b"content-type: application/json",
            b"content-length: %d" % len(body),
        ]
        if not keep:
            head.append(b"connection: close")
        if self.transport is not None and not self._closed:
            self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        return keep

    def _refuse(self, status: int, message: str) -> None:
        """A request that cannot be read: answered in its turn, then the connection
        closed (what follows cannot be trusted to start a request)."""
        self._broken = True
        exchange = _Exchange(self, b"", [], b"GET")
        exchange.refusal = (status, message)
        self._incoming = None
        self._queue.append(exchange)
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())

    def _idle_from_now(self) -> None:
        if self._closed or self._queue or self.transport is None:
            return
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(
            self.front.keep_alive_s, self.transport.close
        )

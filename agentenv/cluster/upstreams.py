"""The gateway front's connections to where it relays requests (``front``): a node's proxy
(TCP, or TLS for ``https://`` nodes, verified against the gateway's CA bundle) or the
gateway's own app (a Unix socket only the gateway's process can reach). One exchange at a
time on each; kept open between exchanges (keep-alive) and taken again, newest first, by
the next request for the same upstream.

A response goes on to the client as the bytes that arrive, neither re-framed nor copied
into messages: llhttp (httptools' ``HttpResponseParser``) reads them only to learn the
status (before anything is passed on, so the front can still try another node), where the
response ends (so the connection can serve the next request) and whether the upstream
keeps the connection open. A ``101 Switching Protocols`` turns the connection into a
plain pipe both ways (WebSockets) until either side closes. Flow control is the
transports' own: while the client's socket is full the upstream is not read, and while
the upstream's is full the client is not read, so a slow reader slows the writer instead
of filling memory.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import Protocol, cast

import httptools

#: How long an unused connection is kept; the nodes' servers keep theirs far longer
#: (agentenv.server.KEEP_ALIVE_S), so it is the gateway that closes them.
IDLE_S = 30.0
#: Unused connections kept per upstream; more are closed as they come back.
MAX_IDLE = 64
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Upstream:
    """Where requests are relayed: ``host:port`` (over TLS when ``tls``), or the Unix
    socket at ``unix_path``. ``label`` names it in errors and metrics."""

    label: str
    host: str = ""
    port: int = 0
    tls: bool = False
    unix_path: str | None = None


class UpstreamFailed(Exception):
    """The upstream could not be reached, or closed or garbled its answer before its
    response head was complete."""


class Peer(Protocol):
    """The client side of an exchange, whose reading an upstream pauses while it cannot
    take more of the request body."""

    def hold_reading(self) -> None: ...

    def release_reading(self) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    """One connection to an upstream. Per exchange: :meth:`begin` sends the request
    head, :meth:`write` its body, ``head`` resolves with the final response status (the
    bytes held until :meth:`forward`), ``done`` with whether the response ended whole."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._sink: asyncio.Transport | None = None
        self._peer: Peer | None = None
        self._held: list[bytes] | None = None
        self.head: asyncio.Future[int] | None = None
        self.done: asyncio.Future[bool] | None = None
        self.status = 0
        self.keep_alive = False
        self.upgraded = False
        self._complete = False
        self._head_only = False
        self._interim = False
        self._holding_peer = False

    # -- one exchange ------------------------------------------------------------------
    def begin(self, head: bytes, sink: asyncio.Transport, peer: Peer, *, head_only: bool) -> None:
        """Send a request's head; the response will go to ``sink`` once forwarded.
        ``head_only``: the request was a HEAD, whose response has no body whatever its
        headers say (llhttp cannot be told so: such a connection is not reused)."""
        loop = asyncio.get_running_loop()
        self._sink, self._peer, self._held = sink, peer, []
        self.head, self.done = loop.create_future(), loop.create_future()
        self.status, self.keep_alive, self.upgraded = 0, False, False
        self._complete, self._head_only, self._interim = False, head_only, False
        assert self.transport is not None
        self.transport.write(head)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def write_many(self, chunks: list[bytes]) -> None:
        if self.transport is not None and not self.closed:
            self.transport.writelines(chunks)

    def forward(self) -> None:
        """Pass the response on: what is held now, then each read as it comes."""
        held, self._held = self._held, None
        if held and self._sink is not None and not self._sink.is_closing():
            self._sink.writelines(held)
        self._finish_if_complete()

    def release(self) -> None:
        """The exchange is over (the connection idle, or about to be closed): whatever
        it paused is let go (a slow client's pause must not outlive its answer)."""
        self.resume_writing()
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self._sink = self._peer = None
        self._held = None
        self.head = self.done = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def reusable(self) -> bool:
        return self._complete and self.keep_alive and not self._head_only and not self.closed

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.upgraded:
            self._pass(data)
            return
        if self.done is None:
            self.close()  # an answer to nothing: the connection cannot be trusted
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # a 101 (see on_headers_complete): the rest of `data` is the new protocol's
        except httptools.HttpParserError as exc:
            self._fail(f"sent an invalid response ({exc})")
            return
        if self._held is not None:
            self._held.append(data)
        else:
            self._pass(data)
        self._finish_if_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(f"closed the connection ({exc})" if exc else "closed the connection")
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._peer is not None and not self._holding_peer:
            self._holding_peer = True
            self._peer.hold_reading()

    def resume_writing(self) -> None:
        if self._peer is not None and self._holding_peer:
            self._holding_peer = False
            self._peer.release_reading()

    # -- llhttp's callbacks ------------------------------------------------------------
    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        self._interim = 100 <= status < 200 and status != 101
        if self._interim:
            return  # e.g. 103 Early Hints: passed on, the final head still to come
        self.status = status
        self.upgraded = status == 101
        if self.head is not None and not self.head.done():
            self.head.set_result(status)
        if self._head_only:
            self._complete = True

    def on_message_complete(self) -> None:
        if self._interim or self.upgraded:
            return  # an upgraded connection's exchange ends when either side closes
        self._complete = True
        self.keep_alive = self._parser.should_keep_alive()

    def _pass(self, data: bytes) -> None:
        sink = self._sink
        if sink is None:
            return
        if sink.is_closing():
            self.close()  # the client is gone: so is what it asked for
        else:
            sink.write(data)

    # -- ends --------------------------------------------------------------------------
    def _finish_if_complete(self) -> None:
        if self._complete and self._held is None and self.done is not None:
            if not self.done.done():
                self.done.set_result(True)

    def _fail(self, reason: str) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(UpstreamFailed(reason))
        if self.done is not None and not self.done.done():
            # An upgraded connection ends when either side closes: that is its whole end.
            self.done.set_result(self.upgraded)
        if not self.closed:
            self.close()


class UpstreamPool:
    """Idle connections per upstream, and new ones when there are none."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self._tls = tls
        self._idle: dict[Upstream, list[UpstreamConnection]] = {}

    async def take(self, upstream: Upstream) -> UpstreamConnection:
        idle = self._idle.get(upstream)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                conn.reused = True
                return conn
            conn.close()
        return await self._connect(upstream)

    def give_back(self, upstream: Upstream, conn: UpstreamConnection) -> None:
        conn.release()
        idle = self._idle.setdefault(upstream, [])
        if conn.closed or len(idle) >= MAX_IDLE:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    async def _connect(self, upstream: Upstream) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            if upstream.unix_path is not None:
                connecting = loop.create_unix_connection(UpstreamConnection, upstream.unix_path)
            else:
                connecting = loop.create_connection(
                    UpstreamConnection,
                    upstream.host,
                    upstream.port,
                    ssl=self._tls if upstream.tls else None,
                    # The certificate names the node (its URL's host), whatever Host says.
                    server_hostname=upstream.host if upstream.tls else None,
                )
            _, conn = await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
        except TimeoutError as exc:
            raise UpstreamFailed(f"did not accept a connection in {CONNECT_TIMEOUT_S:g} s") from exc
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamFailed(str(exc) or type(exc).__name__) from exc
        return conn
